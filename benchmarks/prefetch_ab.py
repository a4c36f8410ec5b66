#!/usr/bin/env python
"""Batched gathers in flight behind compute against waiting for them, in one run.

    python benchmarks/prefetch_ab.py                   # small, 30 rounds
    python benchmarks/prefetch_ab.py --workload compute --rounds 10

Two gloo ranks (one thread each) build DDP and fsdp_wrap FULL_SHARD with both
``use_orig_params`` values twice from the same weights.  One copy of each
runs as the library does (a batch that a prefetch starts stays in flight while
the current unit computes); the other waits for such a batch as soon as it is
issued (``fsdp_wrap.runtime.hooks.gather_ahead`` patched to ``async_op=False``
while it steps), which is the build before the change.  Rounds interleave
the configurations; rank 0 prints each one's median step and the medians of
the per-round ratios (to DDP, and in flight / waiting).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WAIT = {"now": False}


def _worker(rank: int, port: int, workload: str, rounds: int, tiny: bool) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from _bench_models import TINY, WORKLOADS, Variant, build, loss_fn, make_batches, make_model

    import fsdp_wrap.runtime.hooks as hooks

    real = hooks.gather_ahead

    def gather_ahead(handle: Any, cap: int, chain: Any, async_op: bool = False) -> None:
        real(handle, cap, chain, async_op=async_op and not WAIT["now"])

    hooks.gather_ahead = gather_ahead  # type: ignore[assignment]
    w = (TINY if tiny else WORKLOADS)[workload]
    batches, base = make_batches(w, rank, 4, torch.device("cpu")), make_model(w)
    runs: dict[str, tuple[Any, Any, bool]] = {}
    for key, variant, wait in [("ddp", Variant("ddp", "-", None), False)] + [
            (f"{o}/{how}", Variant("fsdp_wrap", "FULL_SHARD", o == "T"), how == "waiting")
            for o in ("F", "T") for how in ("in flight", "waiting")]:
        model = build(variant, copy.deepcopy(base), torch.device("cpu"))
        runs[key] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), wait)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds + 3):
        for key, (model, opt, wait) in runs.items():
            WAIT["now"] = wait
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(2):
                opt.zero_grad(set_to_none=True)
                loss_fn(model(batches[(r + s) % 4])).backward()
                opt.step()
            if r >= 3:  # (warm-up rounds: the forward order is known from the second step)
                times[key].append((time.perf_counter() - t0) / 2)
    if rank == 0:
        def ratio(a: str, b: str) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b]))
        print(f"# {workload}, {rounds} rounds x 2 steps, rank 0")
        for key in runs:
            print(f"{key:12s} {statistics.median(times[key]) * 1e3:7.1f} ms  / ddp {ratio(key, 'ddp'):.3f}")
        for o in ("F", "T"):
            print(f"{o}: in flight / waiting {ratio(f'{o}/in flight', f'{o}/waiting'):.3f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="small")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--tiny", action="store_true", help="toy model sizes (smoke test)")
    a = p.parse_args()
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(a.port, a.workload, a.rounds, a.tiny), nprocs=2)


if __name__ == "__main__":
    main()
