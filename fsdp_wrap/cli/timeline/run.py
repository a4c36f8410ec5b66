"""Profile a few steps of the demo's GPT (no script of the user's): ranks spawned
here, or this process as one rank under torchrun (``fsdp-wrap cluster``).

Every rank trains ``warmup + steps + 1`` steps with ``$FSDP_WRAP_TRACE`` set
(:mod:`fsdp_wrap.runtime.step_trace` profiles steps ``warmup+1 ..
warmup+steps``; the forward of the last one closes the profile), then the
first rank draws the picture.  ``prefetch_ahead=k`` sets FSDP2's explicit
prefetch lists: each block prefetches the ``k`` blocks after it in forward
and the ``k`` before it in backward (the root, the first / last block).
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_wrap.runtime.step_trace import ENV_DIR, ENV_STEPS

__all__ = ["DemoTrace", "prefetch_ahead", "run_demo"]


@dataclass(frozen=True)
class DemoTrace:
    out: str
    nprocs: int = 2
    warmup: int = 2
    steps: int = 3
    layers: int = 4
    width: int = 128
    seq_len: int = 32
    batch: int = 16
    strategy: str = "FULL_SHARD"
    prefetch_ahead: int = 0  # 0: the default schedule
    limit_all_gathers: bool = True
    all_gather_batch_mb: float | None = None
    bucket_cap_mb: float | None = None
    threads: int = 0  # per rank (0: the cores shared out)


def prefetch_ahead(model: torch.nn.Module, k: int) -> list[Any]:
    """FSDP2's explicit prefetch, ``k`` units ahead, on the units in forward
    order (the root first): forward, each unit lists the ``k`` after it;
    backward (the reverse order), the ``k`` before it.  Returns the units."""
    import fsdp_wrap as fsdp

    units = fsdp.FullyShardedDataParallel.fsdp_modules(model)
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + k])
        behind = units[max(1, i - k) : i][::-1] if i > 0 else units[-k:][::-1]
        unit.set_modules_to_backward_prefetch(behind)
    return units


def _train(cfg: DemoTrace) -> None:
    """This rank: build, set the schedule, train; the profile writes itself."""
    import fsdp_wrap as fsdp
    from fsdp_wrap.demo.model import Block, TinyGPT, make_batch
    from fsdp_wrap.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    rank, ws = dist.get_rank(), dist.get_world_size()
    vocab, heads = 64, 4 if cfg.width % 4 == 0 else 1
    torch.manual_seed(0)
    model = fsdp.FullyShardedDataParallel(
        TinyGPT(vocab, cfg.seq_len, cfg.layers, cfg.width, heads),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp.ShardingStrategy[cfg.strategy],
        limit_all_gathers=cfg.limit_all_gathers, all_gather_batch_mb=cfg.all_gather_batch_mb,
        bucket_cap_mb=cfg.bucket_cap_mb)
    if cfg.prefetch_ahead:
        prefetch_ahead(model, cfg.prefetch_ahead)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, cfg.warmup + cfg.steps + 2):
        x, y = make_batch(step, rank, ws, cfg.batch, cfg.seq_len, vocab, 0)
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def _setup_env(cfg: DemoTrace) -> None:
    os.environ[ENV_DIR] = cfg.out
    os.environ[ENV_STEPS] = f"{cfg.warmup},{cfg.steps}"
    cores = os.cpu_count() or 1
    torch.set_num_threads(cfg.threads or max(1, cores // max(cfg.nprocs, 1)))


def _spawned(rank: int, cfg: DemoTrace, port: int) -> None:
    from fsdp_wrap.comm.teardown import exit_now

    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    _setup_env(cfg)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg.nprocs)
    try:
        _train(cfg)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now(0)


def run_demo(cfg: DemoTrace) -> bool:
    """Profile the demo on ``cfg.nprocs`` spawned ranks, or, under torchrun, as
    this rank.  Returns whether this process should draw (the spawner, or
    global rank 0 once every rank wrote its profile)."""
    os.makedirs(cfg.out, exist_ok=True)
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        _setup_env(cfg)
        dist.init_process_group("gloo")
        try:
            _train(cfg)
            dist.barrier()  # (every profile written)
            return dist.get_rank() == 0
        finally:
            dist.destroy_process_group()
    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_spawned, args=(cfg, port), nprocs=cfg.nprocs, join=True)
    return True
