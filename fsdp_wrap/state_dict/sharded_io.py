"""SHARDED_STATE_DICT without all-gathers: move only the pieces each rank needs.

A rank's shard of a flat parameter is one contiguous 1-D slice of the
concatenated (flattened) original parameters.  The SHARDED format wants, for
every original parameter, the dim-0 ``torch.chunk`` piece each rank owns,
which is again one contiguous range of that parameter's flattened elements.
So for every parameter and every (holder, owner) pair of ranks the elements
to move are the intersection of two ranges: nothing needs to be gathered.

Saving a unit is one ``all_to_all`` over the shard group: each rank sends
every element of its shard to the rank whose chunk it falls in (elements it
owns itself are copied locally) and receives the elements of its own chunks
from the other ranks.  Each element is sent at most once, so a rank sends at
most its own shard and receives at most its chunks (about one shard), and the
extra memory is about one shard for each of the send and receive buffers.
Loading is the same exchange in reverse, written straight into the local shard.

The values built from the chunks are exactly those of the gathering
implementation (same local tensors, same ShardedTensor/DTensor metadata), so
DCP files do not change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import fsdp_wrap.comm.collectives as _collectives
import fsdp_wrap.state_dict.chunks as CH
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of the unsharded flat parameter (inside parameter
    ``param``) that shard-holder ``holder`` has and chunk-owner ``owner`` needs."""

    param: int
    holder: int
    owner: int
    start: int
    end: int


def chunk_rows(h: FlatParamHandle, index: int, rank: int) -> tuple[int, int]:
    """``(first row, row count)`` of ``rank``'s ``torch.chunk`` piece of parameter ``index``."""
    d0 = h.infos[index].shape[0]
    size = math.ceil(d0 / h.world_size) if d0 else 0
    first = min(d0, size * rank)
    return first, min(d0, first + size) - first


def chunk_range(h: FlatParamHandle, index: int, rank: int) -> tuple[int, int]:
    """Flat element range of ``rank``'s dim-0 chunk of parameter ``index``."""
    info = h.infos[index]
    row = math.prod(info.shape[1:])
    first, rows = chunk_rows(h, index, rank)
    return info.offset + first * row, info.offset + (first + rows) * row


def plan(h: FlatParamHandle, params: Sequence[int]) -> list[Piece]:
    """Every piece to move for the parameters ``params`` (same list on every rank)."""
    shard = h.shard_numel
    pieces = []
    for i in params:
        for owner in range(h.world_size):
            a, b = chunk_range(h, i, owner)
            if a == b:
                continue
            for holder in range(a // shard, (b - 1) // shard + 1):
                lo, hi = max(a, holder * shard), min(b, (holder + 1) * shard)
                if lo < hi:
                    pieces.append(Piece(i, holder, owner, lo, hi))
    return pieces


def _exchange(
    h: FlatParamHandle,
    pieces: list[Piece],
    shard: torch.Tensor,
    chunks: dict[int, torch.Tensor],
    saving: bool,
) -> None:
    """Move every piece from its source to its destination in one all-to-all.

    ``shard`` is this rank's (padded) flat shard of a flat-parameter-shaped
    tensor (the parameter itself, or one optimizer state); ``chunks[param]``
    is this rank's dim-0 chunk of that parameter, flat.  ``saving`` moves
    shard -> chunks, otherwise chunks -> shard.
    """
    me, ws = h.rank, h.world_size
    shard_base = h.shard_offset
    src_of = (lambda p: p.holder) if saving else (lambda p: p.owner)
    dst_of = (lambda p: p.owner) if saving else (lambda p: p.holder)

    def in_shard(p: Piece) -> torch.Tensor:
        return shard[p.start - shard_base : p.end - shard_base]

    def in_chunk(p: Piece) -> torch.Tensor:
        base = chunk_range(h, p.param, me)[0]
        return chunks[p.param][p.start - base : p.end - base]

    source, target = (in_shard, in_chunk) if saving else (in_chunk, in_shard)
    sends: list[list[Piece]] = [[] for _ in range(ws)]
    recvs: list[list[Piece]] = [[] for _ in range(ws)]
    for p in pieces:
        src, dst = src_of(p), dst_of(p)
        if src == me and dst == me:
            target(p).copy_(source(p))
        elif src == me:
            sends[dst].append(p)
        elif dst == me:
            recvs[src].append(p)
    in_splits = [sum(p.end - p.start for p in s) for s in sends]
    out_splits = [sum(p.end - p.start for p in r) for r in recvs]
    if ws == 1:
        return
    send_buf = torch.empty(sum(in_splits), dtype=shard.dtype, device=shard.device)
    pos = 0
    for s in sends:
        for p in s:
            n = p.end - p.start
            send_buf[pos : pos + n].copy_(source(p))
            pos += n
    recv_buf = torch.empty(sum(out_splits), dtype=shard.dtype, device=shard.device)
    _collectives.all_to_all_into(recv_buf, send_buf, out_splits, in_splits, h.process_group)
    del send_buf
    pos = 0
    for r in recvs:
        for p in r:
            n = p.end - p.start
            target(p).copy_(recv_buf[pos : pos + n])
            pos += n


def chunks_from_shard(
    h: FlatParamHandle, shard: torch.Tensor, params: Sequence[int]
) -> dict[int, torch.Tensor]:
    """This rank's dim-0 chunk of each parameter in ``params`` (fresh tensors shaped
    ``[rows, *shape[1:]]``) out of every rank's flat ``shard``: a collective, every
    rank passing the same ``params``."""
    out: dict[int, torch.Tensor] = {}
    flat: dict[int, torch.Tensor] = {}
    for i in params:
        info = h.infos[i]
        rows = chunk_rows(h, i, h.rank)[1]
        out[i] = torch.empty((rows, *info.shape[1:]), dtype=shard.dtype, device=shard.device)
        flat[i] = out[i].view(-1)
    _exchange(h, plan(h, params), shard, flat, saving=True)
    return out


def shard_from_chunks(
    h: FlatParamHandle, chunks: dict[int, torch.Tensor], into: torch.Tensor
) -> None:
    """Write this rank's dim-0 chunks ``{param index: chunk}`` into the flat shards
    ``into`` of the ranks that hold them: a collective, every rank passing the same
    parameter indices."""
    flat = {i: c.detach().reshape(-1).to(into.dtype) for i, c in chunks.items()}
    with torch.no_grad():
        _exchange(h, plan(h, sorted(chunks)), into, flat, saving=False)


def local_chunks(h: FlatParamHandle) -> list[torch.Tensor]:
    """This rank's dim-0 chunk of every original parameter, read where the shard lives."""
    chunks = chunks_from_shard(h, h.local_shard, range(len(h.infos)))
    return [chunks[i] for i in range(len(h.infos))]


def load_chunks(h: FlatParamHandle, chunks: dict[int, torch.Tensor]) -> None:
    """This rank's dim-0 parameter chunks into the flat parameter shards that hold them."""
    h.load_shard_with(lambda shard: shard_from_chunks(h, chunks, shard))


def load_sharded_unit(
    state: UnitState,
    state_dict: dict[str, Any],
    wrapped: str,
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """SHARDED load of one unit straight into its flat shard (a collective, no gather).

    Chunked values (ShardedTensor/DTensor, dim-0 chunks over this unit's shard
    group) are exchanged with :func:`load_chunks`; plain full tensors are cut
    locally as a FULL load does.  The keys are then claimed so ``nn.Module``
    neither copies them again nor reports them; missing and mis-shaped
    parameters are reported by name.  Every rank decides the same exchange
    from the same keys and global shapes.
    """
    layout = CH.chunk_layout(state, CH.uses_dtensor(state))
    for h in state._handles:
        _load_sharded_handle(h, layout, state_dict, wrapped, missing_keys, error_msgs)


def _load_sharded_handle(
    h: FlatParamHandle,
    layout: CH.ChunkLayout,
    state_dict: dict[str, Any],
    wrapped: str,
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """:func:`load_sharded_unit` for one of the unit's flat parameters."""
    if layout.world_size != h.world_size:
        raise RuntimeError(
            f"[rank {global_rank()}] FSDP unit '{h.unit_fqn or '<root>'}': sharded state-dict values are "
            f"chunked over {layout.world_size} ranks but the unit is sharded over {h.world_size}"
        )
    h.invalidate_unsharded()  # any gathered copy is stale from here on
    chunks: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for i, info in enumerate(h.infos):
            key = wrapped + clean_fqn(info.fqn)
            value = state_dict.get(key)
            if value is None:
                if not h.use_orig_params:  # not registered: nn.Module cannot see it
                    missing_keys.append(key)
                continue
            shape = (
                torch.Size(value.size()) if CH.is_chunked(value)
                else value.shape if isinstance(value, torch.Tensor) else None
            )
            if shape is None or tuple(shape) != tuple(info.shape):
                got = tuple(shape) if shape is not None else type(value).__name__
                error_msgs.append(
                    f"size mismatch for {clean_fqn(key)}: copying a param with shape {got} "
                    f"from checkpoint, the shape in current model is {tuple(info.shape)}."
                )
            elif CH.is_chunked(value):
                chunks[i] = CH.local_chunk(key, value, layout)[1]
            else:
                h.load_param(i, value)
            CH.claim(state_dict, key, info.param, h.use_orig_params)
        CH.claim_shared_and_flat(h, state_dict, wrapped)
    load_chunks(h, chunks)
