"""Ranks agree on their construction settings before any collective depends on them.

A rank reads part of its FSDP configuration from its own arguments and
environment (``$FSDP_WRAP_QUANTIZE_COLLECTIVES``, ``$FSDP_WRAP_BUCKET_CAP_MB``,
``$LOCAL_WORLD_SIZE``, ...).  Where those differ between ranks the ranks issue
different collectives: one node creates sub-groups the other never joins, one
rank buckets gradients the other reduces unit by unit, and every rank waits
until the process group's timeout, or gets values of the wrong size.  The
root's constructor therefore compares them (:func:`check_ranks_agree`) before
its first collective (the hybrid groups built from ``LOCAL_WORLD_SIZE``, the
sub-groups of ``quantize_collectives``, ``sync_module_states``' broadcasts):
one all-gather of an int64 digest over each of the unit's groups, and only
where the digests differ one ``all_gather_object`` of the settings, so that
every rank raises the same ``RuntimeError`` naming each setting that differs,
its values and the ranks holding each.

Units made by auto-wrapping get the root's arguments in the same process and
compare nothing (:func:`auto_wrapping` marks their construction).  The units'
shapes, dtypes and strategy are compared again at lazy initialisation
(:func:`fsdp_wrap.runtime.tree.all_gather_unit_signatures`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.runtime.capability as capability
from fsdp_wrap.api import BackwardPrefetch, MixedPrecision, ShardingStrategy
from fsdp_wrap.comm.quant.config import QuantSpec

__all__ = ["auto_wrapping", "check_ranks_agree", "construction_settings", "in_auto_wrap"]

_AUTO_WRAPPING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_wrap_auto_wrapping", default=False)

# The environment variables a rank reads that change its collectives, beyond
# those behind a keyword (named with their keyword below).
_ENV = ("LOCAL_WORLD_SIZE", "FSDP_USE_FULL_PREC_IN_EVAL")


@contextlib.contextmanager
def auto_wrapping() -> Iterator[None]:
    """Inside: the units being built are a root's auto-wrapped children."""
    token = _AUTO_WRAPPING.set(True)
    try:
        yield
    finally:
        _AUTO_WRAPPING.reset(token)


def in_auto_wrap() -> bool:
    """Whether the unit being built is an auto-wrapped child of a root being built."""
    return _AUTO_WRAPPING.get()


def construction_settings(
    strategy: ShardingStrategy, quant: QuantSpec | None, bucket_cap_mb: float,
    all_gather_batch_mb: float, backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool, limit_all_gathers: bool, mixed_precision: MixedPrecision | None,
    use_orig_params: bool, sync_module_states: bool, auto_wrap: bool,
) -> dict[str, str]:
    """Every setting of a construction that changes which collectives a rank
    issues (their order, sizes, dtypes, groups), by how the user sets it."""
    mp = mixed_precision or MixedPrecision()
    settings = {
        "sharding_strategy": strategy.name,
        "quantize_collectives (or $FSDP_WRAP_QUANTIZE_COLLECTIVES)": str(quant or "off"),
        "bucket_cap_mb (or $FSDP_WRAP_BUCKET_CAP_MB)": repr(bucket_cap_mb),
        "all_gather_batch_mb (or $FSDP_WRAP_ALL_GATHER_BATCH_MB)": repr(all_gather_batch_mb),
        "backward_prefetch": backward_prefetch.name if backward_prefetch else "None",
        "forward_prefetch": repr(forward_prefetch),
        "limit_all_gathers": repr(limit_all_gathers),
        "mixed_precision.param_dtype": str(mp.param_dtype),
        "mixed_precision.reduce_dtype": str(mp.reduce_dtype),
        "use_orig_params": repr(use_orig_params),
        "sync_module_states": repr(sync_module_states),
        "auto_wrap_policy": "given" if auto_wrap else "None",
    }
    for name in _ENV:
        settings[f"${name}"] = repr(os.environ.get(name, "<unset>"))
    return settings


def _groups(process_group: Any, device_mesh: Any) -> list[dist.ProcessGroup]:
    """The groups the unit's collectives (and the groups built for it) run over."""
    if device_mesh is not None:
        return [device_mesh.get_group(d) for d in range(device_mesh.ndim)]
    if isinstance(process_group, (tuple, list)):
        return [g for g in process_group if isinstance(g, dist.ProcessGroup)]
    if isinstance(process_group, dist.ProcessGroup):
        return [process_group]
    if process_group is None:
        return [dist.distributed_c10d._get_default_group()]
    return []  # (not a group: refused later, by the groups' own checks)


def _digest(settings: dict[str, str]) -> int:
    text = "\n".join(f"{k}={v}" for k, v in sorted(settings.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_ranks_agree(settings: dict[str, str], process_group: Any, device_mesh: Any,
                      device: torch.device) -> None:
    """``RuntimeError`` on every rank of the unit's groups unless all hold the
    same ``settings`` (see the module docstring).  ``device``: the unit's
    compute device, which the groups are first checked to carry (the
    comparison moves a tensor of it).  Nothing without an initialised default
    group (the constructor refuses that later)."""
    if not dist.is_initialized():
        return
    groups = _groups(process_group, device_mesh)
    arg = "device_mesh" if device_mesh is not None else "process_group"
    capability.check_group_device(groups, device, arg)
    capability.check_mesh_device(device_mesh, device)
    mine = _digest(settings)
    for group in groups:
        world = dist.get_world_size(group)
        if world <= 1:
            continue
        if device.type == "meta":
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        # (filled with this rank's digest first: a backend whose collectives
        # move nothing, as torch's fake process group, then agrees)
        out = torch.full((world,), mine, dtype=torch.int64, device=device)
        C.all_gather_into(out, torch.tensor([mine], dtype=torch.int64, device=device), group)
        if len(set(out.tolist())) > 1:
            _refuse(settings, group)


def _refuse(settings: dict[str, str], group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` gathers every rank's settings and raises."""
    everyone: list[Any] = C.all_gather_objects(settings, group)
    ranks = dist.get_process_group_ranks(group)
    differ = []
    for name in settings:
        holders: dict[str, list[int]] = {}
        for rank, theirs in zip(ranks, everyone):
            holders.setdefault(str(theirs.get(name, "<missing>")), []).append(rank)
        if len(holders) > 1:
            differ.append(f"{name} is " + " and ".join(
                f"{value} on rank(s) {held}" for value, held in holders.items()))
    me = C.global_rank()
    raise RuntimeError(
        f"[rank {me}] FSDP was constructed with settings that differ between ranks {ranks}, "
        f"which would make their collectives differ (a hang, or wrong values): "
        f"{'; '.join(differ) or 'the settings digests differ'}. Launch every rank with the "
        "same FSDP arguments and environment (FSDP_WRAP_* and LOCAL_WORLD_SIZE variables "
        "included)."
    )
