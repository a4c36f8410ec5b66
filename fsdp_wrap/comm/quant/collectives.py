"""Quantized collectives: encode what this rank sends, move the bytes, decode.

Pure functions of tensors, a :class:`~fsdp_wrap.comm.quant.codec.Codec` and
process groups, beside the exact ones of :mod:`fsdp_wrap.comm.collectives`
(which move the bytes here too, so tests that count those count these).
Every rank encodes with the same codec and segments, so packets are equally
sized on every rank.

* :func:`all_gather`: every rank's shard is encoded, the packets
  all-gathered and every row decoded, this rank's own too: every rank
  computes with the same values.
* :func:`reduce_scatter`: each rank encodes the row meant for each other rank,
  an all-to-all moves them, and the receiver decodes and sums them in float32
  in source-rank order (``acc = row_0; acc += row_1; ...``).
* :func:`all_reduce`: a :func:`reduce_scatter` of the value cut into one piece
  per rank, then an :func:`all_gather` of the summed pieces (encoded again),
  so every rank holds the same result.
* :func:`hier_all_gather` / :func:`hier_reduce_scatter`: for a group whose
  ranks span nodes (:class:`~fsdp_wrap.comm.quant.topology.Hierarchy`): only
  the step between nodes is quantized.

Decoding writes float32 sums (reductions) or the output's dtype (gathers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.comm.quant.codec import Codec, decode_row, encode_rows
from fsdp_wrap.comm.quant.topology import Hierarchy

__all__ = ["all_gather", "all_reduce", "hier_all_gather", "hier_all_reduce", "hier_reduce_scatter",
           "reduce_scatter"]

Result = C.Work | C.PendingWork | None


def _finish(work: C.Work | C.PendingWork | None, then: Callable[[], None],
            async_op: bool) -> Result:
    """``then`` (decoding) once ``work`` is done: now, or when the caller waits."""

    def done() -> None:
        if work is not None:
            work.wait()
        then()

    pending = C.PendingWork([], done)
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, codec: Codec,
               segments: Sequence[int] | None = None, async_op: bool = False) -> Result:
    """Every rank's ``shard`` (equal sizes) encoded, gathered and decoded into
    ``output`` (``world_size * shard.numel()`` elements, rank order, any float dtype)."""
    world = dist.get_world_size(group)
    packet = encode_rows(shard.reshape(1, -1), codec, segments)[0]
    received = packet.new_empty(world * packet.numel())
    work = C.all_gather_into(received, packet, group, async_op=True)
    n = shard.numel()

    def decode() -> None:
        rows, outs = received.view(world, -1), output.view(world, n)
        for r in range(world):
            decode_row(rows[r], codec, segments, outs[r])

    return _finish(work, decode, async_op)


def reduce_scatter(output: torch.Tensor, padded_input: torch.Tensor, group: ProcessGroup,
                   codec: Codec, segments: Sequence[int] | None = None,
                   async_op: bool = False) -> Result:
    """The sum over ranks of ``padded_input``'s ``r``-th chunk, on rank ``r``
    (into ``output``, one chunk): each chunk encoded by its sender, decoded and
    summed in float32 by its receiver, in source-rank order."""
    world = dist.get_world_size(group)
    n = output.numel()
    packets = encode_rows(padded_input.reshape(world, n), codec, segments)
    size = packets.shape[1]
    received = torch.empty_like(packets)
    C.all_to_all_into(received.view(-1), packets.view(-1), [size] * world, [size] * world, group)
    return _finish(None, lambda: _decode_sum(received, codec, segments, output), async_op)


def _decode_sum(rows: torch.Tensor, codec: Codec, segments: Sequence[int] | None,
                output: torch.Tensor) -> None:
    """``output = decode(rows[0]) + decode(rows[1]) + ...`` in float32, in order."""
    n = output.numel()
    acc = output if output.dtype == torch.float32 else torch.empty(n, device=output.device)
    decode_row(rows[0], codec, segments, acc, numel=n)
    if rows.shape[0] > 1:
        tmp = torch.empty_like(acc)
        for r in range(1, rows.shape[0]):
            acc.add_(decode_row(rows[r], codec, segments, tmp, numel=n))
    if acc is not output:
        output.copy_(acc)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, codec: Codec) -> torch.Tensor:
    """The sum over ranks of ``tensor`` (1-D), in float32, the same on every rank:
    :func:`reduce_scatter` of ``world_size`` equal pieces (zero-padded), then
    :func:`all_gather` of the summed pieces."""
    world = dist.get_world_size(group)
    n = tensor.numel()
    piece = -(-n // world)
    if n == world * piece:
        padded = tensor.reshape(-1)  # (encoding reads it in float32 whatever its dtype)
    else:
        padded = torch.zeros(world * piece, dtype=torch.float32, device=tensor.device)
        padded[:n].copy_(tensor.reshape(-1))
    mine = torch.empty(piece, dtype=torch.float32, device=tensor.device)
    reduce_scatter(mine, padded, group, codec)
    out = torch.empty(world * piece, dtype=torch.float32, device=tensor.device)
    all_gather(out, mine, group, codec)
    return out[:n]


def hier_all_gather(output: torch.Tensor, shard: torch.Tensor, hier: Hierarchy, codec: Codec,
                    segments: Sequence[int] | None = None) -> None:
    """:func:`all_gather` over a group spanning nodes, routed so the codes cross
    the link once per node: the ranks of one local index (one per node) gather
    each other's packets, then each node gathers its ranks' collections.
    Every row is decoded from its packet, as in :func:`all_gather`."""
    packet = encode_rows(shard.reshape(1, -1), codec, segments)[0]
    size = packet.numel()
    across = packet.new_empty(hier.nodes * size)
    C.all_gather_into(across, packet, hier.cross)
    within = packet.new_empty(hier.per_node * hier.nodes * size)
    C.all_gather_into(within, across, hier.intra)
    rows = within.view(hier.per_node, hier.nodes, size)
    outs = output.view(hier.nodes, hier.per_node, shard.numel())
    for node in range(hier.nodes):
        for local in range(hier.per_node):
            decode_row(rows[local, node], codec, segments, outs[node, local])


def hier_reduce_scatter(output: torch.Tensor, padded_input: torch.Tensor, hier: Hierarchy,
                        codec: Codec, segments: Sequence[int] | None = None) -> None:
    """:func:`reduce_scatter` over a group spanning nodes: the rows are summed
    exactly within each node first (a reduce-scatter in the input's dtype, over
    the node's ranks), then the node sums are encoded, exchanged between the
    ranks of one local index and summed in float32 in node order."""
    n = output.numel()
    # Rank (node, local) owns row node * per_node + local.  Reorder the rows to
    # (local, node) so the node's reduce-scatter leaves each rank the rows of
    # its local index, one per node.
    rows = padded_input.view(hier.nodes, hier.per_node, n).transpose(0, 1).contiguous()
    node_sums = rows.new_empty(hier.nodes * n)
    C.reduce_scatter_sum(node_sums, rows.view(-1), hier.intra, input_is_scratch=True)
    reduce_scatter(output, node_sums, hier.cross, codec, segments)


def hier_all_reduce(tensor: torch.Tensor, hier: Hierarchy, codec: Codec) -> torch.Tensor:
    """:func:`all_reduce` over a group spanning nodes: an exact reduce-scatter
    within each node, a quantized :func:`all_reduce` of each piece between the
    ranks of one local index, an exact all-gather within each node.  Returns
    the float32 sum, the same on every rank."""
    n = tensor.numel()
    piece = -(-n // hier.per_node)
    padded = tensor.new_zeros(hier.per_node * piece)
    padded[:n].copy_(tensor.reshape(-1))
    mine = padded.new_empty(piece)
    C.reduce_scatter_sum(mine, padded, hier.intra, input_is_scratch=True)
    summed = all_reduce(mine, hier.cross, codec)
    out = summed.new_empty(hier.per_node * piece)
    C.all_gather_into(out, summed, hier.intra)
    return out[:n]
