"""Building the FSDP-wrapped model and training it: one step, a run of steps, a memory report."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_wrap.demo.model import Block, TinyGPT, make_batch
from fsdp_wrap.demo.settings import Printer, Settings, fmt_bytes, peak_rss_bytes, progress_line


def build(s: Settings, init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A fresh FSDP-wrapped model, its optimizer (it sees the shards) and loss scaler."""
    import fsdp_wrap as fsdp
    from fsdp_wrap.wrap import ModuleWrapPolicy

    torch.manual_seed(init_seed)
    dtype = LOW_PRECISION.get(s.mixed_precision)
    model = fsdp.FullyShardedDataParallel(
        TinyGPT(s.vocab, s.seq_len, s.layers, s.width, s.heads),  # built on the CPU
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp.ShardingStrategy[s.strategy],
        use_orig_params=s.use_orig_params,
        device_id=compute_device(s),  # each unit moves to it as it is wrapped
        mixed_precision=fsdp.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
        if dtype is not None else None,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    return model, optim, make_scaler(s)


LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_device(s: Settings) -> torch.device:
    if s.device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return torch.device("cuda", local % torch.cuda.device_count())


def make_scaler(s: Settings) -> Any:
    """fp16 needs loss scaling; bf16 and fp32 do not (a disabled scaler is a no-op)."""
    from fsdp_wrap.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=s.device, enabled=s.mixed_precision == "fp16")


def lr_at(step: int, s: Settings) -> float:
    """Linear warm-up over 3 steps, then constant: a pure function of the step."""
    return s.lr * min(1.0, step / 3)


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, step: int, s: Settings,
    rank: int, ws: int,
) -> float:
    """One optimizer step; returns the loss averaged over all ranks."""
    x, y = make_batch(step, rank, ws, s.batch, s.seq_len, s.vocab, s.seed)
    device = compute_device(s)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    for group in optim.param_groups:
        group["lr"] = lr_at(step, s)
    logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, s.vocab), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.unscale_(optim)
    model.clip_grad_norm_(1.0)  # type: ignore[operator]
    scaler.step(optim)
    scaler.update()
    optim.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / ws


def run_steps(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, first: int, last: int,
    s: Settings,
    out: Printer, tag: str, on_step: Any = None, rates: dict[int, float] | None = None,
) -> dict[int, float]:
    """Train steps ``first..last``; return each step's loss (``rates``: filled with
    each step's tokens/s over all ranks)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens = s.batch * s.seq_len * ws
    losses: dict[int, float] = {}
    for step in range(first, last + 1):
        t0 = time.perf_counter()
        losses[step] = train_step(model, optim, scaler, step, s, rank, ws)
        dt = time.perf_counter() - t0
        if rates is not None:
            rates[step] = tokens / dt
        if not math.isfinite(losses[step]):
            raise FloatingPointError(f"[rank {rank}] loss is {losses[step]} at step {step}")
        out(progress_line(step, s.steps, losses[step], tokens / dt, tag))
        if on_step is not None:
            on_step(step)
    return losses


def memory_report(model: nn.Module, out: Printer) -> None:
    """Each rank's sharded vs. full parameter bytes, from the FSDP units' handles."""
    import fsdp_wrap as fsdp

    units = fsdp.FullyShardedDataParallel.fsdp_modules(model)
    sharded = full = 0
    for handle in (h for unit in units for h in unit._handles):  # every flat parameter
        itemsize = handle.flat_param.element_size()
        sharded += handle.flat_param.numel() * itemsize  # between steps: the local shard
        full += sum(info.numel for info in handle.infos) * itemsize
    mine = {"rank": dist.get_rank(), "sharded": sharded, "full": full, "rss": peak_rss_bytes(),
            "gpu": torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out(f"memory ({len(units)} FSDP units; parameters held between steps vs. unsharded):")
    for r in everyone:
        out(
            f"  rank {r['rank']}: params {fmt_bytes(r['sharded']):>10} sharded / "
            f"{fmt_bytes(r['full']):>10} full ({r['sharded'] / max(r['full'], 1):6.1%})   "
            f"peak RSS {fmt_bytes(r['rss'])}"
            + ("" if r["gpu"] is None else f"   peak GPU {fmt_bytes(r['gpu'])}")
        )
