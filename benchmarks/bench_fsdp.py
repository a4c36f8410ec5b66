#!/usr/bin/env python
"""Side-by-side benchmark: torch's FSDP1, fsdp_wrap, torch's FSDP2 and DDP.

One command::

    python benchmarks/bench_fsdp.py            # CPU, 2 gloo ranks, ~8 minutes
    python benchmarks/bench_fsdp.py --quick    # fewer steps, no 1B row, < 2 minutes
    python benchmarks/bench_fsdp.py --device cuda [--nproc N]   # NCCL, one GPU per rank
    python benchmarks/bench_fsdp.py --device cuda --workloads gpu --mem-workload gpu \
        --mixed-precision bf16 --frameworks torch_fsdp1,fsdp_wrap,plain --nproc 1
    python benchmarks/bench_fsdp.py --device cuda --nproc 2 --backend gloo  # 2 ranks, 1 GPU

Three measurements, each printed as a reStructuredText table:

1. **Step time** (``compute`` and ``small`` workloads).  In ONE process group
   every configuration of every framework is built from the same initial
   weights; then their training steps are interleaved (A, B, C, ..., A, B, C,
   ..., the order rotated each round), each preceded by a barrier, so machine
   noise hits all of them alike.  A step is ``zero_grad``, forward, loss,
   backward and ``AdamW.step``; its time is the slowest rank's.  The table gives
   the median and the median of the per-round ratios to torch's FSDP1 (same
   strategy and ``use_orig_params``) and to DDP.  Collective bytes and calls
   per step are counted in one extra, untimed step under a
   ``TorchDispatchMode`` that sees every ``c10d`` op; construction time is the
   wrapper's constructor alone.
2. **Peak memory** (``large`` workload, ~100M parameters): each configuration
   in its own fresh processes (an allocator's high-water mark cannot be
   separated between frameworks sharing a process).  Growth over the RSS
   before the model was built (CUDA: ``max_memory_allocated``).
3. **Meta-device construction** of a 1B-parameter model, fresh processes.

At world size 1 a ``plain`` row (the unwrapped module) measures the wrapper's
own overhead.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The checkout's fsdp_wrap, unless PYTHONPATH names another copy (e.g. a snapshot
# of a given commit: ``git archive HEAD fsdp_wrap | tar -x -C /tmp/snap``).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_measure import Clock, CollectiveCounter, PeakMemory, malloc_trim  # noqa: E402
from _bench_models import (  # noqa: E402
    FRAMEWORKS,
    STRATEGIES,
    TINY,
    WORKLOADS,
    Variant,
    Workload,
    build,
    build_meta,
    loss_fn,
    low_precision,
    make_batches,
    make_model,
    variants_for,
)

from fsdp_wrap.comm.teardown import exit_now  # noqa: E402

N_BATCHES = 4


# ---------------------------------------------------------------------------
# process launch
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job: str, cfg: dict[str, Any]) -> Any:
    """Run ``job`` on ``cfg['nproc']`` fresh ranks; return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        # forkserver: every rank is a fresh process, forked from a server that
        # has torch imported already, which saves seconds per launch.
        mp.start_processes(_worker, args=(job, cfg, _free_port(), out), nprocs=cfg["nproc"],
                           join=True, start_method="forkserver")
        with open(out) as f:
            return json.load(f)


def _worker(rank: int, job: str, cfg: dict[str, Any], port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ws = cfg["nproc"]
    if cfg["device"] == "cuda":
        # More ranks than GPUs (--backend gloo): ranks share the GPUs round-robin.
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = cfg["backend"]
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(cfg["threads"])
    dist.init_process_group(backend, rank=rank, world_size=ws, device_id=device if backend == "nccl" else None)
    try:
        result = JOBS[job](rank, ws, device, cfg)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    exit_now()  # see fsdp_wrap/comm/teardown.py: gloo's threads vs interpreter shutdown


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _workload(cfg: dict[str, Any], name: str) -> Workload:
    return (TINY if cfg["tiny"] else WORKLOADS)[name]


# ---------------------------------------------------------------------------
# job 1: interleaved step times, bytes, construction
# ---------------------------------------------------------------------------


def job_interleaved(rank: int, ws: int, device: torch.device, cfg: dict[str, Any]) -> Any:
    w = _workload(cfg, cfg["workload"])
    variants = [Variant(**v) for v in cfg["variants"]]
    clock = Clock(device)
    batches = make_batches(w, rank, N_BATCHES, device)
    _import_frameworks()
    base = make_model(w)
    models: dict[str, Any] = {}
    construct: dict[str, float] = {}
    for v in variants:
        m = copy.deepcopy(base).to(device)
        dist.barrier()
        t0 = clock.now()
        wrapped = build(v, m, device)
        construct[v.key] = clock.now() - t0
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=True)
        models[v.key] = (wrapped, opt)
    del base

    def step(key: str, i: int) -> torch.Tensor:
        model, opt = models[key]
        opt.zero_grad(set_to_none=True)
        with _autocast(key, device):
            loss = loss_fn(model(batches[i % N_BATCHES]))
        loss.backward()
        opt.step()
        return loss

    keys = [v.key for v in variants]
    first_loss = {k: step(k, 0).item() for k in keys}  # same weights, same data
    for r in range(1, cfg["warmup"]):
        for k in keys:
            step(k, r)

    profile = None
    if cfg.get("profile"):
        profile = _profile(keys, step, cfg["profile_steps"], rank)

    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(cfg["steps"]):
        shift = r % len(keys)
        for k in keys[shift:] + keys[:shift]:
            dist.barrier()
            t0 = clock.now()
            step(k, r)
            times[k].append(clock.now() - t0)

    colls: dict[str, Any] = {}
    for k in keys:
        counter = CollectiveCounter()
        dist.barrier()
        with counter:
            step(k, 0)
        colls[k] = {"bytes": dict(counter.bytes), "calls": dict(counter.calls)}

    all_times = _gather(times)
    all_construct = _gather(construct)
    step_max = {k: [max(t[k][i] for t in all_times) for i in range(cfg["steps"])] for k in keys}
    return {
        "workload": w.name,
        "params": w.params(),
        "variants": [v.key for v in variants],
        "times": step_max,
        "construct": {k: max(c[k] for c in all_construct) for k in keys},
        "colls": colls,
        "first_loss": first_loss,
        "profile": profile,
    }


def _autocast(key: str, device: torch.device) -> Any:
    """``--mixed-precision`` for the wrappers without a MixedPrecision option."""
    dtype = low_precision()
    plain = key.split("/")[0] in ("ddp", "plain")
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=bool(dtype) and plain)


def _profile(keys: list[str], step: Any, n: int, rank: int) -> dict[str, str]:
    """torch.profiler tables of ``n`` steps per configuration (rank 0's)."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for k in keys:
        if not k.startswith(("torch_fsdp1", "fsdp_wrap")):
            continue
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
            for i in range(n):
                step(k, i)
        if rank == 0:
            tables[k] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return tables


# ---------------------------------------------------------------------------
# job 2: peak memory of one configuration
# ---------------------------------------------------------------------------


def job_memory(rank: int, ws: int, device: torch.device, cfg: dict[str, Any]) -> Any:
    w = _workload(cfg, cfg.get("mem_workload", "large"))
    v = Variant(**cfg["variant"])
    mem = PeakMemory(device)
    clock = Clock(device)
    batches = make_batches(w, rank, N_BATCHES, device)
    _warm_up_process(device)
    dist.barrier()
    mem.start_window()
    base = mem.current()
    model = make_model(w, device=device)
    t0 = clock.now()
    wrapped = build(v, model, device)
    construct_s = clock.now() - t0
    del model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=True)
    construct_peak = mem.peak() - base
    step_times = []
    fwd_bwd_peak = train_peak = 0
    for i in range(cfg["mem_steps"]):
        dist.barrier()
        mem.start_window()
        t0 = clock.now()
        opt.zero_grad(set_to_none=True)
        with _autocast(v.key, device):
            loss = loss_fn(wrapped(batches[i % N_BATCHES]))
        loss.backward()
        fwd_bwd_peak = max(fwd_bwd_peak, mem.peak() - base)
        opt.step()
        step_times.append(clock.now() - t0)
        train_peak = max(train_peak, mem.peak() - base)
    malloc_trim()
    resident = mem.current() - base
    mine = {
        "construct_peak": construct_peak,
        "train_peak": train_peak,
        "fwd_bwd_peak": fwd_bwd_peak,
        "resident": resident,
        "construct_s": construct_s,
        "step_s": statistics.median(step_times),
    }
    everyone = _gather(mine)
    return {k: max(r[k] for r in everyone) for k in mine}


def _import_frameworks() -> None:
    """Import every framework up front, so no construction time includes an import."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

    import fsdp_wrap  # noqa: F401
    import fsdp_wrap.wrap  # noqa: F401


def _warm_up_process(device: torch.device) -> None:
    """Pay one-time costs before the memory baseline, the same for every framework.

    Importing the frameworks' modules, the autograd engine's threads and the
    allocator's first arenas would otherwise count as the first framework's
    memory.
    """
    _import_frameworks()
    m = torch.nn.Linear(8, 8, device=device)
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    m(torch.randn(4, 8, device=device)).sum().backward()
    opt.step()
    del m, opt


# ---------------------------------------------------------------------------
# job 3: meta-device construction
# ---------------------------------------------------------------------------


def job_meta(rank: int, ws: int, device: torch.device, cfg: dict[str, Any]) -> Any:
    w = _workload(cfg, "meta1b")
    clock = Clock(device)
    dist.barrier()
    t0 = clock.now()
    try:
        model = build_meta(cfg["framework"], w, device)
    except NotImplementedError as err:
        return {"status": "not yet", "detail": str(err).splitlines()[0][:120]}
    dist.barrier()
    elapsed = clock.now() - t0
    n_local = sum(p.numel() for p in model.parameters())
    return {"status": "ok", "seconds": elapsed, "local_numel": n_local}


JOBS = {"interleaved": job_interleaved, "memory": job_memory, "meta": job_meta}


# ---------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------


def _rst_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    rule = "  ".join("=" * n for n in widths)
    fmt = lambda cells: "  ".join(c.ljust(n) for c, n in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([rule, fmt(header), rule, *(fmt(r) for r in rows), rule])


def _paired_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


LIMIT = {"FULL_SHARD": 3.0, "SHARD_GRAD_OP": 2.0, "NO_SHARD": 1.0, "-": 1.0}


def report_interleaved(res: dict[str, Any], targets: list[tuple[str, float, float, str]]) -> str:
    times, colls = res["times"], res["colls"]
    param_bytes = res["params"] * 4
    ddp_key = next((k for k in res["variants"] if k.startswith("ddp/")), None)
    rows = []
    for key in res["variants"]:
        fw, strategy, orig = key.split("/")
        t = times[key]
        ref = f"torch_fsdp1/{strategy}/{orig}"
        vs_fsdp1 = _paired_ratio(t, times[ref]) if ref in times and fw != "torch_fsdp1" else None
        vs_ddp = _paired_ratio(t, times[ddp_key]) if ddp_key and key != ddp_key else None
        nbytes = sum(colls[key]["bytes"].values())
        ncalls = sum(v for n, v in colls[key]["calls"].items() if n != "barrier")
        rows.append([
            strategy, orig, fw,
            f"{statistics.median(t) * 1e3:.1f}",
            "" if vs_fsdp1 is None else f"{vs_fsdp1:.2f}",
            "" if vs_ddp is None else f"{vs_ddp:.2f}",
            f"{nbytes / 2**20:.2f}",
            f"{nbytes / param_bytes:.2f} / {LIMIT[strategy]:.0f}",
            str(ncalls),
            f"{res['construct'][key] * 1e3:.1f}",
        ])
        if fw.startswith("fsdp_wrap") and vs_fsdp1 is not None:
            goal = {"small": 0.7, "compute": 0.95}.get(res["workload"])
            if goal is not None:
                targets.append((f"{res['workload']} {fw} {strategy}/orig={orig}: step vs torch FSDP1",
                                vs_fsdp1, goal, "x"))
            torch_bytes = sum(colls[ref]["bytes"].values())
            targets.append((f"{res['workload']} {fw} {strategy}/orig={orig}: bytes vs torch FSDP1",
                            nbytes / torch_bytes if torch_bytes else 1.0, 1.0, "x"))
            if strategy == "NO_SHARD" and vs_ddp is not None:
                targets.append((f"{res['workload']} {fw} NO_SHARD/orig={orig}: step vs DDP",
                                vs_ddp, 1.15, "x"))
    losses = res["first_loss"].values()
    header = ["strategy", "orig", "framework", "median ms", "/fsdp1", "/ddp",
              "MiB/step", "x params / limit", "colls", "build ms"]
    title = (f"{res['workload']}: {res['params'] / 1e6:.2f}M params, "
             f"{len(next(iter(times.values())))} interleaved steps per row; first-step losses "
             f"agree to {max(losses) - min(losses):.1e}")
    return title + "\n\n" + _rst_table(header, rows)


def report_memory(mem: dict[str, Any], params: int,
                  targets: list[tuple[str, float, float, str]], name: str = "large",
                  device: str = "cpu") -> str:
    rows = []
    mib = 2**20
    for key, r in mem.items():
        fw, strategy, orig = key.split("/")
        ref = mem.get(f"torch_fsdp1/{strategy}/{orig}")
        ratio = r["train_peak"] / ref["train_peak"] if ref and fw != "torch_fsdp1" else None
        fb_ratio = (r["fwd_bwd_peak"] / ref["fwd_bwd_peak"]
                    if ref and fw != "torch_fsdp1" else None)
        rows.append([
            strategy, orig, fw,
            f"{r['train_peak'] / mib:.0f}",
            "" if ratio is None else f"{ratio:.2f}",
            f"{r['fwd_bwd_peak'] / mib:.0f}",
            "" if fb_ratio is None else f"{fb_ratio:.2f}",
            f"{r['construct_peak'] / mib:.0f}",
            f"{r['resident'] / mib:.0f}",
            f"{r['step_s'] * 1e3:.0f}",
        ])
        if fw.startswith("fsdp_wrap") and ratio is not None:
            targets.append((f"{name} {fw} {strategy}/orig={orig}: peak memory vs torch FSDP1",
                            ratio, 0.95, "x"))
    header = ["strategy", "orig", "framework", "step peak MiB", "/fsdp1", "fwd+bwd MiB", "/fsdp1",
              "build peak MiB", "resident MiB", "step ms"]
    what = "max_memory_allocated" if device == "cuda" else "the RSS"
    title = (f"{name}: {params / 1e6:.1f}M params ({params * 4 / mib:.0f} MiB fp32); peak growth per "
             f"rank over {what} before the model was built, each row in fresh processes")
    return title + "\n\n" + _rst_table(header, rows)


def report_meta(meta: dict[str, Any], params: int) -> str:
    rows = []
    for fw, r in meta.items():
        if r["status"] == "ok":
            rows.append([fw, f"{r['seconds']:.2f}", f"{r['local_numel'] / 1e6:.0f}M"])
        else:
            rows.append([fw, r["status"], ""])
    title = f"meta1b: {params / 1e9:.2f}B params built on the meta device, FULL_SHARD"
    return title + "\n\n" + _rst_table(["framework", "construct s", "local params"], rows)


def report_targets(targets: list[tuple[str, float, float, str]]) -> str:
    rows = []
    for what, got, goal, unit in targets:
        ok = got <= goal
        miss = "" if ok else f"short by {got / goal - 1:.0%}"
        rows.append([what, f"{got:.2f}{unit}", f"<= {goal:.2f}{unit}", "met" if ok else "MISSED",
                     miss])
    return "targets\n\n" + _rst_table(["target", "measured", "goal", "status", ""], rows)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks (default: 2 on CPU, every visible GPU on CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="CUDA only: nccl (default; one GPU per rank) or gloo (ranks may share a GPU)")
    p.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default="none",
                   help="FSDPs: MixedPrecision(param, reduce, buffer dtype); DDP/plain: autocast")
    p.add_argument("--mem-workload", default="large", help="workload of the peak-memory runs")
    p.add_argument("--workloads", default="compute,small",
                   help="interleaved step-time workloads (compute, small, large)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument(
        "--no-limit-all-gathers",
        action="store_true",
        help="build both FSDP1s with limit_all_gathers=False (fsdp_wrap then overlaps "
        "CPU all-gathers with compute, at one unit of extra memory)",
    )
    p.add_argument(
        "--bucket-cap-mb",
        default="",
        help="fsdp_wrap's bucket_cap_mb, comma-separated: one fsdp_wrap row per value, keyed "
        "fsdp_wrap@CAP (e.g. 0,25: per-unit reduction next to 25 MiB buckets); default: one "
        "row with the library's default",
    )
    p.add_argument(
        "--all-gather-batch-mb",
        default="",
        help="fsdp_wrap's all_gather_batch_mb, comma-separated: one fsdp_wrap row per value "
        "(crossed with --bucket-cap-mb), keyed fsdp_wrap+agMB; default: the library's",
    )
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--orig", default="false,true", help="use_orig_params values")
    p.add_argument("--steps", type=int, default=None, help="timed rounds per workload")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mem-steps", type=int, default=None)
    p.add_argument("--mem-frameworks", default="",
                   help="frameworks for the memory runs (default: --frameworks)")
    p.add_argument("--no-memory", action="store_true", help="skip the ~100M peak-memory runs")
    p.add_argument("--no-meta", action="store_true", help="skip the 1B meta-device row")
    p.add_argument("--quick", action="store_true",
                   help="fewer steps; memory: first strategy, use_orig_params=False only; no 1B row")
    p.add_argument("--tiny", action="store_true", help="toy model sizes (smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler tables for torch_fsdp1 and fsdp_wrap")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--json", default=None, help="write raw results here")
    return p.parse_args(argv)


DEFAULT_STEPS = {"compute": 10, "small": 20, "large": 2, "gpu": 10}
QUICK_STEPS = {"compute": 3, "small": 6, "large": 1, "gpu": 3}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.no_limit_all_gathers:
        os.environ["FSDP_BENCH_LIMIT_ALL_GATHERS"] = "0"  # inherited by the rank processes
    if args.mixed_precision != "none":
        os.environ["FSDP_BENCH_MIXED_PRECISION"] = args.mixed_precision
    mp.set_forkserver_preload(["torch", "torch.distributed", "_bench_models", "_bench_measure"])
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available on this machine; nothing to run.")
        return 0
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    backend = args.backend or "nccl"
    if args.device == "cuda" and backend == "nccl" and nproc > torch.cuda.device_count():
        print(f"--nproc {nproc} > {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per rank; "
              "pass --backend gloo to share GPUs between ranks.")
        return 2
    frameworks = tuple(f for f in args.frameworks.split(",") if f)
    strategies = tuple(s for s in args.strategies.split(",") if s)
    origs = tuple(o.strip().lower() in ("1", "true", "t") for o in args.orig.split(","))
    cfg: dict[str, Any] = {
        "device": args.device, "nproc": nproc, "threads": args.threads, "tiny": args.tiny,
        "backend": backend, "mem_workload": args.mem_workload,
        "warmup": max(1, args.warmup), "mem_steps": args.mem_steps,
        "profile": args.profile, "profile_steps": args.profile_steps,
    }
    print(f"# torch {torch.__version__}, {args.device}"
          f"{f' ({backend}, {torch.cuda.get_device_name()})' if args.device == 'cuda' else ''}, "
          f"mixed precision {args.mixed_precision}, {nproc} ranks, "
          f"{args.threads} thread(s) per rank, {os.cpu_count()} CPUs; "
          f"python {' '.join(sys.argv)}", flush=True)
    targets: list[tuple[str, float, float, str]] = []
    raw: dict[str, Any] = {"interleaved": {}, "memory": {}, "meta": {}}
    steps_for = QUICK_STEPS if args.quick else DEFAULT_STEPS
    t_start = time.perf_counter()

    caps = tuple(float(c) for c in args.bucket_cap_mb.split(",") if c.strip()) or (None,)
    ag = tuple(float(c) for c in args.all_gather_batch_mb.split(",") if c.strip()) or (None,)
    variants = variants_for(nproc, frameworks, strategies, origs, caps, ag)
    for name in (w for w in args.workloads.split(",") if w):
        job = dict(cfg, workload=name, steps=args.steps or steps_for[name],
                   variants=[v.__dict__ for v in variants])
        res = launch("interleaved", job)
        raw["interleaved"][name] = res
        print("\n" + report_interleaved(res, targets), flush=True)
        for key, table in (res.get("profile") or {}).items():
            print(f"\nprofile {name} {key} ({args.profile_steps} steps, rank 0)\n{table}")

    if not args.no_memory:
        mem_origs = (False,) if args.quick else origs
        mem_strategies = strategies[:1] if args.quick else strategies
        mem_frameworks = tuple(f for f in args.mem_frameworks.split(",") if f) or frameworks
        mem_variants = variants_for(nproc, mem_frameworks, mem_strategies, mem_origs, caps, ag)
        for v in mem_variants:
            job = dict(cfg, variant=v.__dict__, mem_steps=args.mem_steps or steps_for["large"])
            raw["memory"][v.key] = launch("memory", job)
        w = _workload(cfg, args.mem_workload)
        print("\n" + report_memory(raw["memory"], w.params(), targets, w.name, args.device), flush=True)

    if not (args.no_meta or args.quick):
        for fw in ("torch_fsdp1", "fsdp_wrap"):
            if fw in frameworks:
                raw["meta"][fw] = launch("meta", dict(cfg, framework=fw))
        w = _workload(cfg, "meta1b")
        print("\n" + report_meta(raw["meta"], w.params()), flush=True)
        theirs, ours = raw["meta"].get("torch_fsdp1"), raw["meta"].get("fsdp_wrap")
        if ours and ours["status"] != "ok":
            print(f"\nmeta-device construction, fsdp_wrap vs torch FSDP1: {ours['status']}")
        elif ours and theirs and theirs["status"] == "ok":
            targets.append(("meta1b construction vs torch FSDP1",
                            ours["seconds"] / theirs["seconds"], 1.0, "x"))

    if targets:  # (none without torch_fsdp1 and ddp rows to compare with)
        print("\n" + report_targets(targets))
    print(f"\n# total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
