"""Peak live tensor bytes of one forward+backward, in units of one block.

Samples glibc's live-byte count (``_live_bytes.live_bytes``) after every
dispatched op of the second step of the ``large`` workload cut to 3 blocks,
on 2 gloo ranks, and prints rank 0's peak over the step's starting point::

    python benchmarks/live_peak.py fsdp_wrap FULL_SHARD false
    python benchmarks/live_peak.py torch_fsdp1 SHARD_GRAD_OP true
    python benchmarks/live_peak.py fsdp_wrap FULL_SHARD true small   # another workload, whole

A fourth argument names another workload of ``_bench_models.WORKLOADS``,
measured whole (its unit is then one of its blocks).  ``--train`` measures a
whole training window instead: from before the model is built, through
wrapping, ``AdamW`` and three steps (``zero_grad``, forward, backward,
``step``), and prints each step's peak over the starting point, in MiB, with
the phase and op where it was reached and the FSDP frames on the stack
there::

    python benchmarks/live_peak.py fsdp_wrap FULL_SHARD false small --train

Unlike RSS this ignores memory the allocator keeps after a free, so it shows
what each library's schedule holds at once.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_models import (  # noqa: E402
    WORKLOADS,
    Block,
    Variant,
    build,
    loss_fn,
    make_batches,
    make_model,
)
from _live_bytes import live_bytes  # noqa: E402

from fsdp_wrap.comm.teardown import exit_now  # noqa: E402


class _Sampler(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, live_bytes())
        return out


class _WhereSampler(TorchDispatchMode):
    """The peak, and where it was reached: phase, op, fsdp_wrap's frames."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.peak, self.where = "", 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        now = live_bytes()
        if now > self.peak:
            self.peak = now
            frames = [f"{os.path.basename(f.filename)}:{f.name}"
                      for f in traceback.extract_stack(limit=24)
                      if "fsdp_wrap" in f.filename or "/fsdp/" in f.filename]
            self.where = f"{self.phase} {func} [{' < '.join(reversed(frames[-4:]))}]"
        return out


def _train_window(rank: int, framework: str, strategy: str, orig: bool,
                  workload_name: str) -> None:
    workload = WORKLOADS[workload_name]
    batches = make_batches(workload, rank, 2, torch.device("cpu"))
    dist.barrier()
    base = live_bytes()
    sampler = _WhereSampler()
    lines = []
    with sampler:
        sampler.phase = "build"
        model = build(Variant(framework, strategy, orig), make_model(workload),
                      torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    lines.append(f"build {(sampler.peak - base) / 2**20:.2f}")
    for step in range(3):
        dist.barrier()
        sampler.peak = 0
        with sampler:
            sampler.phase = f"step {step} forward"
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batches[step % 2]))
            sampler.phase = f"step {step} backward"
            loss.backward()
            sampler.phase = f"step {step} optimizer"
            opt.step()
        lines.append(f"step {step} {(sampler.peak - base) / 2**20:.2f} at {sampler.where}")
    if rank == 0:
        print(f"{framework} {strategy} orig={orig} {workload_name}, live MiB over the "
              "start, rank 0:\n  " + "\n  ".join(lines))


def _worker(rank: int, port: int, framework: str, strategy: str, orig: bool,
            workload_name: str, train: bool = False) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if train:
        _train_window(rank, framework, strategy, orig, workload_name)
        dist.barrier()
        dist.destroy_process_group()
        exit_now()
    workload = WORKLOADS[workload_name]
    if workload_name == "large":
        workload = dataclasses.replace(workload, layers=3)
    plain = make_model(workload)
    block = next(m for m in plain.modules() if isinstance(m, Block))
    unit = 4 * sum(p.numel() for p in block.parameters())  # fp32 bytes of one block unit
    model = build(Variant(framework, strategy, orig), plain, torch.device("cpu"))
    batches = make_batches(workload, rank, 2, torch.device("cpu"))
    loss_fn(model(batches[0])).backward()
    model.zero_grad(set_to_none=True)
    base = live_bytes()
    sampler = _Sampler()
    with sampler:
        loss_fn(model(batches[1])).backward()
    if rank == 0:
        print(f"{framework} {strategy} orig={orig} {workload_name}: peak "
              f"{(sampler.peak - base) / unit:.2f} units ({(sampler.peak - base) / 2**20:.2f} MiB)")
    dist.barrier()
    dist.destroy_process_group()
    exit_now()  # see fsdp_wrap/comm/teardown.py: gloo's threads vs interpreter shutdown


def main() -> None:
    train = "--train" in sys.argv
    argv = [a for a in sys.argv if a != "--train"]
    framework, strategy, orig = argv[1], argv[2], argv[3].lower() == "true"
    workload_name = argv[4] if len(argv) > 4 else "large"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, framework, strategy, orig, workload_name, train), nprocs=2)


if __name__ == "__main__":
    main()
