#!/usr/bin/env python
"""Explicit prefetch one and two units ahead against the default schedule: exposed
communication and step time, on 2 CPU ranks and across the test bed's slow link.

    python benchmarks/bench_overlap.py                          # both, 3 rounds
    python benchmarks/bench_overlap.py --where cpu --rounds 2
    python benchmarks/bench_overlap.py --where bed --rate 100mbit --images docs/images

Each configuration trains the demo's GPT (``--layers`` blocks of ``--width``,
one FSDP unit per block and the root) through ``fsdp-wrap trace``'s driver
(:mod:`fsdp_wrap.cli.timeline.run`): ``--warmup`` steps, then ``--steps``
profiled ones (``$FSDP_WRAP_TRACE``), read back by :mod:`fsdp_wrap.cli.timeline`.
Per configuration and round: the median over the profiled steps of the step
time (the slowest rank's) and of the exposed communication (the mean over
ranks: training-thread time inside a collective label, see
``fsdp_wrap/cli/timeline/analysis.py``); the table gives the median over rounds,
the configurations interleaved round by round so machine noise hits all
alike.

Configurations:

* ``default``: fsdp_wrap as shipped (``limit_all_gathers=True``: synchronous
  gathers on CPU, batched below 1 MiB; ``BACKWARD_PRE``);
* ``default async``: ``limit_all_gathers=False`` (asynchronous gathers; the
  default schedule: no forward prefetch, ``BACKWARD_PRE``);
* ``ahead 1`` / ``ahead 2``: ``limit_all_gathers=False`` and FSDP2's explicit
  prefetch lists (``set_modules_to_forward_prefetch`` /
  ``set_modules_to_backward_prefetch``), each unit gathering the next one or
  two units (:func:`fsdp_wrap.cli.timeline.run.prefetch_ahead`).

``--where cpu``: 2 ranks spawned on this machine (gloo over loopback).
``--where bed``: 2 nodes x 1 rank of :mod:`fsdp_wrap.cli.testbed` (network
namespaces, needs root) joined by a ``--rate`` link: every gather and
reduction crosses it.  ``--images DIR`` keeps each setting's ``default`` and
``ahead 2`` pictures of the last round as ``DIR/timeline_{cpu,bed}_*.png``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # the checkout's fsdp_wrap, unless PYTHONPATH names one

CONFIGS: dict[str, dict[str, Any]] = {
    "default": dict(prefetch_ahead=0, limit_all_gathers=True),
    "default async": dict(prefetch_ahead=0, limit_all_gathers=False),
    "ahead 1": dict(prefetch_ahead=1, limit_all_gathers=False),
    "ahead 2": dict(prefetch_ahead=2, limit_all_gathers=False),
}
PICTURES = ("default", "ahead 2")


def _measure(out: str) -> tuple[float, float]:
    """(step ms: median over steps of the slowest rank; exposed ms: median of the ranks' mean)."""
    import fsdp_wrap.cli.timeline as tl

    timeline = tl.load(out)
    n = min(len(r.steps) for r in timeline.ranks)
    steps = [max(r.steps[i].ms for r in timeline.ranks) for i in range(n)]
    exposed = [statistics.fmean(r.steps[i].exposed_ms for r in timeline.ranks) for i in range(n)]
    return statistics.median(steps), statistics.median(exposed)


def _trace_args(args: argparse.Namespace, cfg: dict[str, Any], out: str) -> list[str]:
    argv = ["--out", out, "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--layers", str(args.layers), "--width", str(args.width),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--prefetch-ahead", str(cfg["prefetch_ahead"]),
            "--title", cfg["title"]]
    if not cfg["limit_all_gathers"]:
        argv.append("--no-limit-all-gathers")
    return argv


def _run_cpu(args: argparse.Namespace, cfg: dict[str, Any], out: str) -> None:
    cmd = [sys.executable, "-m", "fsdp_wrap", "trace", *_trace_args(args, cfg, out),
           "--nprocs", "2"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _run_bed(args: argparse.Namespace, cfg: dict[str, Any], out: str) -> None:
    from fsdp_wrap.cli import testbed

    cmd = [sys.executable, "-m", "fsdp_wrap", "trace", *_trace_args(args, cfg, out)]
    with testbed.Cluster(2, rate=args.rate) as cluster:  # (removed on every exit path)
        res = cluster.run(cmd, 1, timeout=args.timeout)
    if not res.ok:
        raise RuntimeError(f"{cfg['title']} on the test bed failed:\n{res.summary()}\n"
                           + "\n".join(o[-3000:] for o in res.outputs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--where", default="cpu,bed", help="cpu, bed or both (comma-separated)")
    p.add_argument("--rate", default="100mbit", help="the test bed's link rate")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--images", default=None, help="keep the pictures here")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_overlap_")
    try:
        for where in args.where.split(","):
            run = {"cpu": _run_cpu, "bed": _run_bed}[where]
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
            setting = ("2 CPU ranks (loopback)" if where == "cpu"
                       else f"2 nodes x 1 rank, link {args.rate}")
            for rnd in range(args.rounds):
                order = list(CONFIGS)[rnd % len(CONFIGS):] + list(CONFIGS)[:rnd % len(CONFIGS)]
                for name in order:
                    out = os.path.join(work, f"{where}_{name.replace(' ', '_')}")
                    cfg = dict(CONFIGS[name], title=f"{name}: GPT {args.layers}x{args.width}, "
                               f"{setting}")
                    run(args, cfg, out)
                    results[name].append(_measure(out))
                    print(f"[{where} round {rnd + 1}] {name}: step {results[name][-1][0]:.1f} ms, "
                          f"exposed {results[name][-1][1]:.1f} ms", flush=True)
                    if args.images and rnd == args.rounds - 1 and name in PICTURES:
                        os.makedirs(args.images, exist_ok=True)
                        shutil.copy(os.path.join(out, "timeline.png"), os.path.join(
                            args.images, f"timeline_{where}_{name.replace(' ', '_')}.png"))
            _table(setting, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _table(setting: str, results: dict[str, list[tuple[float, float]]]) -> None:
    base_step = statistics.median(s for s, _ in results["default"])
    base_exp = statistics.median(e for _, e in results["default"])
    print(f"\n{setting}: medians over rounds (each the median over the profiled steps)\n")
    rows = [("configuration", "step ms", "/default", "exposed ms", "/default", "exposed %")]
    for name, vals in results.items():
        step = statistics.median(s for s, _ in vals)
        exp = statistics.median(e for _, e in vals)
        rows.append((name, f"{step:.1f}", f"{step / base_step:.2f}", f"{exp:.1f}",
                     f"{exp / max(base_exp, 1e-9):.2f}", f"{exp / step:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    rule = "  ".join("=" * w for w in widths)
    print(rule)
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print(rule)
    print(rule, flush=True)


if __name__ == "__main__":
    main()
