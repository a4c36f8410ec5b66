#!/usr/bin/env python
"""Where a world-size-1 CUDA step goes: fsdp_wrap vs the plain module (one GPU, NCCL).

    python benchmarks/profile_cuda.py [--workload gpu] [--mixed-precision bf16] [--steps 5]

For each configuration: the median wall time of a step (CUDA events, after
warm-up), the GPU's busy time per step (sum of kernel times from
``torch.profiler``), and the top CUDA kernels.  Wall time well above busy
time means the GPU waited on the CPU (launch overhead or a synchronisation);
busy time above the plain module's means extra kernels (casts, copies).

``--host`` asks where the host's time goes instead: per configuration, the
host time of each phase of a step (``zero_grad``, forward, backward,
``optimizer.step``; the device is synchronised only between steps, so where
the host is the limit a phase's time is the host's work to issue it), the
same steps back to back (the host's time to issue them, and the step time
with one synchronise at the end), the operations in two steps that make the
host wait for the device (``torch.cuda.set_sync_debug_mode``), the
Python calls per step and the functions with the most own time under
``cProfile``.  ``--device cpu --workload tiny-gpu`` is its smoke run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_models import TINY, WORKLOADS, loss_fn, make_batches, trainer  # noqa: E402


def profile_one(key: str, w: Any, batches: list[torch.Tensor], dtype: torch.dtype | None,
                steps: int, rows: int, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    model, opt, autocast = trainer(key, w, device, dtype)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(batches[i % 2]))
        loss.backward()
        opt.step()

    for i in range(3):
        step(i)
    times = []
    for i in range(steps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0.record()
        step(i)
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
    syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaMemcpy")
    print(f"\n## {key}: step {statistics.median(times):.2f} ms (median of {steps}), "
          f"GPU busy {busy:.2f} ms/step, host syncs/memcpy {syncs / steps:.1f}/step, "
          f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))
    torch.cuda.reset_peak_memory_stats()


def host_one(key: str, w: Any, batches: list[torch.Tensor], dtype: torch.dtype | None,
             steps: int, rows: int, device: torch.device) -> None:
    """Host time per phase of a step, then the step under ``cProfile``."""
    model, opt, autocast = trainer(key, w, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    phases: dict[str, list[float]] = {"zero_grad": [], "forward": [], "backward": [], "step": []}

    def step(i: int, rec: bool) -> None:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(batches[i % 2]))
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if rec:
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name].append(dt * 1e3)

    for i in range(3):
        step(i, False)
    sync()
    for i in range(steps):
        step(i, True)
        sync()
    med = {k: statistics.median(v) for k, v in phases.items()}
    # The same steps back to back (one synchronise at the end): where they take
    # longer than the phases' sum, steps wait on the device or on each other.
    t0 = time.perf_counter()
    for i in range(steps):
        step(i, False)
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()

    def two_steps() -> None:
        step(0, False)
        step(1, False)

    syncs = _synchronising_ops(two_steps) if device.type == "cuda" else 0
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step(i, False)
        sync()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    print(f"\n## {key}: host ms/step " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
          + f" (sum {sum(med.values()):.2f}; median of {steps}); back to back: host "
          f"{(t1 - t0) / steps * 1e3:.2f}, step {(t2 - t0) / steps * 1e3:.2f}; "
          f"Python calls/step {stats.total_calls / steps:.0f}; synchronising ops in 2 steps: {syncs}")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(rows)
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join(lines[start:start + rows + 1]))


def _synchronising_ops(run: Any) -> int:
    """Operations that make the host wait for the device while ``run()`` runs
    (``torch.cuda.set_sync_debug_mode``, which warns at each; torch calls it a
    prototype that may miss some)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)
               for w in caught)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gpu",
                   choices=sorted(WORKLOADS) + [f"tiny-{k}" for k in sorted(TINY)])
    p.add_argument("--mixed-precision", default="bf16", choices=("none", "bf16", "fp16"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default="plain/-/-,fsdp_wrap/FULL_SHARD/F,fsdp_wrap/FULL_SHARD/T,"
                   "torch_fsdp1/FULL_SHARD/F")
    p.add_argument("--rows", type=int, default=12, help="kernels (functions with --host) listed per configuration")
    p.add_argument("--host", action="store_true", help="the host's time per phase and under cProfile")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args()
    if a.mixed_precision != "none":
        os.environ["FSDP_BENCH_MIXED_PRECISION"] = a.mixed_precision
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if a.device == "cuda":
        torch.cuda.set_device(0)
    elif not a.host:
        p.error("--device cpu profiles the host only: add --host")
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    w = TINY[a.workload[5:]] if a.workload.startswith("tiny-") else WORKLOADS[a.workload]
    batches = make_batches(w, 0, 2, device)
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.mixed_precision]
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"# {name} torch {torch.__version__}; {w.name}: "
          f"{w.params() / 1e6:.0f}M params, batch {w.batch}x{w.seq}, mixed precision "
          f"{a.mixed_precision}")
    for key in a.variants.split(","):
        (host_one if a.host else profile_one)(key, w, batches, dtype, a.steps, a.rows, device)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
