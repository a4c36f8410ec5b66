#!/usr/bin/env python
"""Issue 34's GPU questions in one run: the wrapped step against the plain module's,
peak memory against torch's FSDP1, and whether reductions overlap backward compute.

    python benchmarks/gpu_unit_cost.py --device cuda          # one GPU, < 2 minutes on an H100
    python benchmarks/gpu_unit_cost.py --device cuda --trace-dir /tmp/traces
    python benchmarks/gpu_unit_cost.py --device cpu --workload small   # smoke run, no GPU

One process, world size 1 (NCCL on CUDA, gloo on the CPU), ``gpu`` workload
(303M parameters, 24 units, batch 8 x 512), bf16 (``MixedPrecision(bf16,
bf16, bf16)`` for both FSDP1s, ``torch.autocast`` for the plain module; fp32
master weights everywhere), FULL_SHARD (at world size 1 both FSDP1s run it as
NO_SHARD), both ``use_orig_params`` values:

1. **Peak memory**: each configuration alone (the others not yet built), a
   fresh model, three steps; the growth of ``max_memory_allocated`` over what
   was allocated before the model was built (tensor bytes; the caching
   allocator's reserve is not counted).
2. **Step time**: every configuration built from the same weights and kept,
   their steps interleaved round by round (the order rotated each round), the
   device synchronised around each timed block; median per configuration and
   the median of the per-round ratios to the plain module and to torch's FSDP1
   with the same ``use_orig_params``.  ``--schedule alone`` instead builds one
   configuration at a time (the others dropped), runs its rounds back to back
   and reports ratios of medians: where the two schedules disagree, what
   differs is the other models kept alive and the switching between them
   (``--no-peaks`` also skips the peak-memory runs before the timing).
   "host ms" is the part of it until the host has issued the block's last
   step (before the closing synchronise):
   close to the step time where the host is the limit, well below it where
   the device is (or where a step waits for the device midway); "cpu ms" is
   the main thread's CPU time in the same span (``time.thread_time``: less
   than "host ms" where the thread slept, e.g. waiting in a collective; on a
   CPU-only machine the measure that load moves least).  "cudaMalloc"
   counts the device memory segments the caching allocator took during the
   configuration's timed steps (all rounds): after warm-up a configuration
   that runs alone takes none, and one taken mid-step costs the host time.
3. **Overlap**: two steps of each FSDP configuration under ``torch.profiler``;
   from the exported Chrome trace, the streams kernels ran on, the kernels
   whose name contains ``nccl``, the kernels off the compute stream (the one
   with the most kernel time: the reductions' casts, copies and collectives
   run off it) and the share of their time during which a kernel ran on the
   compute stream (0% means nothing overlapped: the reductions were
   serialised with compute, or compute had nothing queued meanwhile, as
   where the host is the limit; ``--batch`` makes the step GPU-bound).  ``--trace-dir`` keeps the traces.  At world
   size 1 fsdp_wrap issues no reduction (a group of one has nothing to
   reduce), so its plain rows show none; the ``+hook`` rows register torch's
   ``allreduce_hook`` (``--hook-rows``, on by default on CUDA), which makes
   both FSDP1s all-reduce every unit's gradient through NCCL even at world
   size 1: those rows show whether the reductions overlap backward compute.

Prints one table and the targets (step <= 1.05x plain, peak <= torch's FSDP1).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_models import TINY, WORKLOADS, loss_fn, make_batches, trainer  # noqa: E402

KEYS = ("plain/-/-", "fsdp_wrap/FULL_SHARD/F", "fsdp_wrap/FULL_SHARD/T",
        "torch_fsdp1/FULL_SHARD/F", "torch_fsdp1/FULL_SHARD/T")
# (``+hook``: torch's ``allreduce_hook`` registered as the communication hook,
# so that fsdp_wrap issues a reduction at world size 1 too: the overlap rows)
HOOK_KEYS = ("fsdp_wrap/FULL_SHARD/F+hook", "torch_fsdp1/FULL_SHARD/F+hook")


def _register_allreduce_hook(model: torch.nn.Module) -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD),  # type: ignore[operator]
                             default_hooks.allreduce_hook)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
        self.w = (TINY if a.tiny else WORKLOADS)[a.workload]
        if a.batch:
            self.w = dataclasses.replace(self.w, batch=a.batch)
        self.batches = make_batches(self.w, 0, 2, self.device)
        self.dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.mixed_precision]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def drop(self) -> None:
        """Free what a dropped configuration left (its cycles, the allocator's cache)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def segments(self) -> int:
        """Device memory segments the caching allocator has taken so far (each
        a ``cudaMalloc``; a step that needs one waits for it)."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.device.type == "cuda" else 0

    def make_step(self, key: str) -> Callable[[int], None]:
        model, opt, autocast = trainer(key.removesuffix("+hook"), self.w, self.device, self.dtype)
        if key.endswith("+hook"):
            _register_allreduce_hook(model)

        def step(i: int) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=self.dtype or torch.bfloat16,
                                enabled=autocast):
                loss = loss_fn(model(self.batches[i % 2]))
            loss.backward()
            opt.step()

        return step

    def peak_mib(self, key: str) -> float | None:
        if self.device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.empty_cache()
        before = self.allocated()
        torch.cuda.reset_peak_memory_stats()
        step = self.make_step(key)
        for i in range(3):
            step(i)
        self.sync()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        del step
        gc.collect()
        return peak

    def overlap(self, key: str, step: Callable[[int], None], trace_dir: str) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for i in range(2):
                step(i)
            self.sync()
        path = os.path.join(trace_dir, key.replace("/", "_").replace("+", "_") + ".json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
        stream_time: dict[Any, float] = {}
        for e in kernels:
            st = e.get("args", {}).get("stream")
            stream_time[st] = stream_time.get(st, 0.0) + e["dur"]
        compute = max(stream_time, key=lambda st: stream_time[st]) if stream_time else None
        nccl = [e for e in kernels if "nccl" in e.get("name", "").lower()]
        # Off the compute stream: the reductions' own kernels (casts, copies,
        # NCCL's); the share of their time during which a kernel ran on the
        # compute stream is the overlap.
        off = [e for e in kernels if e.get("args", {}).get("stream") != compute]
        on = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels
                    if e.get("args", {}).get("stream") == compute)
        covered = 0.0
        for n in off:
            a, b = n["ts"], n["ts"] + n["dur"]
            end = a
            for s, e in on:
                if e <= end or s >= b:
                    continue
                covered += min(e, b) - max(s, end)
                end = min(e, b)
        total = sum(n["dur"] for n in off)
        return {"nccl_per_step": len(nccl) / 2, "off_per_step": len(off) / 2,
                "off_ms": total / 2e3,
                "streams": f"{len(stream_time)} ({compute} computes)",
                "overlap": covered / total if total else None}


class Timings:
    """Per configuration: each timed block's step time, host time and new
    device memory segments."""

    def __init__(self, keys: list[str]) -> None:
        self.times: dict[str, list[float]] = {k: [] for k in keys}
        self.host: dict[str, list[float]] = {k: [] for k in keys}
        self.cpu: dict[str, list[float]] = {k: [] for k in keys}
        self.mallocs: dict[str, int] = {k: 0 for k in keys}

    def block(self, b: Bench, key: str, step: Callable[[int], None], n: int) -> None:
        """``n`` steps, the device synchronised before and after."""
        b.sync()
        before = b.segments()
        c0, t0 = time.thread_time(), time.perf_counter()
        for i in range(n):
            step(i)
        t1 = time.perf_counter()  # (the host is done issuing; the device may still run)
        self.cpu[key].append((time.thread_time() - c0) / n * 1e3)
        b.sync()
        self.times[key].append((time.perf_counter() - t0) / n * 1e3)
        self.host[key].append((t1 - t0) / n * 1e3)
        self.mallocs[key] += b.segments() - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--workload", default="gpu", choices=sorted(WORKLOADS))
    p.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    p.add_argument("--mixed-precision", choices=("auto", "none", "bf16", "fp16"), default="auto",
                   help="auto: bf16 on CUDA, none on the CPU")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the workload's)")
    p.add_argument("--steps", type=int, default=3, help="steps per configuration and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--keys", default=",".join(KEYS))
    p.add_argument("--trace-dir", default=None, help="keep the profiler's Chrome traces here")
    p.add_argument("--schedule", choices=("interleaved", "alone"), default="interleaved",
                   help="interleaved: every model kept, blocks alternated round by round; "
                        "alone: one model at a time, its rounds back to back")
    p.add_argument("--no-peaks", dest="peaks", action="store_false",
                   help="skip the peak-memory runs (each a fresh model) before the timing")
    p.add_argument("--hook-rows", choices=("auto", "yes", "no"), default="auto",
                   help="add the +hook configurations (auto: on CUDA)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_unit_cost: no CUDA device here; nothing measured (use --device cpu for a smoke run)")
        return 0
    if a.mixed_precision == "auto":
        a.mixed_precision = "bf16" if a.device == "cuda" else "none"
    if a.mixed_precision != "none":
        os.environ["FSDP_BENCH_MIXED_PRECISION"] = a.mixed_precision  # read by _bench_models.build
    warnings.filterwarnings("ignore")
    t_start = time.perf_counter()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if a.device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    b = Bench(a)
    keys = [k for k in a.keys.split(",") if k]
    if a.hook_rows == "yes" or (a.hook_rows == "auto" and a.device == "cuda"):
        keys += [k for k in HOOK_KEYS if k not in keys]
    name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"# {name}; torch {torch.__version__}; {b.w.name}: {b.w.params() / 1e6:.0f}M params, "
          f"batch {b.w.batch}x{b.w.seq}; mixed precision {a.mixed_precision}; load "
          f"{os.getloadavg()[0]:.1f}; python {' '.join(sys.argv)}")
    peaks = {k: b.peak_mib(k) if a.peaks else None for k in keys}
    timed = Timings(keys)
    overlaps: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = a.trace_dir or tmp
        os.makedirs(trace_dir, exist_ok=True)
        if a.schedule == "interleaved":
            steps = {k: b.make_step(k) for k in keys}
            for i in range(a.warmup):
                for k in keys:
                    steps[k](i)
            for r in range(a.rounds):
                shift = r % len(keys)
                for k in keys[shift:] + keys[:shift]:
                    timed.block(b, k, steps[k], a.steps)
            overlaps = {k: b.overlap(k, steps[k], trace_dir) for k in keys if not k.startswith("plain")}
        else:  # alone: one model at a time, its rounds back to back, then dropped
            for k in keys:
                step = b.make_step(k)
                for i in range(a.warmup):
                    step(i)
                for _ in range(a.rounds):
                    timed.block(b, k, step, a.steps)
                if not k.startswith("plain"):
                    overlaps[k] = b.overlap(k, step, trace_dir)
                del step
                b.drop()
    _report(keys, timed, peaks, overlaps, a)
    print(f"# total {time.perf_counter() - t_start:.0f} s")
    dist.destroy_process_group()
    return 0


def _ratio(times: dict[str, list[float]], k: str, ref: str, paired: bool = True) -> str:
    """The median of per-round ratios where rounds were interleaved (paired in
    time), else the ratio of the medians."""
    if ref not in times or ref == k:
        return ""
    if not paired:
        return f"{statistics.median(times[k]) / statistics.median(times[ref]):.3f}"
    return f"{statistics.median(x / y for x, y in zip(times[k], times[ref])):.3f}"


def _report(keys: list[str], timed: Timings, peaks: dict[str, float | None],
            overlaps: dict[str, dict[str, Any]], a: argparse.Namespace) -> None:
    paired = a.schedule == "interleaved"
    times = timed.times
    header = ["configuration", "step ms", "host ms", "cpu ms", "cudaMalloc", "/plain", "/torch", "peak MiB", "/torch",
              "nccl/step", "streams", "off-stream kernels/step (ms)", "overlap"]
    rows = []
    for k in keys:
        torch_key = "torch_fsdp1/" + k.split("/", 1)[1] if k.startswith("fsdp_wrap") else ""
        pk, tp = peaks.get(k), peaks.get(torch_key)
        ov = overlaps.get(k, {})
        rows.append([k, f"{statistics.median(times[k]):.2f}", f"{statistics.median(timed.host[k]):.2f}",
                     f"{statistics.median(timed.cpu[k]):.2f}", str(timed.mallocs[k]),
                     _ratio(times, k, "plain/-/-", paired),
                     _ratio(times, k, torch_key, paired),
                     "" if pk is None else f"{pk:.0f}",
                     f"{pk / tp:.3f}" if pk is not None and tp else "",
                     "" if not ov else f"{ov['nccl_per_step']:g}",
                     "" if not ov else ov["streams"],
                     "" if not ov else f"{ov['off_per_step']:g} ({ov['off_ms']:.2f})",
                     "" if ov.get("overlap") is None else f"{ov['overlap']:.0%}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    rule = "  ".join("=" * n for n in widths)
    how = ("interleaved rounds", "median of per-round ratios") if paired else (
        "rounds, one model at a time", "ratio of medians")
    print(f"\n{a.rounds} {how[0]} x {a.steps} steps (ratios: {how[1]})\n")
    for line in (rule, header, rule, *rows, rule):
        print(line if isinstance(line, str) else "  ".join(c.ljust(n) for c, n in zip(line, widths)))
    print("\ntargets (issue 34): fsdp_wrap step <= 1.05x plain; peak <= torch FSDP1's")
    for k in keys:
        if not k.startswith("fsdp_wrap"):
            continue
        r = _ratio(times, k, "plain/-/-", paired)
        torch_key = "torch_fsdp1/" + k.split("/", 1)[1]
        pk, tp = peaks.get(k), peaks.get(torch_key)
        if r:
            print(f"  {k}: step {r}x plain -> {'met' if float(r) <= 1.05 else 'MISSED'}")
        if pk is not None and tp:
            print(f"  {k}: peak {pk / tp:.3f}x torch -> {'met' if pk <= tp else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
