"""Batched all-gathers: a small unit gathers the next unit(s) in the same collective.

On a latency-bound backend (gloo: about 0.7 ms per all-gather whatever its
size) a model of many small units spends its forward and backward waiting
on one all-gather per unit.  When a unit's gather is smaller than the cap,
:func:`gather_ahead` also gathers the units that come next in the
recorded order (forward: the first iteration's pre-forward order; backward:
this iteration's post-forward order reversed), as long as each still needs
a gather, is compatible (same group, dtype, device) and the batch's bytes
stay within the cap.  Each rank sends its shards of all of them one after
another; row ``r`` of the gathered ``(world_size, sum of shard sizes)``
result then holds rank ``r``'s shards, which are copied into each unit's own
unsharded buffer (the same storage object as always: autograd holds views of
it).  No arithmetic is involved, so the data are exactly a per-unit gather's.

Which units a batch takes is decided by :func:`fsdp_wrap.comm.schedule.gather_batch`
over a description of each (:class:`~fsdp_wrap.comm.schedule.GatherItem`),
the same rule the planner replays; a "unit" here is one flat parameter
(a handle), chained one by one across FSDP units.

[Note: what a batch costs]
The followers are gathered early, like a prefetch: until their own forward
(or backward) they hold their unsharded copy, at most ``cap`` bytes beyond
the unit being computed, plus the batch's receive buffer for the moment of
the copy.  That bound is what ``limit_all_gathers`` keeps meaning: a batch
counts as one gather in flight.  Batching is the CPU path of
``limit_all_gathers=True``; units that gather asynchronously (accelerators,
``limit_all_gathers=False``) keep their per-unit, overlapped gathers.  A batch
gathered at its first unit's turn is waited for at once; one that a prefetch
starts (backward prefetch, ``forward_prefetch``, and in forward the next batch
once the last unit of the current one runs) stays in flight while the current
unit computes, in its receive buffer, and the first member that waits for it
copies every member's part out: the same bytes ahead, at most one batch, with
the collective's latency behind compute.  That copy-out holds the receive
buffer and every member's copy at once, twice the batch: in forward it comes
early (activations grow while a batch lasts), but in backward it would come
where activations are at their most, so there each member copies its own part
out at its turn (``each_at_its_turn``) and the receive buffer goes with the
last part: the batch's bytes plus the member computing, where that holds
less at its worst (:func:`~fsdp_wrap.comm.schedule.by_member_pays`: the
largest member under half the batch).  A follower that then does not run
(control flow) is freed with every other
unit at the end of backward, or, with no backward, at the next root forward
(a forward without grad does not batch, since neither of those would follow).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Callable, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.comm.labels as L
from fsdp_wrap.comm.bucket import resolve_mb
from fsdp_wrap.comm.quant.wire import Wire
from fsdp_wrap.comm.schedule import GatherItem, by_member_pays, gather_batch, starts_batch


class GatherUnit(Protocol):
    """What a batched gather reads and calls on a unit's handle
    (``fsdp_wrap.handle.flat_param.FlatParamHandle``; the layer above)."""

    flat_param: torch.nn.Parameter
    compute_dtype: torch.dtype
    async_gathers: bool
    wire: Wire

    @property
    def unit_fqn(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def process_group(self) -> ProcessGroup: ...
    @property
    def computes_in_full_precision(self) -> bool: ...
    @property
    def gather_nbytes(self) -> int: ...
    def needs_gather(self) -> bool: ...
    def gather_input(self) -> torch.Tensor: ...
    def take_gathered(self, rows: torch.Tensor) -> None: ...
    def expect_gathered(self, pending: C.PendingWork) -> None: ...

__all__ = ["ALL_GATHER_BATCH_ENV", "DEFAULT_ALL_GATHER_BATCH_MB", "by_member_pays",
           "gather_ahead", "resolve_all_gather_batch_mb"]

H = TypeVar("H", bound=GatherUnit)

DEFAULT_ALL_GATHER_BATCH_MB = 1.0
ALL_GATHER_BATCH_ENV = "FSDP_WRAP_ALL_GATHER_BATCH_MB"


def resolve_all_gather_batch_mb(value: float | None) -> float:
    """The constructor's value, else ``$FSDP_WRAP_ALL_GATHER_BATCH_MB``, else the default."""
    return resolve_mb(value, "all_gather_batch_mb", ALL_GATHER_BATCH_ENV,
                      DEFAULT_ALL_GATHER_BATCH_MB)


def gather_ahead(
    handle: H,
    cap_bytes: int,
    next_of: Callable[[H], H | None],
    async_op: bool = False,
    each_at_its_turn: bool = False,
) -> None:
    """If ``handle`` needs a gather and is small, gather it now together with
    the units ``next_of`` chains to, within ``cap_bytes``.

    Called just before the handle's own ``start_unshard`` / ``finish_unshard``
    (which then find the data there).  Postcondition: each unit of a batch
    holds a valid unsharded copy, or one that is coming: with ``async_op`` (a
    prefetch) the collective is still in flight, and the first unit to wait
    for it copies every member's part out; with ``each_at_its_turn`` every
    member copies its own part out when it waits (see [Note: what a batch
    costs]); with nothing to batch, nothing happened.
    """
    batch = _plan(handle, cap_bytes, next_of)
    if len(batch) > 1:
        _gather(batch, async_op, each_at_its_turn)


def _plan(
    handle: H,
    cap_bytes: int,
    next_of: Callable[[H], H | None],
) -> list[H]:
    """``handle`` and the units ``next_of`` chains to that one gather takes
    (the rule: :func:`fsdp_wrap.comm.schedule.gather_batch`)."""
    first = _describe(handle)
    if not starts_batch(first, cap_bytes):
        return [handle]  # (the rule's first test, before any follower is looked at)
    chained: list[H] = []

    def followers() -> Iterator[GatherItem]:
        for h in _chain(handle, next_of):
            chained.append(h)
            yield _describe(h)

    count = gather_batch(first, followers(), cap_bytes)
    return [handle, *chained[: count - 1]]


def _chain(handle: H, next_of: Callable[[H], H | None]) -> Iterator[H]:
    """The units gathered after ``handle``, in order, each once."""
    seen = [handle]
    nxt = next_of(handle)
    while nxt is not None and nxt not in seen:
        seen.append(nxt)
        yield nxt
        nxt = next_of(nxt)


def _describe(h: GatherUnit) -> GatherItem:
    """What the batching rule reads of a unit.  (A unit computing in full
    precision, ``FSDP_USE_FULL_PREC_IN_EVAL``, gathers its full-precision
    parameters, not the compute copies a batch holds.)"""
    if not h.needs_gather():
        return _GATHERS_NOTHING  # (NO_SHARD, or gathered: read no further, every step)
    return GatherItem(h.gather_nbytes, True,
                      not h.async_gathers and not h.computes_in_full_precision,
                      (h.process_group, h.compute_dtype, h.wire, h.device))


_GATHERS_NOTHING = GatherItem(0, False, False, None)


def _gather(batch: list[H], async_op: bool = False, each_at_its_turn: bool = False) -> None:
    """One all-gather for every unit in ``batch`` (compute copies)."""
    inputs = [h.gather_input() for h in batch]
    widths = [t.numel() for t in inputs]
    total, group, wire = sum(widths), batch[0].process_group, batch[0].wire
    rows = inputs[0].new_empty((batch[0].world_size, total), dtype=batch[0].compute_dtype)
    if wire.weights is None and C.gathers_in_rows(rows, group):
        # This rank's shards go straight into its own row: no send buffer.
        send = torch.cat(inputs, out=rows[dist.get_rank(group)])
    else:
        send = torch.cat(inputs)
    del inputs  # (cast copies of the shards: sent, or in ``send`` until it is)
    # (a coded wire's blocks start at each unit's shard: ``widths``)
    if L.profiler_enabled():
        with L.span(L.ALL_GATHER, L.names(h.unit_fqn for h in batch)):
            work = wire.all_gather(rows.view(-1), send, group, segments=widths,
                                   async_op=async_op)
    else:
        work = wire.all_gather(rows.view(-1), send, group, segments=widths, async_op=async_op)
    # (each member's columns; views of ``rows``: the buffer goes with the last)
    parts = rows.split(widths, dim=1)
    del rows
    if each_at_its_turn and by_member_pays([h.gather_nbytes for h in batch]):
        flight = _InFlight(work, send)
        del send
        for h, part in zip(batch, parts):
            h.expect_gathered(C.PendingWork([], then=functools.partial(_take_part, flight, h, part)))
        return

    def copy_out() -> None:
        for h, part in zip(batch, parts):
            h.take_gathered(part)

    if work is None:
        copy_out()
        return
    pending = C.PendingWork([], then=functools.partial(_finish, work, send, copy_out))
    for h in batch:
        h.expect_gathered(pending)


def _finish(work: C.Work | C.PendingWork, send: torch.Tensor,
            copy_out: Callable[[], None]) -> None:
    """Wait for a batch in flight and copy every member's part out; ``send``
    (the collective's input) is an argument only to stay alive until then (the
    partial holding it goes when the batch's ``PendingWork`` has run it)."""
    work.wait()
    copy_out()


class _InFlight:
    """A batch's collective, waited for once by whichever member comes first;
    holds the collective's input until then."""

    def __init__(self, work: C.Work | C.PendingWork | None, send: torch.Tensor) -> None:
        self.work: C.Work | C.PendingWork | None = work
        self.send: torch.Tensor | None = send if work is not None else None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = self.send = None


def _take_part(flight: _InFlight, handle: GatherUnit, part: torch.Tensor) -> None:
    """One member's wait: the batch's collective (if still in flight), then its
    own columns of the receive buffer copied into its compute copy."""
    flight.wait()
    handle.take_gathered(part)
