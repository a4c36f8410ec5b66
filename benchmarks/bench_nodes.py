#!/usr/bin/env python
"""Across nodes: every sharding strategy of fsdp_wrap and torch's FSDP1, and DDP, on 2 nodes.

One command (root; the nodes are network namespaces of this machine, made and
removed by :mod:`fsdp_wrap.cli.testbed`)::

    python benchmarks/bench_nodes.py                       # unlimited, 1gbit, 200mbit
    python benchmarks/bench_nodes.py --rates 200mbit --steps 3 --no-memory
    python benchmarks/bench_nodes.py --tiny --quick        # smoke test, under a minute or two

For each link rate, ONE torchrun launch on 2 nodes x 2 ranks (c10d multi-node
rendezvous) builds every configuration from the same initial weights
(fsdp_wrap and torch's FSDP1 x FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD,
_HYBRID_SHARD_ZERO2, NO_SHARD, then DDP; one unit per transformer block and
the root; the hybrid strategies on a 2-D ``device_mesh`` (replicate across
nodes, shard within), since torch's FSDP1 builds no hybrid groups on CPU) and
interleaves their steps A, B, C, ..., A, B, C, ... with the order rotated
every round, so machine noise hits all alike.  A step (zero_grad, forward,
backward, AdamW step) is timed between barriers on every rank; its time is the
slowest rank's.  Local rank 0 of each node reads its interface's counters
before and after every step: MB across the link per step and node.  The link's
protocol overhead (headers, acks) is measured first by exchanging a known
payload between the nodes; the strategy's count
(:func:`fsdp_wrap.cli.testbed.wire.step_bytes`) times it is the ``x count``
column's denominator.  Peak memory: each configuration in fresh processes
(unlimited link, 2 steps), growth of each rank's RSS high-water mark over the
RSS before the model was built, maximum over ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
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
    job_finish,
    job_setup,
    launch,
    nothing_more_to_do,
    rst_table,
)

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")
FRAMEWORKS = ("fsdp_wrap", "torch_fsdp1")
RATES = ("unlimited", "1gbit", "200mbit")
CALIBRATION_BYTES = 8 * 2**20


# ---------------------------------------------------------------------------
# inside the nodes (every rank)
# ---------------------------------------------------------------------------


def _workload(tiny: bool) -> Any:
    from _bench_models import Workload

    if tiny:
        return Workload("nodes", 2, 256, 4, 2, 8, "tiny")
    return Workload("nodes", 9, 384, 6, 2, 64, "16M-parameter transformer")


def _keys(cfg: dict[str, Any]) -> list[str]:
    keys = [f"{fw}/{s}" for s in cfg["strategies"] for fw in cfg["frameworks"]]
    return keys + (["ddp/-"] if cfg["ddp"] else [])


def _build(key: str, model: Any, mesh: Any) -> Any:
    from _bench_models import Variant, build

    fw, strategy = key.split("/")
    return build(Variant(fw, strategy, False if fw != "ddp" else None), model,
                 _torch().device("cpu"), device_mesh=mesh if "HYBRID" in strategy else None)


def _torch() -> Any:
    import torch

    return torch


def _calibrate() -> dict[str, Any]:
    """Each rank exchanges a known payload with its peer on the other node."""
    torch, dist = _torch(), _torch().distributed
    peer = (dist.get_rank() + PER_NODE) % dist.get_world_size()
    out = torch.ones(CALIBRATION_BYTES // 4)
    inp = torch.empty_like(out)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inp, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    from fsdp_wrap.cli.testbed.link import sent_during

    exchange()
    return {"sent": sent_during(exchange, dist.barrier)[1], "payload": PER_NODE * CALIBRATION_BYTES}


def job_interleaved(cfg: dict[str, Any]) -> dict[str, Any]:
    torch, dist = _torch(), _torch().distributed
    from _bench_models import loss_fn, make_batches, make_model
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_wrap.cli.testbed.link import link_during, node_frame_bytes

    w = _workload(cfg["tiny"])
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    batches = make_batches(w, rank, 4, torch.device("cpu"))
    base = make_model(w)
    keys = _keys(cfg)
    models = {}
    for k in keys:
        m = _build(k, copy.deepcopy(base), mesh)
        models[k] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True))
    del base
    calibration = _calibrate()

    def step(k: str, i: int) -> float:
        m, opt = models[k]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m(batches[i % len(batches)]))
        loss.backward()
        opt.step()
        return float(loss.item())

    first = {k: step(k, 0) for k in keys}
    times: dict[str, list[float]] = {k: [] for k in keys}
    sent: dict[str, list[int | None]] = {k: [] for k in keys}
    resent: dict[str, list[int | None]] = {k: [] for k in keys}  # TCP segments sent again
    last: dict[str, float] = {}
    for r in range(cfg["steps"]):
        shift = r % len(keys)
        for k in keys[shift:] + keys[:shift]:
            def timed(k: str = k, i: int = r + 1) -> float:
                t0 = time.perf_counter()  # every rank starts after sent_during's barriers
                loss = step(k, i)
                times[k].append(time.perf_counter() - t0)
                return loss

            last[k], link = link_during(timed, dist.barrier)
            sent[k].append(None if link is None else link[0])
            resent[k].append(None if link is None else link[1])
    units = {k: _unit_bytes(models[k][0], k) for k in keys}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"times": times, "sent": sent, "resent": resent,
                                      "last": last, "frame": node_frame_bytes()})
    return {
        "params": w.params(), "keys": keys, "first": first, "units": units,
        "calibration": calibration,
        "times": {k: [max(e["times"][k][i] for e in everyone) for i in range(cfg["steps"])]
                  for k in keys},
        "sent": {k: [e["sent"][k] for e in everyone[::PER_NODE]] for k in keys},
        "resent": {k: [e["resent"][k] for e in everyone[::PER_NODE]] for k in keys},
        "frame": [e["frame"] for e in everyone[::PER_NODE]],
        "last": {k: [e["last"][k] for e in everyone] for k in keys},
    }


def _unit_bytes(model: Any, key: str) -> tuple[list[int], int]:
    fw, strategy = key.split("/")
    if fw == "ddp":
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        return [total], 0
    shard = 1 if strategy == "NO_SHARD" else model.world_size
    units, root = [], 0
    for name, p in model.named_parameters():
        units.append(p.numel() * shard * p.element_size())
        if name.replace("_fsdp_wrapped_module.", "") == "_flat_param":
            root = units[-1]
    return units, root


def job_memory(cfg: dict[str, Any]) -> dict[str, Any]:
    torch, dist = _torch(), _torch().distributed
    from _bench_measure import PeakMemory
    from _bench_models import loss_fn, make_batches, make_model
    from torch.distributed.device_mesh import init_device_mesh

    w = _workload(cfg["tiny"])
    key = cfg["key"]
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    batches = make_batches(w, dist.get_rank(), 2, torch.device("cpu"))
    warm = torch.nn.Linear(8, 8)  # one-time costs (autograd, allocator) before the baseline
    torch.optim.AdamW(warm.parameters(), foreach=True).step()
    warm(torch.randn(2, 8)).sum().backward()
    mem = PeakMemory(torch.device("cpu"))
    dist.barrier()
    mem.start_window()
    baseline = mem.current()
    model = _build(key, make_model(w), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for i in range(2):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batches[i])).backward()
        opt.step()
    peak = mem.peak() - baseline
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, peak)
    return {"peak": max(everyone)}


def job_main(config_path: str) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    job_setup()
    result = (job_interleaved if cfg["job"] == "interleaved" else job_memory)(cfg)
    job_finish(result, cfg["out"])


# ---------------------------------------------------------------------------
# the driver (this machine)
# ---------------------------------------------------------------------------


def report(rate: str, res: dict[str, Any], memory: dict[str, float],
           targets: list[tuple[str, float, float]]) -> str:
    from fsdp_wrap.cli.testbed.wire import step_bytes

    cal = res["calibration"]
    overhead = cal["sent"] / cal["payload"]
    rows = []
    for k in res["keys"]:
        fw, strategy = k.split("/")
        t = res["times"][k]
        ref = f"torch_fsdp1/{strategy}"
        ratio = (statistics.median(a / b for a, b in zip(t, res["times"][ref]))
                 if fw == "fsdp_wrap" and ref in res["times"] else None)
        per_step = [b for node in res["sent"][k] for b in node if b is not None]
        mb = statistics.mean(per_step) / 1e6
        units, root = res["units"][k]
        count = step_bytes("DDP" if fw == "ddp" else strategy, units, root, NODES, PER_NODE)
        x_count = mb * 1e6 / (count * overhead)
        rows.append([strategy, fw, f"{statistics.median(t):.2f}",
                     "" if ratio is None else f"{ratio:.2f}", f"{mb:.1f}", f"{x_count:.3f}",
                     f"{memory[k] / 2**20:.0f}" if k in memory else "",
                     f"{max(res['last'][k]):.6f}"])
        if fw == "fsdp_wrap":
            targets.append((f"{rate} {strategy}: bytes / strategy's count", x_count, 1.05))
            if ref in res["times"]:
                theirs = statistics.mean(b for node in res["sent"][ref] for b in node if b)
                # 0.5%: what barriers and torchrun's keep-alives add to a step's count
                targets.append((f"{rate} {strategy}: bytes / torch FSDP1's", mb * 1e6 / theirs,
                                1.005))
                targets.append((f"{rate} {strategy}: step time / torch FSDP1's", ratio or 0.0, 1.0))
    first = res["first"].values()
    title = (f"link {rate}: {res['params'] / 1e6:.1f}M parameters, {len(res['times'][res['keys'][0]])}"
             f" interleaved steps per row; protocol overhead {overhead:.4f}; first-step losses "
             f"agree to {max(first) - min(first):.1e}")
    resent = sum(n for per_key in res.get("resent", {}).values() for node in per_key
                 for n in node if n)
    if resent:  # (a loaded machine: the link's queue dropped and TCP sent again)
        title += (f"; {resent} TCP segments resent during the timed steps, each up to one "
                  "frame more in its row's bytes")
    header = ["strategy", "framework", "step s", "/fsdp1", "MB/step/node", "x count",
              "peak MiB/rank", "last loss (max over ranks)"]
    return title + "\n\n" + rst_table(header, rows)


def report_targets(targets: list[tuple[str, float, float]]) -> str:
    rows = [[what, f"{got:.3f}", f"<= {goal:g}", "met" if got <= goal else "MISSED"]
            for what, got, goal in targets]
    return "targets\n\n" + rst_table(["target", "measured", "goal", "status"], rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default=",".join(RATES), help="link rates, comma-separated")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--steps", type=int, default=4, help="timed rounds per rate")
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory runs")
    p.add_argument("--tiny", action="store_true", help="toy model (smoke test)")
    p.add_argument("--quick", action="store_true", help="2 rounds, one rate (1gbit), no memory")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # inside the nodes
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if nothing_more_to_do("bench_nodes", args.job, job_main):
        return 0
    rates = ["1gbit"] if args.quick else [r for r in args.rates.split(",") if r]
    cfg: dict[str, Any] = dict(
        tiny=args.tiny, steps=2 if args.quick else args.steps,
        strategies=[s for s in args.strategies.split(",") if s],
        frameworks=[f for f in args.frameworks.split(",") if f], ddp=not args.no_ddp)
    print(f"# {NODES} nodes x {PER_NODE} ranks (network namespaces, torchrun c10d rendezvous), "
          f"gloo, 1 thread per rank, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"python {' '.join(sys.argv)}", flush=True)
    t_start = time.perf_counter()
    memory: dict[str, float] = {}
    if not (args.no_memory or args.quick):
        for key in _keys(cfg):
            memory[key] = launch(__file__, dict(cfg, job="memory", key=key), "unlimited", args.timeout)["peak"]
    raw: dict[str, Any] = {"memory": memory, "rates": {}}
    targets: list[tuple[str, float, float]] = []
    for rate in rates:
        res = launch(__file__, dict(cfg, job="interleaved"), rate, args.timeout)
        raw["rates"][rate] = res
        print("\n" + report(rate, res, memory, targets), flush=True)
    print("\n" + report_targets(targets))
    print(f"\n# total {time.perf_counter() - t_start:.0f} s, load {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
