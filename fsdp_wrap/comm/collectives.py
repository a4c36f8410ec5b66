"""Collectives as pure functions: tensors and a group in, a result out.

These know tensors and process groups, never modules or handles, so tests can
patch this module to count calls and bytes.  Every function is one logical
collective.  On gloo with CPU tensors two of them are carried by faster c10d
collectives (measured on torch 2.13, 2 ranks, ``docs/performance/step.rst``):

* over two ranks, an all-gather by one exchange (:func:`exchange`: this
  rank's row of the output sent to the other rank, the other's received in
  place, by ``isend``/``irecv``), at any size: the broadcasts below each run
  through gloo's worker threads, and gloo's all-gather (below 256 KiB) stages
  its output; on this project's 2-core machines each collective costs about
  0.5-1 ms of thread hand-offs whatever its size, so the form matters as much
  as the bytes.  The bytes are the same: each rank sends its row once, as in
  gloo's ring;
* over more ranks, a large all-gather by one broadcast per rank, straight into the output
  (:func:`all_gather_into`): gloo's all-gather stages the whole output in a
  buffer of its own and copies it out, so at 48 MiB it takes about 90 ms where
  two broadcasts take 20, at 7 MiB 3.5-8 ms against 3.1-3.3, at 256 KiB to
  1 MiB 0.84-0.89x the time, and it holds a second output-sized buffer
  meanwhile (allocated on gloo's thread); at 128 KiB the all-gather is faster
  (two collectives' latency).  Only where the group lies within one node
  (:func:`gather_by_broadcasts`): across nodes the broadcasts' trees send
  more over the link than gloo's ring;
* a reduce-scatter over two ranks by one exchange of halves, each rank adding
  the half it receives to its own (half the bytes of gloo's, which all-reduces;
  bit-identical: a sum of two does not depend on the order), and over more
  ranks, of a scratch input, by an in-place all-reduce
  (:func:`reduce_scatter_sum`).

[Note: what crosses the link]
Which collective carries a gather decides the bytes between nodes, not only
the time on one host.  gloo's all-gather is a ring in group-rank order: each
rank sends ``(n - 1) / n`` of the output to the next, and with torchrun's
layout (a node's ranks consecutive) one ring edge leaves each node, so a node
sends ``(n - 1) / n`` of the output.  gloo's broadcast is a binomial tree
rooted at the source (``r -> r+1``, then ``r -> r+2`` and ``r+1 -> r+3``, ...),
whose edges cross the node boundary more often: at 2 nodes x 2 ranks the four
broadcasts of a gather send 1.25x the output per node, the ring 0.75x
(measured with the interface counters of ``fsdp_wrap.cli.testbed``:
``docs/performance/archive/nodes.rst``).  So a group of more than two
ranks that spans nodes gathers with gloo's all-gather, as torch's FSDP1 does;
a group of two exchanges rows wherever its ranks are (each sends its row
once, as in the ring).  A rank's node is
``global rank // LOCAL_WORLD_SIZE`` (torchrun's numbering, the same rule the
default hybrid groups use); without ``LOCAL_WORLD_SIZE`` every rank is taken to
share one node.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fsdp_wrap._compat import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, sole_tensor_of_storage

Work = dist.Work


class DivideFactors(NamedTuple):
    """Gradients are divided by ``pre`` before and ``post`` after summation.

    Splitting the division keeps low-precision sums away from overflow and
    underflow; ``pre * post == world_size`` so the result is the mean.
    """

    pre: float
    post: float


def global_rank() -> int:
    """This process's rank in the default group (0 before init): the number an
    error message names, whatever group the failing unit uses."""
    return dist.get_rank() if dist.is_initialized() else 0


def divide_factors(data_parallel_world_size: int) -> DivideFactors:
    """torch FSDP1's factors: ``pre`` doubles while it stays below ``ws / pre``."""
    factor = 1
    while data_parallel_world_size % factor == 0 and data_parallel_world_size / factor > factor:
        factor *= 2
    return DivideFactors(float(factor), data_parallel_world_size / factor)


#: On gloo over more than two ranks, all-gather outputs from this size up are
#: gathered by broadcasts (within one node: :func:`gather_by_broadcasts`).
GLOO_BROADCAST_MIN_BYTES = 1 << 18


def ranks_per_node() -> int | None:
    """``LOCAL_WORLD_SIZE`` as torchrun (and Accelerate, Lightning, ...) set it;
    ``None`` where it is not set (then every rank is taken to share one node)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def spans_nodes(ranks: Sequence[int], per_node: int | None) -> bool:
    """Whether the global ``ranks`` of a group sit on more than one node, with
    ``per_node`` consecutive ranks per node (``None``: one node holds them all)."""
    if not per_node:
        return False
    return len({r // per_node for r in ranks}) > 1


def gather_by_broadcasts(nbytes: int, ranks: Sequence[int], per_node: int | None) -> bool:
    """Whether a gloo all-gather of ``nbytes`` output over the group of global
    ``ranks`` runs as one broadcast per rank: from :data:`GLOO_BROADCAST_MIN_BYTES`
    up, where the group lies within one node (see the note at the top)."""
    return nbytes >= GLOO_BROADCAST_MIN_BYTES and not spans_nodes(ranks, per_node)


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Work | PendingWork | None:
    """Gather every rank's equally sized ``shard`` into ``output`` (rank order).

    On gloo with a contiguous CPU output where :func:`gathers_in_rows` says
    so, each rank's row of ``output`` is filled in place (no staging buffer, no
    copy-out): over two ranks by one :func:`exchange`, over more by one
    broadcast per group rank, all in flight at once.
    """
    if gathers_in_rows(output, group):
        ranks = dist.get_process_group_ranks(group)  # (global ranks, group order)
        rows = output.view(len(ranks), -1)
        me = dist.get_rank(group)
        own = rows[me]
        if shard.data_ptr() != own.data_ptr():  # (else the caller wrote it in place)
            own.copy_(shard.reshape(-1))
        if len(ranks) == 2:
            pending = PendingWork(exchange(rows[1 - me], own, group))
        else:
            pending = PendingWork([dist.broadcast(rows[r], src=src, group=group, async_op=True)
                                   for r, src in enumerate(ranks)])
        if async_op:
            return pending
        pending.wait()
        return None
    return getattr(dist, ALL_GATHER_SINGLE)(output, shard, group=group, async_op=async_op)


def gathers_in_rows(output: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether :func:`all_gather_into` fills ``output`` row by row in place (gloo,
    CPU, a contiguous output; two ranks, or broadcasts by
    :func:`gather_by_broadcasts`): then a caller may write this rank's shard
    straight into its row of ``output`` and pass that row as the shard (no send
    buffer, no copy)."""
    if not (output.is_contiguous() and _is_gloo_cpu(group, output)):
        return False
    if dist.get_world_size(group) == 2:
        return True
    return gather_by_broadcasts(output.numel() * output.element_size(),
                                dist.get_process_group_ranks(group), ranks_per_node())


def exchange(received: torch.Tensor, sent: torch.Tensor, group: ProcessGroup) -> list[Work | None]:
    """Over a group of two ranks: send ``sent`` to the other rank and receive its
    ``sent`` into ``received`` (as many elements), in flight.

    An ``isend``/``irecv`` pair: gloo runs them on the caller's pair of
    sockets, with no worker thread in between, and lets go of both tensors as
    soon as they are waited for.  (``all_to_all_single`` with splits that route
    nothing to this rank is one operation instead of two and as fast, but
    gloo's worker thread keeps its tensors a moment after the operation
    completes, so a buffer dropped right after a gather outlived its use: up
    to 2.2 MiB more at the measured peaks of ``benchmarks/plan_accuracy.py``.)
    """
    peer = dist.get_global_rank(group, 1 - dist.get_rank(group))
    return [dist.isend(sent, dst=peer, group=group), dist.irecv(received, src=peer, group=group)]


class PendingWork:
    """Collectives standing in for one (the broadcasts of a gloo all-gather, the
    all-reduce of a gloo reduce-scatter), waited for as one; ``then`` finishes
    the result once they are done (copying this rank's chunk out)."""

    def __init__(self, works: list[Work | None], then: Callable[[], object] | None = None) -> None:
        self.works, self.then = works, then

    def wait(self) -> bool:
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def gather_into(
    output: torch.Tensor | None, shard: torch.Tensor, dst_group_rank: int, group: ProcessGroup
) -> None:
    """Gather every rank's ``shard`` into ``output`` on group rank ``dst_group_rank`` only.

    ``output`` (``world_size * shard.numel()`` elements) is given on the
    destination and ``None`` elsewhere; other ranks never hold the whole.
    """
    dst = dist.get_global_rank(group, dst_group_rank)
    if _is_gloo_cpu(group, shard):
        # gloo's gather stages every rank's input in a buffer of its own before
        # copying it out (a whole unit more on the destination): receive each
        # rank's shard straight into its place instead, all in flight at once.
        me = dist.get_rank(group)
        if me != dst_group_rank:
            dist.send(shard.contiguous(), dst=dst, group=group)
            return
        rows = output.view(dist.get_world_size(group), -1) if output is not None else None
        if rows is None:
            raise ValueError("gather_into: the destination needs an output tensor")
        works = [dist.irecv(rows[r], src=dist.get_global_rank(group, r), group=group)
                 for r in range(rows.shape[0]) if r != me]
        rows[me].copy_(shard.reshape(-1))
        for w in works:
            if w is not None:
                w.wait()
        return
    chunks = list(output.chunk(dist.get_world_size(group))) if output is not None else None
    dist.gather(shard, chunks, dst=dst, group=group)


def reduce_scatter_sum(
    output: torch.Tensor,
    padded_input: torch.Tensor,
    group: ProcessGroup,
    async_op: bool = False,
    input_is_scratch: bool = False,
) -> Work | PendingWork | None:
    """Sum ``padded_input`` over ranks and keep this rank's chunk in ``output``.

    ``input_is_scratch``: the caller is done with ``padded_input`` (a gradient
    it took for reduction, or its own padded copy or bucket), so its contents
    may be overwritten (and on gloo its storage is freed once this rank's
    chunk is out, where no other tensor shares it).  Gloo's reduce-scatter clones its whole input, all-reduces
    the clone and copies this rank's chunk out; with a scratch input the same
    all-reduce then runs on the input itself: the same algorithm, bytes and
    sums (bit-identical), without the input-sized copy, i.e. one unsharded
    gradient less at the peak of every reduction.  Over two gloo ranks neither:
    one exchange of halves (:func:`_reduce_scatter_by_exchange`).  Other
    backends (NCCL) get the reduce-scatter, which sends half the bytes of an
    all-reduce.
    """
    if (_is_gloo_cpu(group, padded_input) and dist.get_world_size(group) == 2
            and padded_input.numel() == 2 * output.numel()):  # (else torch's error below)
        pending = _reduce_scatter_by_exchange(output, padded_input, group, input_is_scratch)
        if async_op:
            return pending
        pending.wait()
        return None
    if input_is_scratch and _is_gloo_cpu(group, padded_input):
        # gloo's worker thread lets go of its input a moment *after* the
        # collective completes, so dropping our references does not free it
        # then: the next ops of backward ran with a whole unsharded gradient
        # still held, or not, by a race (a T5 unit: peaks of 17.5 or 19.5 MiB
        # from step to step).  Where no other tensor shares the storage it is
        # freed here, as soon as this rank's chunk is out.
        free_input = sole_tensor_of_storage(padded_input)
        work = dist.all_reduce(padded_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        chunk = padded_input.view(-1).chunk(dist.get_world_size(group))[dist.get_rank(group)]

        def finish() -> None:
            output.view(-1).copy_(chunk)
            if free_input:
                free_storage(padded_input)

        pending = PendingWork([work], finish)
        if async_op:
            return pending
        pending.wait()
        return None
    return getattr(dist, REDUCE_SCATTER_SINGLE)(
        output, padded_input, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


def _reduce_scatter_by_exchange(
    output: torch.Tensor, padded_input: torch.Tensor, group: ProcessGroup, input_is_scratch: bool
) -> PendingWork:
    """A gloo reduce-scatter over two ranks as one exchange of halves.

    Each rank sends the half the other keeps and adds the half it receives to
    its own: half the bytes and one step, where gloo's reduce-scatter (and the
    all-reduce of :func:`reduce_scatter_sum`) also sends the summed halves
    back.  The sum of two numbers does not depend on their order, so the
    result is bit-identical to gloo's (in the input's dtype, rounded once).
    ``padded_input`` is only read (freed at the end where it is scratch and no
    other tensor shares it).
    """
    me = dist.get_rank(group)
    halves = padded_input.view(-1).chunk(2)
    mine, theirs = halves[me], halves[1 - me]
    out = output.view(-1)
    # received straight into the output unless that would overwrite our half first
    direct = (out.dtype == mine.dtype and out.is_contiguous()
              and out.untyped_storage().data_ptr() != padded_input.untyped_storage().data_ptr())
    received = out if direct else torch.empty_like(mine)
    free_input = input_is_scratch and sole_tensor_of_storage(padded_input)
    works = exchange(received, theirs, group)

    def finish() -> None:
        received.add_(mine)
        if not direct:
            out.copy_(received)
        if free_input:
            free_storage(padded_input)

    return PendingWork(works, finish)


def free_storage(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s storage now (its data is done with; see :func:`release`)."""
    tensor.untyped_storage().resize_(0)


def release(tensor: torch.Tensor) -> None:
    """Free a CPU tensor a finished collective had, now, where no other tensor
    shares its storage: gloo's worker thread drops its own reference a moment
    after the collective completes, so the memory would otherwise go at a time
    that races the next ops (and their peak)."""
    if tensor.device.type == "cpu" and sole_tensor_of_storage(tensor):
        free_storage(tensor)


def _is_gloo_cpu(group: ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether ``group`` runs collectives on ``tensor`` through gloo on CPU."""
    if tensor.device.type != "cpu" or not hasattr(dist, "ProcessGroupGloo"):
        return False
    try:
        backend = group._get_backend(tensor.device)
    except (RuntimeError, AttributeError):
        return False
    return isinstance(backend, dist.ProcessGroupGloo)


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Work | None:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup) -> None:
    """Broadcast from global rank ``src`` within ``group``."""
    dist.broadcast(tensor, src=src, group=group)


def all_gather_objects(obj: object, group: ProcessGroup) -> list[object]:
    world_size = dist.get_world_size(group)
    out: list[object] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def all_to_all_into(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: ProcessGroup,
) -> None:
    """Send ``input``'s ``r``-th split to group rank ``r``; receive rank ``r``'s into
    ``output``'s ``r``-th split (1-D tensors, uneven splits allowed)."""
    dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group
    )
