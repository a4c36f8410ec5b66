#!/usr/bin/env python
"""Where one training step's time goes, for one framework and configuration.

    python benchmarks/profile_step.py --framework fsdp_wrap --strategy FULL_SHARD
    python benchmarks/profile_step.py --framework torch_fsdp1 --orig true --workload compute

Two ranks on gloo CPU.  After warm-up, rank 0 runs ``--steps`` steps under
``cProfile`` and prints the number of Python function calls per step (a
deterministic measure of framework overhead that machine load does not
disturb) and the functions with the most own time; then the same steps under
``torch.profiler`` for the ops' view.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_models import WORKLOADS, Variant, build, loss_fn, make_batches, make_model  # noqa: E402

from fsdp_wrap.comm.teardown import exit_now  # noqa: E402


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = torch.device("cpu")
    w = WORKLOADS[args.workload]
    orig = None if args.framework in ("fsdp2", "ddp") else args.orig == "true"
    v = Variant(args.framework, args.strategy, orig)
    model = build(v, make_model(w), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    batches = make_batches(w, rank, 4, device)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batches[i % 4])).backward()
        opt.step()

    for i in range(3):
        step(i)
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.steps):
        step(i)
    prof.disable()
    dist.barrier()
    if rank == 0:
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        print(f"{v.key} on {w.name}: {stats.total_calls / args.steps:.0f} Python calls per step "
              f"({stats.prim_calls / args.steps:.0f} primitive)")
        stats.sort_stats(args.sort).print_stats(args.top)
        print("\n".join(s.getvalue().splitlines()[6:]))
    if args.torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for i in range(args.steps):
                step(i)
        if rank == 0:
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    dist.barrier()
    dist.destroy_process_group()
    exit_now()  # see fsdp_wrap/comm/teardown.py: gloo's threads vs interpreter shutdown


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", default="fsdp_wrap",
                   choices=("torch_fsdp1", "fsdp_wrap", "fsdp2", "ddp"))
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--orig", default="false", choices=("false", "true"))
    p.add_argument("--workload", default="small", choices=("small", "compute"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"),
                   help="order of the cProfile table (own time, or time including callees)")
    p.add_argument("--torch-profiler", action="store_true")
    args = p.parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=2)


if __name__ == "__main__":
    main()
