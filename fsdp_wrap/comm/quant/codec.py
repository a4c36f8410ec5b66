"""Blockwise integer codes for the bytes a collective moves: pure functions.

A row of ``n`` floating-point values is cut into *segments* (the units of a
bucket or a batched gather, one after another; one segment for a single
unit) and each segment into *blocks* of ``block_size`` elements counted from
the segment's own start (its last block may be shorter), so a unit's codes
never depend on which units travel with it.  Per block::

    scale = absmax / qmax                      (qmax 127 for int8, 7 for int4)
    code  = clamp(round(x * (1 / scale)), -qmax, qmax)
    x'    = code * scale                       (decoding, in float32)

computed in float32 whatever the input dtype.  A block of zeros has scale 0
and decodes to zeros; a block holding an inf or a NaN gets a NaN scale and
decodes to NaNs (so an overflow still reaches ``ShardedGradScaler``).

[Note: the error bound]
For every element ``|x - x'| <= scale / 2 + 4 * u * absmax`` of its block
(``u = 2**-24``): half a quantization step, plus the float32 roundings of
``1 / scale``, of the product and of the decoding (each at most ``u`` times a
value no larger than ``absmax``).  :func:`error_bound` gives it per element.

One *packet* (``uint8``) per row: the codes (int8: one byte each; int4: two
per byte, the even element in the low nibble), zero bytes up to a multiple
of 4, then one float32 scale per block.  Its size depends only on the
segments and the codec (:func:`packet_nbytes`), so every rank of a
collective sends packets of the same size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Codec", "QMAX", "decode_row", "encode_rows", "error_bound", "packet_nbytes",
           "roundtrip"]

#: The largest code of each width (symmetric: -qmax .. qmax).
QMAX = {8: 127, 4: 7}
_U32 = 2.0**-24  # float32 unit roundoff


@dataclass(frozen=True)
class Codec:
    """How values are coded: ``bits`` (8 or 4) per value, one scale per
    ``block_size`` values."""

    bits: int = 8
    block_size: int = 2048

    @property
    def qmax(self) -> int:
        return QMAX[self.bits]

    def __str__(self) -> str:
        return f"int{self.bits}/{self.block_size}"


@dataclass(frozen=True)
class _Plan:
    """Where each segment's blocks lie in a zero-padded ``(blocks, block_size)`` grid."""

    numel: int
    blocks: int
    block: int
    starts: tuple[int, ...]  # each segment's first element in the grid (flattened)
    segments: tuple[int, ...]
    aligned: bool  # every segment a whole number of blocks: the grid is the row itself

    def valid_index(self, device: torch.device) -> torch.Tensor:
        """Grid positions of the row's elements, in order."""
        return _valid_index(self, device)

    def block_index(self, device: torch.device) -> torch.Tensor:
        return _block_index(self, device)


@functools.lru_cache(maxsize=512)
def _plan(segments: tuple[int, ...], block: int) -> _Plan:
    starts, pos, blocks = [], 0, 0
    for n in segments:
        starts.append(pos)
        nb = -(-n // block)
        blocks += nb
        pos += nb * block
    numel = sum(segments)
    aligned = all(n % block == 0 for n in segments)
    return _Plan(numel, blocks, block, tuple(starts), segments, aligned)


@functools.lru_cache(maxsize=512)
def _valid_index(plan: _Plan, device: torch.device) -> torch.Tensor:
    parts = [torch.arange(s, s + n) for s, n in zip(plan.starts, plan.segments)]
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return idx.to(device)


@functools.lru_cache(maxsize=512)
def _block_index(plan: _Plan, device: torch.device) -> torch.Tensor:
    """The block of each of the row's elements."""
    return torch.div(_valid_index(plan, device), plan.block, rounding_mode="floor")


def _segments(n: int, segments: Sequence[int] | None) -> tuple[int, ...]:
    segs = (n,) if segments is None else tuple(int(s) for s in segments)
    if sum(segs) != n:
        raise ValueError(f"codec: segments {segs} do not add up to the row's {n} elements")
    return segs


def _code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def packet_nbytes(segments: Sequence[int], codec: Codec) -> int:
    """Bytes of one row's packet."""
    plan = _plan(tuple(segments), codec.block_size)
    return _round4(_code_bytes(plan.numel, codec.bits)) + 4 * plan.blocks


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def encode_rows(x: torch.Tensor, codec: Codec,
                segments: Sequence[int] | None = None) -> torch.Tensor:
    """One packet per row of ``x`` (``(rows, n)``, any floating dtype): ``(rows, P)`` uint8."""
    rows, n = x.shape
    plan = _plan(_segments(n, segments), codec.block_size)
    xf = x if x.dtype == torch.float32 else x.float()
    if plan.aligned and xf.is_contiguous():
        grid = xf.view(rows, plan.blocks, plan.block)
    else:
        flat = xf.new_zeros(rows, plan.blocks * plan.block)
        flat.index_copy_(1, plan.valid_index(x.device), xf)
        grid = flat.view(rows, plan.blocks, plan.block)
    absmax = grid.abs().amax(dim=2)  # (rows, blocks); NaN where a block holds one
    scale = absmax / codec.qmax
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    codes = (grid * inv.unsqueeze(2)).round_().clamp_(-codec.qmax, codec.qmax).view(rows, -1)
    if not bool(torch.isfinite(scale).all()):
        codes.nan_to_num_(0.0)  # (a non-finite block: its NaN scale carries it)
    if not plan.aligned:
        codes = codes.index_select(1, plan.valid_index(x.device))
    cb = _code_bytes(n, codec.bits)
    packet = torch.empty(rows, _round4(cb) + 4 * plan.blocks, dtype=torch.uint8, device=x.device)
    packet[:, cb : _round4(cb)] = 0
    if codec.bits == 8:
        packet[:, :cb].view(torch.int8).copy_(codes)
    else:
        u = codes.add_(8.0).to(torch.uint8)
        if n % 2:
            u = torch.cat([u, u.new_full((rows, 1), 8)], dim=1)
        packet[:, :cb] = u[:, 0::2] | (u[:, 1::2] << 4)
    packet[:, _round4(cb):] = scale.contiguous().view(torch.uint8)
    return packet


def decode_row(packet: torch.Tensor, codec: Codec, segments: Sequence[int] | None,
               out: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """Decode one packet into ``out`` (1-D, ``n`` elements, any floating dtype);
    returns ``out``.  ``segments`` as given to :func:`encode_rows`."""
    n = out.numel() if numel is None else numel
    plan = _plan(_segments(n, segments), codec.block_size)
    cb = _code_bytes(n, codec.bits)
    raw = packet[:cb]
    if codec.bits == 8:
        codes = raw.view(torch.int8).float()
    else:
        pair = torch.stack([(raw & 0xF), (raw >> 4)], dim=1).view(-1)[:n]
        codes = pair.float().sub_(8.0)
    start = _round4(cb)
    scale = packet[start : start + 4 * plan.blocks].view(torch.float32)
    if plan.aligned:
        vals = codes.view(plan.blocks, plan.block).mul_(scale.unsqueeze(1)).view(-1)
    else:
        vals = codes.mul_(scale.index_select(0, plan.block_index(packet.device)))
    out.copy_(vals)
    return out


def roundtrip(x: torch.Tensor, codec: Codec,
              segments: Sequence[int] | None = None) -> torch.Tensor:
    """``x`` (1-D) encoded and decoded: the float32 values a receiver gets."""
    out = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    return decode_row(encode_rows(x.reshape(1, -1), codec, segments)[0], codec, segments, out)


def error_bound(x: torch.Tensor, codec: Codec,
                segments: Sequence[int] | None = None) -> torch.Tensor:
    """Per element of ``x`` (1-D), the most :func:`roundtrip` may move it
    (see the note in this module's docstring)."""
    n = x.numel()
    plan = _plan(_segments(n, segments), codec.block_size)
    flat = x.float().new_zeros(plan.blocks * plan.block)
    flat.index_copy_(0, plan.valid_index(x.device), x.float().reshape(-1))
    absmax = flat.view(plan.blocks, plan.block).abs().amax(dim=1)
    per_block = absmax / codec.qmax / 2 + 4 * _U32 * absmax
    return per_block.index_select(0, plan.block_index(x.device))
