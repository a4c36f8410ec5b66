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
from collections.abc import Iterator, Sequence
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
class _Piece:
    """One segment: ``full`` whole blocks from ``offset`` (its first block is
    ``block0``), then a shorter block of ``rest`` elements if ``rest``."""

    offset: int
    block0: int
    full: int
    rest: int


@dataclass(frozen=True)
class _Plan:
    """Where each segment's blocks lie in the row and in the scales."""

    numel: int
    blocks: int
    block: int
    pieces: tuple[_Piece, ...]
    aligned: bool  # every segment a whole number of blocks: one (blocks, block) view

    def valid_index(self, device: torch.device) -> torch.Tensor:
        """Positions of the row's elements in a zero-padded ``(blocks, block)`` grid."""
        return _valid_index(self, device)


@functools.lru_cache(maxsize=512)
def _plan(segments: tuple[int, ...], block: int) -> _Plan:
    pieces, offset, blocks = [], 0, 0
    for n in segments:
        full, rest = divmod(n, block)
        pieces.append(_Piece(offset, blocks, full, rest))
        offset += n
        blocks += full + (1 if rest else 0)
    aligned = all(p.rest == 0 for p in pieces)
    return _Plan(offset, blocks, block, tuple(pieces), aligned)


@functools.lru_cache(maxsize=512)
def _valid_index(plan: _Plan, device: torch.device) -> torch.Tensor:
    parts = [torch.arange(p.block0 * plan.block, p.block0 * plan.block + p.full * plan.block
                          + p.rest) for p in plan.pieces]
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return idx.to(device)


def _blocks_of(x: torch.Tensor, plan: _Plan, whole: bool) -> Iterator[tuple[torch.Tensor, slice]]:
    """``(view, scales)`` per run of blocks of ``x`` (``(rows, n)``): the view is
    ``(rows, k, size)`` (whole blocks, or one shorter block), ``scales`` the
    blocks' columns in the ``(rows, blocks)`` scales.  ``whole``: one view of
    every block (``plan.aligned`` and ``x`` contiguous)."""
    rows, b = x.shape[0], plan.block
    if whole:
        yield x.view(rows, plan.blocks, b), slice(0, plan.blocks)
        return
    for p in plan.pieces:
        end = p.offset + p.full * b
        if p.full:
            yield x[:, p.offset:end].view(rows, p.full, b), slice(p.block0, p.block0 + p.full)
        if p.rest:
            blk = p.block0 + p.full
            yield x[:, end:end + p.rest].view(rows, 1, p.rest), slice(blk, blk + 1)


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
    whole = plan.aligned and xf.is_contiguous()
    absmax = torch.empty(rows, plan.blocks, device=x.device)  # NaN where a block holds one
    for view, cols in _blocks_of(xf, plan, whole):
        absmax[:, cols] = view.abs().amax(dim=2)
    # Divided by a 0-dim tensor on the device, not a Python number: CUDA turns a
    # division by a host scalar into a multiplication by its reciprocal (not
    # always the correctly rounded quotient) where the CPU divides; a tensor
    # divisor makes both divide, so the packets are the same on every device.
    scale = absmax.div_(absmax.new_full((), float(codec.qmax)))
    finite = bool(torch.isfinite(scale).all())
    if not finite:
        scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    codes = torch.empty(rows, n, device=x.device)
    for (view, cols), (out, _) in zip(_blocks_of(xf, plan, whole), _blocks_of(codes, plan, whole)):
        torch.mul(view, inv[:, cols].unsqueeze(2), out=out)
    codes.round_().clamp_(-codec.qmax, codec.qmax)
    if not finite:
        codes.nan_to_num_(0.0)  # (a non-finite block: its NaN scale carries it)
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
    scale = packet[start : start + 4 * plan.blocks].view(torch.float32).view(1, -1)
    for view, cols in _blocks_of(codes.view(1, n), plan, plan.aligned):
        view.mul_(scale[:, cols].unsqueeze(2))
    out.copy_(codes)
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
    lengths = [b for p in plan.pieces for b in [plan.block] * p.full + ([p.rest] if p.rest else [])]
    return per_block.repeat_interleave(torch.tensor(lengths, device=x.device))
