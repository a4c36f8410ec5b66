"""Sharded state-dict values cut along dim 0, as torch's FSDP1 cuts them.

A tensor of ``d0`` rows is split as ``torch.chunk`` splits it over the unit's
process group; each rank keeps its piece as a ``ShardedTensor`` (or a
``DTensor`` when the unit has a device mesh).  Used by the model and optimizer
state dicts and by the full-checkpoint writer; nothing here knows modules
beyond a unit's group, rank and device.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)

import fsdp_wrap.comm.collectives as _collectives
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState


@dataclass(frozen=True)
class ChunkLayout:
    """How sharded state-dict values are cut: dim 0, ``torch.chunk``, over ``group``.

    Rank ``r`` holds rows ``[r * c, (r + 1) * c)`` with ``c = ceil(d0 / world_size)``;
    trailing ranks may hold no row (an empty shard).  ``mesh`` set means DTensor values.
    """

    group: ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    mesh: Any = None


def chunk_layout(state: UnitState, use_dtensor: bool) -> ChunkLayout:
    """The layout of ``state``'s sharded values (DTensor with a mesh or ``_use_dtensor``)."""
    mesh = state.settings.device_mesh
    if mesh is None and use_dtensor:
        mesh = state._sd_device_mesh
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(state.process_group, state.compute_device.type)
            state._sd_device_mesh = mesh
    return ChunkLayout(state.process_group, state.rank, state.world_size, state.compute_device, mesh)


def chunk_rows(d0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(first row, row count)`` of ``rank``'s ``torch.chunk`` piece of ``d0`` rows."""
    size = math.ceil(d0 / world_size) if d0 else 0
    start = min(d0, size * rank)
    return start, max(0, min(size, d0 - start))


def placement(global_rank: int, device: torch.device) -> str:
    if device.type == "cuda":
        return f"rank:{global_rank}/cuda:{global_rank % max(1, torch.cuda.device_count())}"
    return f"rank:{global_rank}/{device.type}"


def chunk_tensor(full: torch.Tensor, layout: ChunkLayout, offload_to_cpu: bool) -> Any:
    """This rank's dim-0 chunk of ``full`` (a copy) as a ShardedTensor or DTensor.

    No communication: every rank knows every chunk's extent.
    """
    full = full.detach()
    start, rows = chunk_rows(full.shape[0], layout.world_size, layout.rank)
    local = full.narrow(0, start, rows).clone()
    return wrap_chunk(local, full.shape, full.dtype, layout, offload_to_cpu)


def wrap_chunk(
    local: torch.Tensor,
    shape: torch.Size,
    dtype: torch.dtype,
    layout: ChunkLayout,
    offload_to_cpu: bool,
) -> Any:
    """This rank's dim-0 chunk ``local`` of a tensor of ``shape`` as a ShardedTensor or DTensor."""
    full_shape = torch.Size(shape)
    d0 = full_shape[0]
    start, rows = chunk_rows(d0, layout.world_size, layout.rank)
    if offload_to_cpu:
        local = local.cpu()
    if layout.mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor import Shard as DShard

        # 1-D mesh: Shard(0).  Hybrid 2-D mesh (replicate, shard): every replica
        # holds the same chunks, so (Replicate(), Shard(0)), as torch gives them.
        placements = [Replicate()] * (layout.mesh.ndim - 1) + [DShard(0)]
        return DTensor.from_local(
            local, layout.mesh, placements, run_check=False, shape=full_shape,
            stride=_contiguous_stride(full_shape),
        )
    device = local.device
    # Every rank holds a shard, an empty one past torch.chunk's last piece (a
    # parameter with fewer rows than ranks), and the metadata lists it.  torch's
    # FSDP1 lists no shard there, and DCP's load planner then drops the value
    # from that rank's template; in a state dict that also holds lists (an
    # optimizer's param_groups) it then misreads the checkpoint as a pre-2.4 one
    # and fails ("Missing key in checkpoint state_dict: ...param_groups").  An
    # empty shard reads nothing and loads; torch's FSDP1 reads such checkpoints.
    shards_md: list[ShardMetadata] = []
    for r in range(layout.world_size):
        r_start, r_rows = chunk_rows(d0, layout.world_size, r)
        offsets = [r_start] + [0] * (len(full_shape) - 1)
        sizes = [r_rows, *full_shape[1:]]
        global_rank = dist.get_global_rank(layout.group, r)
        shards_md.append(ShardMetadata(offsets, sizes, placement(global_rank, device)))
    offsets = [start] + [0] * (len(full_shape) - 1)
    local_shards = [Shard.from_tensor_and_offsets(
        local, offsets, dist.get_global_rank(layout.group, layout.rank))]
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_md,
        size=full_shape,
        tensor_properties=TensorProperties(
            dtype=dtype,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        ),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=layout.group
    )


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor's module (about
    a second of ``import fsdp_wrap``): no value is one before that module is
    loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(value, cls)


def is_chunked(value: Any) -> bool:
    return isinstance(value, ShardedTensor) or is_dtensor(value)


def local_chunk(key: str, value: Any, layout: ChunkLayout) -> tuple[torch.Size, torch.Tensor]:
    """Global shape and this rank's chunk of a ShardedTensor/DTensor (checked)."""
    shape = torch.Size(value.size())
    start, rows = chunk_rows(shape[0], layout.world_size, layout.rank)
    expected = torch.Size([rows, *shape[1:]])
    if is_dtensor(value):
        local = value.to_local()
        where = f"placements {value.placements}"
    else:
        shards = value.local_shards()
        if len(shards) > 1:
            raise ValueError(
                f"[rank {global_rank()}] '{clean_fqn(key)}': expected at most one local shard "
                f"but got {len(shards)}"
            )
        if shards:
            local = shards[0].tensor
            offsets = list(shards[0].metadata.shard_offsets)
        else:
            local = torch.empty(expected, dtype=value.dtype)
            offsets = [start] + [0] * (len(shape) - 1)
        where = f"offsets {offsets}"
        if rows and offsets != [start] + [0] * (len(shape) - 1):
            local = None  # type: ignore[assignment]
    if local is None or local.shape != expected:
        got = None if local is None else tuple(local.shape)
        raise ValueError(
            f"[rank {global_rank()}] '{clean_fqn(key)}' is not chunked on dim 0 over "
            f"{layout.world_size} ranks: expected a local chunk of shape {tuple(expected)} "
            f"at row {start} but got {got} ({where}). Load sharded checkpoints through "
            "torch.distributed.checkpoint so they are resharded for this world size."
        )
    return shape, local


def gather_chunks(items: Sequence[tuple[str, Any]], layout: ChunkLayout) -> list[torch.Tensor]:
    """Full tensors from dim-0 chunked values: one all-gather per dtype.

    Every rank must pass the same keys in the same order (a collective).
    """
    out: list[torch.Tensor | None] = [None] * len(items)
    by_dtype: dict[torch.dtype, list[int]] = {}
    locals_: list[tuple[torch.Size, torch.Tensor]] = []
    for i, (key, value) in enumerate(items):
        locals_.append(local_chunk(key, value, layout))
        by_dtype.setdefault(value.dtype, []).append(i)
    ws = layout.world_size
    for dtype, idxs in by_dtype.items():
        sizes = []
        for i in idxs:
            shape = locals_[i][0]
            row = math.prod(shape[1:])
            sizes.append((math.ceil(shape[0] / ws) if shape[0] else 0) * row)
        total = sum(sizes)
        buf = torch.zeros(total, dtype=dtype, device=layout.device)
        pos = 0
        for i, size in zip(idxs, sizes):
            local = locals_[i][1].reshape(-1)
            buf[pos : pos + local.numel()].copy_(local)
            pos += size
        gathered = torch.empty(total * ws, dtype=dtype, device=layout.device)
        _collectives.all_gather_into(gathered, buf, layout.group)
        table = gathered.view(ws, total)
        pos = 0
        for i, size in zip(idxs, sizes):
            shape = locals_[i][0]
            full = table[:, pos : pos + size].reshape(-1)[: math.prod(shape)]
            out[i] = full.view(shape)
            pos += size
    return [t for t in out if t is not None]


def uses_dtensor(state: UnitState) -> bool:
    """Do this unit's SHARDED state dicts hold DTensors (a device mesh, or asked for)?"""
    cfg = state._state_dict_config
    return state.settings.device_mesh is not None or bool(getattr(cfg, "_use_dtensor", False))


def claim(state_dict: dict[str, Any], key: str, param: torch.Tensor, registered: bool) -> None:
    """Load ``key`` through the module (a registered parameter) or drop it (FSDP loads it)."""
    if registered:
        state_dict[key] = param  # nn.Module copies the parameter onto itself: a no-op
    else:
        del state_dict[key]


def claim_shared_and_flat(h: Any, state_dict: dict[str, Any], wrapped: str) -> None:
    """After a unit's parameters were loaded: its shared names go through the
    module too, and without ``use_orig_params`` the flat parameter is loaded
    as itself."""
    for shared in h.shared:
        key = wrapped + clean_fqn(shared.fqn)
        if key in state_dict:
            claim(state_dict, key, h.infos[shared.index].param, h.use_orig_params)
    if not h.use_orig_params:
        state_dict[wrapped + h.flat_name] = h.flat_param
