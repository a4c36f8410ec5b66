"""The demo's checkpoint: save at step ``k``, load into a fresh model and optimizer.

``--optim-state full`` writes the full model and optimizer state dicts from
rank 0; ``per-rank`` writes each rank's local ``optim.state_dict()`` in a
file of its own, only resumable with the same world size, sharding strategy,
``use_orig_params`` and model (checked on load).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_wrap.demo.settings import Settings


def save_checkpoint(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, step: int, s: Settings,
    ckpt_dir: str,
) -> None:
    """Full model state dict and optimizer state (rank 0 writes, or one file per rank)."""
    import fsdp_wrap as fsdp

    FSDP = fsdp.FullyShardedDataParallel
    rank, ws = dist.get_rank(), dist.get_world_size()
    cfg = fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_cfg = fsdp.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, cfg, optim_cfg):
        model_sd = model.state_dict()  # collectives: every rank calls both
        full_osd = FSDP.optim_state_dict(model, optim) if s.optim_state == "full" else None
    if rank == 0:
        torch.save(model_sd, os.path.join(ckpt_dir, "model.pt"))
        if full_osd is not None:
            torch.save(full_osd, os.path.join(ckpt_dir, "optim.pt"))
        if scaler.is_enabled():  # fp16: the loss scale, the same on every rank
            torch.save(scaler.state_dict(), os.path.join(ckpt_dir, "scaler.pt"))
        meta = {"step": step, "world_size": ws, "settings": asdict(s)}
        with open(os.path.join(ckpt_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    if s.optim_state == "per-rank":
        # This rank's optimizer state over its own shards, as the optimizer sees it.
        torch.save(optim.state_dict(), os.path.join(ckpt_dir, f"optim_rank{rank}.pt"))
    dist.barrier()


def load_checkpoint(
    model: nn.Module, optim: torch.optim.Optimizer, scaler: Any, s: Settings, ckpt_dir: str
) -> int:
    import fsdp_wrap as fsdp

    FSDP = fsdp.FullyShardedDataParallel
    rank, ws = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        meta = json.load(f)
    saved = meta["settings"]
    for key in ("layers", "width", "optim_state", "mixed_precision"):
        if saved[key] != getattr(s, key):
            raise RuntimeError(f"[rank {rank}] checkpoint has {key}={saved[key]!r}, "
                               f"this run has {getattr(s, key)!r}")
    per_rank = s.optim_state == "per-rank"
    for key in ("strategy", "use_orig_params") if per_rank else ():
        if saved[key] != getattr(s, key):
            raise RuntimeError(
                f"[rank {rank}] per-rank optimizer state was saved with {key}={saved[key]!r}, "
                f"this run has {getattr(s, key)!r}"
            )
    if per_rank and meta["world_size"] != ws:
        raise RuntimeError(
            f"[rank {rank}] the checkpoint's optimizer state was saved per rank by "
            f"{meta['world_size']} ranks; it can only be resumed with that many (got {ws})"
        )
    # Every rank reads the full model state dict and keeps its own shard of it.
    model_sd = torch.load(os.path.join(ckpt_dir, "model.pt"), weights_only=True)
    with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT):
        model.load_state_dict(model_sd)
        if per_rank:
            osd = torch.load(os.path.join(ckpt_dir, f"optim_rank{rank}.pt"), weights_only=True)
        else:
            # Every rank reads the full optimizer state; each keeps its shard of it.
            full_osd = torch.load(os.path.join(ckpt_dir, "optim.pt"), weights_only=True)
            osd = FSDP.optim_state_dict_to_load(model, optim, full_osd)
    optim.load_state_dict(osd)
    if scaler.is_enabled():
        scaler.load_state_dict(torch.load(os.path.join(ckpt_dir, "scaler.pt"), weights_only=True))
    return int(meta["step"])
