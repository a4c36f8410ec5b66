#!/usr/bin/env python
"""Fewer bytes across nodes: gradient accumulation and quantized collectives on 2 nodes.

One command (root; the nodes are network namespaces of this machine, made and
removed by :mod:`fsdp_wrap.cli.testbed`)::

    python benchmarks/bench_cross_node.py                     # unlimited, 1gbit, 200mbit
    python benchmarks/bench_cross_node.py --rates 200mbit --rounds 2
    python benchmarks/bench_cross_node.py --tiny --quick      # smoke test

Every optimizer step is 8 micro-batches.  For each link rate, ONE torchrun
launch on 2 nodes x 2 ranks builds every configuration from the same initial
weights and interleaves their optimizer steps (the order rotated every
round): torch's FSDP1 with FULL_SHARD and HYBRID_SHARD, reducing every
micro-batch or under ``no_sync()``; fsdp_wrap with HYBRID_SHARD reducing every
micro-batch, with sharded accumulation (``set_requires_all_reduce``), with
the replicas' all-reduce coded (``quantize_collectives``: int8 weights and
gradients where they cross nodes, int4 gradients), both, and FULL_SHARD with
its gathers and reductions routed through the nodes and coded between them.
Per configuration: the bytes its node's link sent per optimizer step (local
rank 0 reads the interface counters with a barrier on each side of each read:
``fsdp_wrap.cli.testbed.sent_during``), the step time (the
slowest rank's, between barriers) and the gradient memory each rank holds
between micro-batches (after the 7th backward: ``.grad``, parked gradients
and partial sums; the largest over ranks).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # the checkout's fsdp_wrap, unless PYTHONPATH names one

from _cross_node import (  # noqa: E402
    NODES,
    PER_NODE,
    Config,
    chosen_names,
    gradient_bytes,
    job_finish,
    job_setup,
    launch,
    mesh_2d,
    nothing_more_to_do,
    rst_table,
)

RATES = ("unlimited", "1gbit", "200mbit")
MICRO = 8
HYBRID, FULL = "HYBRID_SHARD", "FULL_SHARD"
INT8 = "weights,grads"  # (where="cross_node": the hybrid replicas' all-reduce)

CONFIGS = [
    Config("torch FULL_SHARD", "torch_fsdp1", FULL),
    Config("torch FULL_SHARD, no_sync", "torch_fsdp1", FULL, "no_sync"),
    Config("torch HYBRID_SHARD", "torch_fsdp1", HYBRID),
    Config("torch HYBRID_SHARD, no_sync", "torch_fsdp1", HYBRID, "no_sync"),
    Config("ours HYBRID_SHARD", "fsdp_wrap", HYBRID),
    Config("ours HYBRID_SHARD, sharded acc.", "fsdp_wrap", HYBRID, "sharded"),
    Config("ours HYBRID_SHARD, int8 w+g", "fsdp_wrap", HYBRID, "every", INT8),
    Config("ours HYBRID_SHARD, sharded acc. + int8 w+g", "fsdp_wrap", HYBRID, "sharded", INT8),
    Config("ours HYBRID_SHARD, sharded acc. + int4 grads", "fsdp_wrap", HYBRID, "sharded",
           "grads=int4"),
    Config("ours FULL_SHARD", "fsdp_wrap", FULL),
    Config("ours FULL_SHARD, int8 w+g routed", "fsdp_wrap", FULL, "every", INT8),
]


def _workload(tiny: bool) -> Any:
    from _bench_models import Workload

    if tiny:
        return Workload("cross", 2, 64, 2, 2, 8, "tiny")
    return Workload("cross", 6, 256, 4, 2, 32, "4.8M-parameter transformer")


# ---------------------------------------------------------------------------
# inside the nodes (every rank)
# ---------------------------------------------------------------------------


def job(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _bench_models import Block, loss_fn, make_batches, make_model

    from fsdp_wrap.cli.testbed.link import sent_during

    w = _workload(cfg["tiny"])
    configs = [c for c in CONFIGS if c.name in cfg["names"]]
    mesh = mesh_2d()
    batches = make_batches(w, dist.get_rank(), MICRO, torch.device("cpu"))
    base = make_model(w)
    models = {}
    for c in configs:
        m = c.build(copy.deepcopy(base), mesh, {Block})
        models[c.name] = (c, m, torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True))
    del base

    def opt_step(name: str) -> int:
        """One optimizer step of ``name``; the gradient bytes held between micro-batches."""
        c, m, opt = models[name]
        opt.zero_grad(set_to_none=True)
        held = 0
        for i, x in enumerate(batches):
            with c.micro_batch(m, last=i == MICRO - 1):
                (loss_fn(m(x)) / MICRO).backward()
            if i == MICRO - 2:
                held = gradient_bytes(m)
        opt.step()
        return held

    for c in configs:  # warm-up (lazy init, first allocations)
        opt_step(c.name)
    names = [c.name for c in configs]
    times: dict[str, list[float]] = {n: [] for n in names}
    sent: dict[str, list[int | None]] = {n: [] for n in names}
    held: dict[str, int] = {}
    for r in range(cfg["rounds"]):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:

            def timed(name: str = n) -> tuple[int, float]:
                t0 = time.perf_counter()
                got = opt_step(name)
                return got, time.perf_counter() - t0

            (held[n], seconds), nbytes = sent_during(timed, dist.barrier)
            times[n].append(seconds)
            sent[n].append(nbytes)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"times": times, "sent": sent, "held": held})
    return {
        "params": w.params(), "names": names, "rounds": cfg["rounds"],
        "times": {n: [max(e["times"][n][i] for e in everyone) for i in range(cfg["rounds"])]
                  for n in names},
        "sent": {n: [b for e in everyone[::PER_NODE] for b in e["sent"][n] if b is not None]
                 for n in names},
        "held": {n: max(e["held"][n] for e in everyone) for n in names},
    }


def job_main(path: str) -> None:
    import json

    with open(path) as f:
        cfg = json.load(f)
    job_setup()
    job_finish(job(cfg), cfg["out"])


# ---------------------------------------------------------------------------
# the driver (this machine)
# ---------------------------------------------------------------------------


def report(rate: str, res: dict[str, Any], targets: list[tuple[str, float, float]]) -> str:
    sent = {n: statistics.mean(res["sent"][n]) for n in res["names"]}
    time_ = {n: statistics.median(res["times"][n]) for n in res["names"]}
    ref = "torch FULL_SHARD"
    has_ref = ref in sent  # (--only may leave it out: no ratios then)
    rows = []
    for n in res["names"]:
        rows.append([n, f"{sent[n] / 1e6:.2f}", f"{sent[n] / sent[ref]:.3f}" if has_ref else "",
                     f"{time_[n]:.2f}", f"{time_[n] / time_[ref]:.2f}" if has_ref else "",
                     f"{res['held'][n] / 2**20:.2f}"])
    quant = "ours HYBRID_SHARD, int8 w+g"
    if quant in sent and has_ref:
        targets.append((f"{rate}: bytes, hybrid int8 w+g / torch FULL_SHARD",
                        sent[quant] / sent[ref], 0.3))
        targets.append((f"{rate}: step time, hybrid int8 w+g / torch FULL_SHARD",
                        time_[quant] / time_[ref], 0.5))
    acc, every = "ours HYBRID_SHARD, sharded acc.", "ours HYBRID_SHARD"
    if acc in sent and every in sent:
        # the link also carries what the nodes' shard groups do not: barriers,
        # keep-alives (about the same in both); the replicas' share is the
        # difference to the shard-group-only traffic, which a hybrid unit has none of
        targets.append((f"{rate}: bytes, sharded acc. / every micro-batch (goal 1/8)",
                        sent[acc] / sent[every], 1 / MICRO * 1.05))
    title = (f"link {rate}: {res['params'] / 1e6:.1f}M parameters, {NODES} nodes x {PER_NODE} "
             f"ranks, {MICRO} micro-batches per optimizer step, {res['rounds']} interleaved "
             "steps per row")
    header = ["configuration", "MB/step/node", "/torch FULL", "step s", "/torch FULL",
              "grad MiB/rank"]
    return title + "\n\n" + rst_table(header, rows)


def report_targets(targets: list[tuple[str, float, float]]) -> str:
    rows = [[what, f"{got:.3f}", f"<= {goal:.3f}", "met" if got <= goal else "MISSED"]
            for what, got, goal in targets]
    return "targets\n\n" + rst_table(["target", "measured", "goal", "status"], rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default=",".join(RATES), help="link rates, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="timed optimizer steps per row")
    p.add_argument("--only", default="",
                   help="configuration names to run, separated by ';' (names hold commas)")
    p.add_argument("--tiny", action="store_true", help="toy model (smoke test)")
    p.add_argument("--quick", action="store_true", help="1 round, one rate (1gbit)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # inside the nodes
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if nothing_more_to_do("bench_cross_node", args.job, job_main):
        return 0
    names = chosen_names("bench_cross_node", args.only, ";", CONFIGS)
    rates = ["1gbit"] if args.quick else [r for r in args.rates.split(",") if r]
    cfg = dict(tiny=args.tiny, rounds=1 if args.quick else args.rounds, names=names)
    print(f"# {NODES} nodes x {PER_NODE} ranks (network namespaces, torchrun c10d rendezvous), "
          f"gloo, 1 thread per rank, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"python {' '.join(sys.argv)}", flush=True)
    t_start = time.perf_counter()
    raw: dict[str, Any] = {}
    targets: list[tuple[str, float, float]] = []
    for rate in rates:
        raw[rate] = launch(__file__, dict(cfg, job="bench"), rate, args.timeout)
        print("\n" + report(rate, raw[rate], targets), flush=True)
    print("\n" + report_targets(targets))
    print(f"\n# total {time.perf_counter() - t_start:.0f} s, load {os.getloadavg()[0]:.1f}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
