#!/usr/bin/env python
"""Where a world-size-1 CUDA step goes: fsdp_wrap vs the plain module (one GPU, NCCL).

    python benchmarks/profile_cuda.py [--workload gpu] [--mixed-precision bf16] [--steps 5]

For each configuration: the median wall time of a step (CUDA events, after
warm-up), the GPU's busy time per step (sum of kernel times from
``torch.profiler``), and the top CUDA kernels.  Wall time well above busy
time means the GPU waited on the CPU (launch overhead or a synchronisation);
busy time above the plain module's means extra kernels (casts, copies).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_models import WORKLOADS, Variant, build, loss_fn, make_batches, make_model  # noqa: E402


def profile_one(key: str, w: Any, batches: list[torch.Tensor], dtype: torch.dtype | None,
                steps: int, rows: int, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    fw, strategy, orig = key.split("/")
    v = Variant(fw, strategy, None if orig == "-" else orig == "T")
    model = build(v, make_model(w, device=device), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    plain = fw in ("plain", "ddp")

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=plain and bool(dtype)):
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gpu", choices=sorted(WORKLOADS))
    p.add_argument("--mixed-precision", default="bf16", choices=("none", "bf16", "fp16"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", default="plain/-/-,fsdp_wrap/FULL_SHARD/F,fsdp_wrap/FULL_SHARD/T,"
                   "torch_fsdp1/FULL_SHARD/F")
    p.add_argument("--rows", type=int, default=12, help="kernels listed per configuration")
    a = p.parse_args()
    if a.mixed_precision != "none":
        os.environ["FSDP_BENCH_MIXED_PRECISION"] = a.mixed_precision
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    w = WORKLOADS[a.workload]
    batches = make_batches(w, 0, 2, device)
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.mixed_precision]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; {w.name}: "
          f"{w.params() / 1e6:.0f}M params, batch {w.batch}x{w.seq}, mixed precision "
          f"{a.mixed_precision}")
    for key in a.variants.split(","):
        profile_one(key, w, batches, dtype, a.steps, a.rows, device)
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
