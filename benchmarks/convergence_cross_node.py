#!/usr/bin/env python
"""Convergence with and without each option of issue 31, on 2 nodes: the loss curves.

One command (root; network namespaces, see :mod:`fsdp_wrap.cli.testbed`)::

    python benchmarks/convergence_cross_node.py                   # 300 steps
    python benchmarks/convergence_cross_node.py --steps 20 --tiny # smoke test

The demo's small GPT (:mod:`fsdp_wrap.demo.model`: tied head, causal
attention, arithmetic sequences) trains for ``--steps`` optimizer steps of 8
micro-batches each, on 2 nodes x 2 ranks (one torchrun launch, the link
unlimited: only the numerics matter here), once per configuration, all from
the same initial weights and on the same data: fsdp_wrap exact (HYBRID_SHARD
and FULL_SHARD, torch's numerics), with sharded accumulation, with int8 or
int4 gradients across nodes, with both, and FULL_SHARD with int8 weights and
gradients routed through the nodes, or coded everywhere.  Every step's loss
(the mean over micro-batches and ranks) is recorded; the plot and the table
compare each curve with the exact run of its strategy, and the target is a
mean loss over the last 10% of steps within 1% of it.
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
sys.path.append(os.path.dirname(HERE))

from _cross_node import (  # noqa: E402
    Config,
    chosen_names,
    job_finish,
    job_setup,
    launch,
    mesh_2d,
    nothing_more_to_do,
    rst_table,
)

HYBRID, FULL = "HYBRID_SHARD", "FULL_SHARD"
MICRO = 8
CONFIGS = [
    Config("HYBRID_SHARD exact", "fsdp_wrap", HYBRID),
    Config("HYBRID_SHARD sharded acc.", "fsdp_wrap", HYBRID, "sharded"),
    Config("HYBRID_SHARD int8 grads", "fsdp_wrap", HYBRID, "every", "grads"),
    Config("HYBRID_SHARD int4 grads", "fsdp_wrap", HYBRID, "every", "grads=int4"),
    Config("HYBRID_SHARD sharded acc. + int8 w+g", "fsdp_wrap", HYBRID, "sharded", "weights,grads"),
    Config("FULL_SHARD exact", "fsdp_wrap", FULL),
    Config("FULL_SHARD int8 w+g routed", "fsdp_wrap", FULL, "every", "weights,grads"),
    Config("FULL_SHARD int8 w+g everywhere", "fsdp_wrap", FULL, "every", "weights,grads,where=all"),
]
REFERENCE = {HYBRID: "HYBRID_SHARD exact", FULL: "FULL_SHARD exact"}


def _shape(tiny: bool) -> dict[str, int]:
    if tiny:
        return dict(layers=2, width=32, heads=2, vocab=32, seq_len=16, batch=4)
    return dict(layers=4, width=96, heads=4, vocab=64, seq_len=32, batch=4)


# ---------------------------------------------------------------------------
# inside the nodes
# ---------------------------------------------------------------------------


def job(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdp_wrap.demo.model import Block, TinyGPT, make_batch

    shape = _shape(cfg["tiny"])
    batch = shape.pop("batch")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"])
    base = TinyGPT(**shape)
    mesh = mesh_2d()
    configs = [c for c in CONFIGS if c.name in cfg["names"]]
    losses: dict[str, list[float]] = {c.name: [] for c in configs}
    seconds: dict[str, float] = {}
    for c in configs:  # one after the other: each sees the same data
        model = c.build(copy.deepcopy(base), mesh, {Block})
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
        t0 = time.perf_counter()
        for step in range(cfg["steps"]):
            total = torch.zeros(1)
            for i in range(MICRO):
                x, y = make_batch(step * MICRO + i, rank, world, batch, shape["seq_len"],
                                  shape["vocab"], cfg["seed"])
                with c.micro_batch(model, last=i == MICRO - 1):
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    (loss / MICRO).backward()
                total += loss.detach() / MICRO
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(total)
            losses[c.name].append(float(total) / world)
        seconds[c.name] = time.perf_counter() - t0
        del model, opt
    return {"losses": losses, "seconds": seconds, "shape": _shape(cfg["tiny"]),
            "steps": cfg["steps"], "lr": cfg["lr"]}


def job_main(path: str) -> None:
    with open(path) as f:
        cfg = json.load(f)
    job_setup()
    job_finish(job(cfg), cfg["out"])


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------


def _tail_mean(curve: list[float]) -> float:
    return statistics.mean(curve[-max(1, len(curve) // 10):])


def report(res: dict[str, Any]) -> tuple[str, list[tuple[str, float, float]]]:
    rows, targets = [], []
    for c in CONFIGS:
        if c.name not in res["losses"]:
            continue
        curve = res["losses"][c.name]
        ref = res["losses"].get(REFERENCE[c.strategy])
        rel = None if ref is None else _tail_mean(curve) / _tail_mean(ref) - 1
        rows.append([c.name, f"{curve[0]:.4f}", f"{_tail_mean(curve):.4f}",
                     "" if rel is None else f"{100 * rel:+.2f}%",
                     f"{res['seconds'][c.name]:.0f}"])
        if rel is not None and c.quant:
            targets.append((f"{c.name}: |final loss / exact - 1|", abs(rel), 0.01))
    s = res["shape"]
    title = (f"TinyGPT {s['layers']} layers x {s['width']}, vocab {s['vocab']}, sequences of "
             f"{s['seq_len']}, {s['batch']} per micro-batch and rank; {res['steps']} steps of "
             f"{MICRO} micro-batches, AdamW lr {res['lr']}; final loss: mean of the last 10% "
             "of steps")
    header = ["configuration", "first loss", "final loss", "vs exact", "seconds"]
    return title + "\n\n" + rst_table(header, rows), targets


def plot(res: dict[str, Any], path: str) -> None:
    from fsdp_wrap._compat import matplotlib_figure

    Figure = matplotlib_figure("the convergence plot")  # noqa: N806
    fig = Figure(figsize=(10, 7), layout="constrained")
    loss_ax, rel_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    window = max(1, res["steps"] // 30)

    def smooth(v: list[float]) -> list[float]:
        return [statistics.mean(v[max(0, i - window + 1):i + 1]) for i in range(len(v))]

    colours = ["#000000", "#2171b5", "#238b45", "#d94801", "#6a51a3", "#737373", "#e7298a",
               "#a6761d"]
    for c, colour in zip(CONFIGS, colours):
        curve = res["losses"].get(c.name)
        if curve is None:
            continue
        style = "-" if c.strategy == HYBRID else "--"
        loss_ax.plot(range(1, len(curve) + 1), smooth(curve), style, color=colour, label=c.name,
                     linewidth=1.2)
        ref = res["losses"].get(REFERENCE[c.strategy])
        if ref is not None and c.name != REFERENCE[c.strategy]:
            rel = [100 * (a / b - 1) for a, b in zip(smooth(curve), smooth(ref))]
            rel_ax.plot(range(1, len(rel) + 1), rel, style, color=colour, linewidth=1.0)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel(f"loss (moving mean of {window} steps)")
    loss_ax.set_title("2 nodes x 2 ranks: the same GPT with and without each option")
    loss_ax.legend(fontsize=8)
    rel_ax.axhline(0, color="#888888", linewidth=0.8)
    for bound in (-1, 1):
        rel_ax.axhline(bound, color="#cc4444", linewidth=0.6, linestyle=":")
    rel_ax.set_ylabel("vs the exact run of its strategy (%)")
    rel_ax.set_xlabel("optimizer step (8 micro-batches)")
    fig.savefig(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", default="unlimited", help="the link's rate")
    p.add_argument("--only", default="", help="configuration names (comma-separated)")
    p.add_argument("--tiny", action="store_true", help="toy model (smoke test)")
    p.add_argument("--plot", default=None, help="write the loss curves here (png/svg/pdf)")
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--timeout", type=float, default=4 * 3600)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if nothing_more_to_do("convergence_cross_node", args.job, job_main):
        return 0
    names = chosen_names("convergence_cross_node", args.only, ",", CONFIGS)
    cfg = dict(tiny=args.tiny, steps=args.steps, lr=args.lr, seed=args.seed, names=names,
               job="convergence")
    print(f"# 2 nodes x 2 ranks, gloo, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"python {' '.join(sys.argv)}", flush=True)
    t0 = time.perf_counter()
    res = launch(__file__, cfg, args.rate, args.timeout)
    table, targets = report(res)
    print("\n" + table)
    rows = [[w, f"{g:.4f}", f"<= {goal}", "met" if g <= goal else "MISSED"] for w, g, goal in targets]
    print("\ntargets\n\n" + rst_table(["target", "measured", "goal", "status"], rows))
    print(f"\n# total {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}")
    if args.plot:
        plot(res, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
