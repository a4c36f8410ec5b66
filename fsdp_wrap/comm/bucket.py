"""Bucketed gradient reduction: several units' gradients in one collective.

Per-unit reduction pays one collective per unit in every backward; for small
units the fixed latency of each collective dominates the step (gloo: about
2-3 ms per reduce-scatter).  :class:`GradBuckets` collects the gradients of
consecutive units, in the order their post-backward hooks run (the same on
every rank: it is autograd's order over the same graph), and reduces each
group of them at once when its bytes reach a cap:

* NO_SHARD: the gradients are copied one after another into one buffer and
  all-reduced together.
* sharded strategies: the buffer is a ``(world_size, total_shard_numel)``
  matrix; unit ``i``'s padded gradient, viewed as ``(world_size, shard_i)``,
  fills the columns ``[off_i, off_i + shard_i)``.  Row ``r`` is then rank
  ``r``'s shard of every unit, one after another, so one reduce-scatter of
  the whole buffer leaves each rank its own shard of each unit (the layout of
  FSDP2's ``foreach_reduce``).

Every element goes through the same casts, divisions and sum as in
:func:`fsdp_wrap.comm.reduce.reduce_default`, so the results are bit-identical
to per-unit reduction.

[Note: when reduced gradients appear]
A bucket's collective is issued asynchronously once it is full.  A sharded
bucket is waited for when the next bucket is issued, so at most one is in
flight (its buffers are extra memory); NO_SHARD buckets, whose buffers become
the reduced gradients the step keeps anyway, all stay in flight until the
end of backward (the root's final callback calls :meth:`GradBuckets.finish`
before anything else) unless a sharded bucket comes after them.  Until then
the units in it have
``flat_param.grad is None``; every unit's reduced gradient is installed
before ``backward()`` returns.

Units that are reduced on their own, exactly as without buckets: those with
a communication hook (torch's protocol calls it once per unit), the hybrid
strategies (a replicate-group all-reduce follows each reduce-scatter), world
size 1, and every unit when the cap is 0.  A unit whose gradient alone
reaches the cap, and a bucket that holds one unit, are reduced as without
buckets too (synchronously, and in place when no padding is needed: no
copy into a bucket buffer, so large units cost no extra memory).  These
decisions are :func:`fsdp_wrap.comm.schedule.place_gradient` and
:func:`~fsdp_wrap.comm.schedule.issue_bucket`, over a description of each
gradient (:class:`~fsdp_wrap.comm.schedule.GradItem`): the rule the planner
replays too.

[Note: the reduction stream]
On CUDA every reduction that communicates (bucketed or alone, or through a
communication hook) runs on a stream of its own, one per device, as torch's
FSDP1 runs its post-backward work: so the next units' backward kernels,
issued on the compute stream meanwhile, are not queued behind the
reduce-scatters, casts and copies of the units before them.  A reduction
that is only casts and copies (world size 1, no hook) stays on the compute
stream: measured on an H100, switching streams cost more host time per unit
than the overlap of a cast gained (docs/performance/gpu.rst).  The order of
events:

* the reduction stream waits for the compute stream when a unit's gradient
  is handed over (the gradient, and everything the step wrote before, is
  complete there first);
* the handed-over gradient was allocated on the compute stream: it is
  marked used by the reduction stream (``record_stream``), so the caching
  allocator does not give its memory to a compute kernel until the reduction
  has read it;
* the compute stream waits for the reduction stream before anything reads a
  reduced gradient: in :meth:`GradBuckets.finish` (the end of backward, and
  wherever buckets are flushed) and right after a unit reduced ``alone``
  (an optimizer steps in backward on its gradient).

A waiting collective (``work.wait()``) then makes the reduction stream wait,
not the compute stream, and with NCCL not the host either.  On the CPU there
is one stream and nothing changes.
"""

from __future__ import annotations

import collections
import contextlib
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.comm.labels as L
import fsdp_wrap.comm.reduce as R
import fsdp_wrap.comm.schedule as S


class UnitGrads(Protocol):
    """What a bucket reads and calls on a unit's gradient part
    (``handle.grads``, a ``fsdp_wrap.handle.grads.FlatGrads``; the layer above)."""

    reduce_spec: R.ReduceSpec
    flat_param: torch.nn.Parameter
    unit_name: str  # its unit's clean FQN (profiler labels)

    @property
    def can_bucket_reduction(self) -> bool: ...
    @property
    def reduction_communicates(self) -> bool: ...
    @property
    def accumulating(self) -> bool: ...
    def reduce_gradient(self, sync: bool) -> None: ...
    def reduce_taken(self, grad: torch.Tensor) -> None: ...
    def take_grad_for_reduction(self, sync: bool) -> torch.Tensor | None: ...
    def install_reduced_grad(self, reduced: torch.Tensor, release_input: bool = False) -> None: ...

__all__ = [
    "BUCKET_CAP_ENV",
    "DEFAULT_BUCKET_CAP_MB",
    "GradBuckets",
    "resolve_bucket_cap_mb",
    "resolve_mb",
]

DEFAULT_BUCKET_CAP_MB = 1.0
BUCKET_CAP_ENV = "FSDP_WRAP_BUCKET_CAP_MB"


def resolve_bucket_cap_mb(bucket_cap_mb: float | None) -> float:
    """The constructor's value, else ``$FSDP_WRAP_BUCKET_CAP_MB``, else the default.

    The environment variable configures code that builds FSDP with torch's
    arguments only (Accelerate, Lightning).
    """
    return resolve_mb(bucket_cap_mb, "bucket_cap_mb", BUCKET_CAP_ENV, DEFAULT_BUCKET_CAP_MB)


def resolve_mb(value: float | None, name: str, env_var: str, default: float) -> float:
    """A size in MiB from a keyword (wins), an environment variable, or ``default``;
    ``ValueError`` (naming both ways to set it) unless a number >= 0."""
    rank = f"[rank {dist.get_rank()}] " if dist.is_initialized() else ""
    if value is None:
        env = os.environ.get(env_var, "").strip()
        if not env:
            return default
        try:
            value = float(env)
        except ValueError:
            raise ValueError(
                f"{rank}{env_var} must be a number of MiB (0 turns this off) but got {env!r}"
            ) from None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{rank}{name} must be a number of MiB >= 0 but got {value!r}") from None
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"{rank}{name} must be >= 0 (0 turns this off) but got {value}")
    return value


@dataclass
class _Bucket:
    """Gradients waiting to be reduced together; ``shape`` is what the rule
    (:mod:`fsdp_wrap.comm.schedule`) knows of them."""

    shape: S.OpenBucket = field(default_factory=S.OpenBucket)
    units: list[UnitGrads] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)


def _describe(unit: UnitGrads, bucketable: bool) -> S.GradItem:
    """What the bucketing rule reads of ``unit``'s gradient (on ``flat_param``)."""
    spec = unit.reduce_spec
    grad = unit.flat_param.grad
    if grad is None or not bucketable:
        return S.GradItem(0, False, spec.sharded, None)
    numel = spec.padded_numel if spec.sharded else grad.numel()
    key = (spec.sharded, spec.reduce_dtype, grad.device, id(spec.group), spec.world_size,
           spec.divide, spec.wire)
    return S.GradItem(numel * spec.reduce_dtype.itemsize, True, spec.sharded, key)


@dataclass
class _InFlight:
    """One issued bucket: its collective and where each unit's result lies."""

    work: C.Work | C.PendingWork | None
    units: list[UnitGrads]
    results: list[torch.Tensor]  # views of ``output``, one per unit
    output: torch.Tensor
    keep_alive: torch.Tensor  # the collective's input, until it completes
    post: float


class GradBuckets:
    """The root's gradient buckets for one backward at a time.

    :meth:`reduce` is called by each unit's post-backward hook; :meth:`finish`
    by the end-of-backward callback.  Postcondition of :meth:`finish`: no
    bucket is open or in flight and every unit's reduced gradient is on its
    ``flat_param.grad``.
    """

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._open = _Bucket()
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        # CUDA: the reduction stream of each device, and those used since the
        # compute stream last waited for them (see [Note: the reduction stream]).
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._unjoined: set[torch.device] = set()

    def reduce(self, unit: UnitGrads, sync: bool, alone: bool = False) -> None:
        """Reduce ``unit``'s gradient now or put it into the open bucket.

        ``alone``: reduce it now, on its own (its reduced gradient is on
        ``flat_param.grad`` on return: an optimizer steps in backward).
        """
        grad = unit.flat_param.grad
        if (not sync or grad is None or grad.device.type != "cuda"
                or not unit.reduction_communicates):
            self._reduce(unit, sync, alone)
            return
        device = grad.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        compute = torch.cuda.current_stream(device)
        stream.wait_stream(compute)
        grad.record_stream(stream)
        self._unjoined.add(device)
        with torch.cuda.stream(stream):
            self._reduce(unit, sync, alone)
        if alone:
            self._join()

    def _join(self) -> None:
        """Make each compute stream wait for its reduction stream's work so far."""
        for device in self._unjoined:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])
        self._unjoined.clear()

    def _reduce(self, unit: UnitGrads, sync: bool, alone: bool) -> None:
        if not sync:
            unit.reduce_gradient(sync)  # (no_sync: kept on flat_param, nothing reduced)
            return
        bucketable = not alone and unit.can_bucket_reduction
        if bucketable:
            if unit in self._open.units or any(unit in f.units for f in self._in_flight):
                # A second post-backward of one unit in one backward: finish the
                # first reduction before taking the new gradient, as without buckets.
                self.finish()
            if unit.flat_param.grad is None:
                return
        placed = S.place_gradient(self._open.shape, _describe(unit, bucketable), self.cap_bytes)
        if placed.issue_open:
            # (reductions keep the post-backward order, the same on every rank)
            self._issue()
        if not placed.joins:
            # Alone, exactly as without buckets (in place where the gradient
            # needs no padding: no copy into a bucket, so large units cost no
            # extra memory).
            if L.profiler_enabled():
                with L.span(L.POST_BACKWARD_REDUCE, L.names((unit.unit_name,))):
                    unit.reduce_gradient(sync)
                return
            unit.reduce_gradient(sync)
            return
        grad = unit.take_grad_for_reduction(sync)
        if grad is None:  # (checked above; take_grad never returns None then)
            return
        self._open.shape = placed.open
        self._open.units.append(unit)
        self._open.grads.append(grad)
        if placed.issue_full:
            self._issue()

    def finish(self, wait_partial: bool = True) -> None:
        """Reduce the open bucket and install every reduced gradient.

        ``wait_partial=False`` (``set_is_last_backward(False)``): buckets whose
        units all add to sharded partial sums (``unit.accumulating``: nothing
        of theirs reaches ``.grad``) may stay in flight, to be finished by the
        next call.
        """
        with self._on_reduction_stream():
            self._issue()
            while self._in_flight:
                if not wait_partial and all(u.accumulating for f in self._in_flight
                                            for u in f.units):
                    break
                self._wait()
        self._join()

    def _on_reduction_stream(self) -> contextlib.AbstractContextManager[object]:
        """The reduction stream where reductions were issued before (a model
        lives on one device), else the current stream (CPU)."""
        if not self._streams or self.idle:
            return contextlib.nullcontext()
        device = next(iter(self._streams))
        self._unjoined.add(device)
        return torch.cuda.stream(self._streams[device])

    @property
    def idle(self) -> bool:
        return not self._open.units and not self._in_flight

    # ----------------------------------------------------------------- steps

    def _issue(self) -> None:
        """Copy the open bucket (if any) into one buffer and start its collective.

        A bucket of one unit is reduced as without buckets (no copy).
        """
        bucket, self._open = self._open, _Bucket()
        if not bucket.units:
            return
        spec = bucket.units[0].reduce_spec
        issue = S.issue_bucket(bucket.shape)
        if issue.wait_in_flight:
            # (at most one sharded bucket in flight; NO_SHARD buffers, which
            # become the reduced gradients, are not held back: as DDP's)
            while self._in_flight:
                self._wait()
        if issue.alone:
            _reduce_alone(bucket.units[0], bucket.grads[0])
            return
        pre, post = spec.divide
        device = bucket.grads[0].device
        if spec.sharded:
            widths = [h.reduce_spec.shard_numel for h in bucket.units]
            buffer = torch.empty((spec.world_size, sum(widths)), dtype=spec.reduce_dtype,
                                 device=device)
            col = 0
            for grad, width in zip(bucket.grads, widths):
                _copy_padded_columns(buffer[:, col : col + width], grad)
                col += width
            flat_in = buffer.view(-1)
            del buffer  # flat_in alone holds the bucket: freed once reduced (on gloo)
        else:
            widths = [g.numel() for g in bucket.grads]
            flat_in = torch.empty(sum(widths), dtype=spec.reduce_dtype, device=device)
            for dst, grad in zip(flat_in.split(widths), bucket.grads):
                dst.copy_(grad)
        bucket.grads.clear()  # the unsharded gradients can go now
        if pre > 1:
            flat_in.div_(pre)
        label = (L.span(L.POST_BACKWARD_REDUCE, L.names(u.unit_name for u in bucket.units))
                 if L.profiler_enabled() else contextlib.nullcontext())
        with label:
            if spec.sharded:
                # (a coded wire's blocks start at each unit's columns: ``widths``)
                output = flat_in.new_empty(sum(widths),
                                           dtype=spec.wire.sum_dtype(flat_in.dtype))
                work = spec.wire.reduce_scatter(output, flat_in, spec.group, segments=widths,
                                                async_op=True, input_is_scratch=True)
            else:
                output = flat_in
                work = C.all_reduce(output, spec.group, async_op=True)
        self._in_flight.append(_InFlight(work, bucket.units, list(output.split(widths)), output,
                                         flat_in, post))

    def _wait(self) -> None:
        if not self._in_flight:
            return
        flight = self._in_flight.popleft()
        if flight.work is not None:
            if L.profiler_enabled():
                with L.span(L.POST_BACKWARD_RS_WAIT, L.names(u.unit_name for u in flight.units)):
                    flight.work.wait()
            else:
                flight.work.wait()
        if flight.post > 1:
            flight.output.div_(flight.post)
        for unit, result in zip(flight.units, flight.results):
            unit.install_reduced_grad(result)
        # Where every unit took a cast copy, nothing sees the bucket any more:
        # free it now rather than when gloo's worker thread lets go of it (a
        # moment later, racing the next ops of backward).  Where a result became
        # a gradient as it is, the storage is shared and stays.
        flight.results.clear()
        C.release(flight.output)


def _reduce_alone(unit: UnitGrads, grad: torch.Tensor) -> None:
    """``unit``'s reduction on its own, as ``reduce_gradient`` does it."""
    if L.profiler_enabled():
        with L.span(L.POST_BACKWARD_REDUCE, L.names((unit.unit_name,))):
            unit.reduce_taken(grad)
        return
    unit.reduce_taken(grad)


def _copy_padded_columns(dst: torch.Tensor, grad: torch.Tensor) -> None:
    """Write ``grad``, right-padded with zeros to ``dst.numel()``, into ``dst``
    (a ``(world_size, width)`` column block of the bucket) in row-major order:
    row ``r`` receives the ``r``-th shard."""
    width = dst.shape[1]
    full_rows, rest = divmod(grad.numel(), width)
    dst[:full_rows].copy_(grad[: full_rows * width].reshape(full_rows, width))
    if full_rows < dst.shape[0]:
        if rest:
            dst[full_rows, :rest].copy_(grad[full_rows * width :])
            dst[full_rows, rest:].zero_()
        else:
            dst[full_rows].zero_()
        dst[full_rows + 1 :].zero_()

