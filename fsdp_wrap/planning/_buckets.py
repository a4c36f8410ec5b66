"""What gradient buckets add to the backward pass, unit by unit.

:class:`fsdp_wrap.comm.bucket.GradBuckets` holds the gradients of consecutive
units until their bytes reach the cap, then copies them into one buffer and
reduces it at once.  :class:`BucketModel` makes the same decisions on the
plan's flat parameters (one per unit unless the unit is split; "unit" below),
in backward order, with the same rule (:func:`fsdp_wrap.comm.schedule.place_gradient`
and :func:`~fsdp_wrap.comm.schedule.issue_bucket`, over a description of each
gradient built here from the plan's rows), and keeps the bytes they hold:

* **open**: the unsharded flat gradients waiting in the open bucket (compute
  dtype); they are not freed when their unit's backward ends, as they are
  without buckets;
* **in flight**: an issued bucket's buffer (the gradients in the reduce dtype,
  padded to a world-size multiple for sharded strategies) and, for sharded
  strategies, the reduce-scatter's output, until the next sharded bucket is
  issued; NO_SHARD buffers stay until the end of backward, as they *are* the
  reduced gradients;
* **at issue**: for a moment both the open gradients and the new buffer (the
  copy); then the buffer, the output and the collective's staging on gloo.

A unit reduced on its own (world size 1, hybrid strategies across more than
one replica, a gradient at or above the cap, a bucket of one unit, cap 0)
issues the open bucket first and then costs what it costs without buckets.
Sharded gradients of bucketed units count as "done" once their bucket is
waited for; NO_SHARD's in-flight buffers stand for them until the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fsdp_wrap.api import HYBRID_STRATEGIES
from fsdp_wrap.comm.schedule import GradItem, OpenBucket, issue_bucket, place_gradient
from fsdp_wrap.planning._units import FlatPlan


@dataclasses.dataclass
class _Open:
    shape: OpenBucket = OpenBucket()  # what the rule knows: key, reduce-dtype bytes, members
    units: list[FlatPlan] = dataclasses.field(default_factory=list)
    held: int = 0  # the unsharded gradients' bytes


class BucketModel:
    """The runtime's bucket decisions over the plan's units (see the module docstring).

    ``staging(u, nbytes)``: extra bytes the backend's collective holds while it
    reduces ``nbytes`` of ``u``'s kind.  ``alone(u)``: the bytes of ``u``'s
    reduction on its own (its flat gradient included).  ``done_bytes(u)``: the
    sharded gradient a unit keeps on the device once reduced.

    The walk sets :attr:`base` (bytes held outside the buckets at this point
    of backward: parameters in flight, gradients of units reduced alone) before
    each call; every moment the model passes through is noted in :attr:`peak`
    (``base`` + what the buckets hold) and :attr:`peak_with_grads` (that plus
    the sharded gradients handed back), and appended to :attr:`timeline` as
    ``(label, bytes with gradients)``.
    """

    def __init__(self, cap_bytes: int, replicate_size: int,
                 staging: Callable[[FlatPlan, int], int],
                 alone: Callable[[FlatPlan], int],
                 done_bytes: Callable[[FlatPlan], int]) -> None:
        self.cap = cap_bytes
        self.replicate_size = replicate_size
        self.staging = staging
        self.alone = alone
        self.done_bytes = done_bytes
        self.open = _Open()
        #: the buckets of two gradients or more, in the order they are issued
        self.issued: list[tuple[FlatPlan, ...]] = []
        self.in_flight: list[tuple[int, list[FlatPlan], bool]] = []  # (bytes, units, sharded)
        self.released = 0  # sharded gradients handed back (units reduced alone: the walk adds)
        self.base = 0
        self.peak = 0
        self.peak_with_grads = 0
        self.label = ""  # what the schedule is doing (the timeline's label for each moment)
        self.timeline: list[tuple[str, int]] = []

    @property
    def holding(self) -> int:
        """Bytes the buckets hold between units' backward passes."""
        return self.open.held + sum(b for b, _, _ in self.in_flight)

    def note(self, extra: int = 0) -> None:
        """A moment: the buckets' holdings plus ``extra`` transient bytes."""
        here = self.base + self.holding + extra
        self.peak = max(self.peak, here)
        self.peak_with_grads = max(self.peak_with_grads, here + self.released)
        self.timeline.append((self.label, here + self.released))

    def describe(self, u: FlatPlan) -> GradItem:
        """What the bucketing rule reads of ``u``'s gradient (as the runtime's
        ``FlatGrads.can_bucket_reduction`` and reduce spec say it)."""
        bucketable = u.trainable and u.layout.world_size > 1 and not (
            u.strategy in HYBRID_STRATEGIES and self.replicate_size > 1)
        return GradItem(self._nbytes(u), bucketable, u.sharded, (u.sharded, u.reduce_dtype))

    def reduce(self, u: FlatPlan, grad_bytes: int) -> None:
        """``u``'s unsharded gradient (``grad_bytes``) joins the buckets, or is
        reduced on its own after the open bucket is issued."""
        placed = place_gradient(self.open.shape, self.describe(u), self.cap)
        if not placed.joins:
            if placed.issue_open:
                self.issue()
            self.note(self.alone(u))
            self.released += self.done_bytes(u)
            return
        self.note(grad_bytes)
        if placed.issue_open:
            self.base += grad_bytes
            self.issue()
            self.base -= grad_bytes
        self.open.shape = placed.open
        self.open.units.append(u)
        self.open.held += grad_bytes
        if placed.issue_full:
            self.issue()

    def issue(self) -> None:
        """Start the open bucket's collective (the moments it passes through noted)."""
        bucket, self.open = self.open, _Open()
        if not bucket.units:
            return
        issue = issue_bucket(bucket.shape)
        sharded = bucket.shape.sharded
        if issue.wait_in_flight:
            self.base += bucket.held
            self.wait_all()
            self.base -= bucket.held
        if issue.alone:  # reduced as without buckets
            self.note(self.alone(bucket.units[0]))
            self.released += self.done_bytes(bucket.units[0])
            return
        self.issued.append(tuple(bucket.units))
        u0 = bucket.units[0]
        r = u0.reduce_dtype.itemsize
        if sharded:
            buffer = sum(u.layout.padded_numel for u in bucket.units) * r
            output = sum(u.layout.shard_numel for u in bucket.units) * r
        else:
            buffer, output = sum(u.layout.unpadded_numel for u in bucket.units) * r, 0
        # The copy holds the gradients and the buffer; the gradients go before
        # the output is allocated and the collective runs.
        self.note(bucket.held + buffer)
        self.note(buffer + output + self.staging(u0, buffer))
        self.in_flight.append((buffer + output, bucket.units, sharded))

    def wait_all(self) -> None:
        """Wait for every bucket in flight (the runtime does so before a sharded issue).

        While a bucket is waited for, its buffers live on beside the sharded
        gradients its units receive where the gradient dtype differs from the
        reduce dtype (a cast copy); views of the output otherwise.
        """
        while self.in_flight:
            nbytes, units, _ = self.in_flight[0]
            copies = sum(self.done_bytes(u) for u in units if u.grad_dtype != u.reduce_dtype)
            self.note(copies)
            self.in_flight.pop(0)
            self.released += sum(self.done_bytes(u) for u in units)

    def finish(self) -> None:
        """The end-of-backward callback: issue the open bucket, wait for all."""
        self.issue()
        self.wait_all()

    def _nbytes(self, u: FlatPlan) -> int:
        numel = u.layout.padded_numel if u.sharded else u.layout.unpadded_numel
        return numel * u.reduce_dtype.itemsize
