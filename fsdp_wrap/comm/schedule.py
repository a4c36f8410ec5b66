"""The scheduling rules of batched gathers and gradient buckets, once.

Which flat parameters one all-gather takes, whether a batch's members copy
their parts out one by one, which gradients share a bucket and when a bucket
is issued: each is decided here, by a pure function over a small description
of the flat parameters involved.  Two callers build those descriptions:

* the runtime, from its handles (:mod:`fsdp_wrap.comm.gather_batch`,
  :mod:`fsdp_wrap.comm.bucket`), which then acts on the decision;
* the planner, from its plan rows (``fsdp_wrap/planning/_batches.py``,
  ``fsdp_wrap/planning/_buckets.py``), which counts the bytes the decision
  holds.

So the plan replays what runs rather than a copy of it that may drift
(``tests/test_schedule.py`` feeds both the same models and compares the
batches and buckets they form).  Nothing here touches a tensor or a group.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

__all__ = [
    "GatherItem",
    "GradItem",
    "Issue",
    "OpenBucket",
    "Placement",
    "by_member_pays",
    "gather_batch",
    "issue_bucket",
    "place_gradient",
    "starts_batch",
]


# ------------------------------------------------------------ batched gathers


class GatherItem(NamedTuple):
    """One flat parameter as the gather batching sees it.

    ``nbytes``: its gathered compute copy (the bytes it adds to a batch);
    ``needs_gather``: sharded, and its compute copy neither there nor coming;
    ``batchable``: gathered synchronously (``limit_all_gathers`` on the CPU)
    and not computing in full precision (``FSDP_USE_FULL_PREC_IN_EVAL``, whose
    gather is not of the compute copy);
    ``key``: what the members of one batch share (process group, compute
    dtype, wire, device: one collective, one receive buffer).  Where
    ``needs_gather`` is False nothing else is read (the runtime leaves the
    other fields empty).

    (A NamedTuple: the runtime builds one per flat parameter it looks at, in
    every forward and backward.)
    """

    nbytes: int
    needs_gather: bool
    batchable: bool
    key: Hashable


def starts_batch(first: GatherItem, cap_bytes: int) -> bool:
    """Whether a batch may start at ``first``: a cap above 0, and ``first``
    batchable and in need of its gather (else it gathers on its own, or not
    at all)."""
    return cap_bytes > 0 and first.batchable and first.needs_gather


def gather_batch(first: GatherItem, followers: Iterable[GatherItem], cap_bytes: int) -> int:
    """How many flat parameters one all-gather takes: ``first`` and the run of
    ``followers`` (the ones gathered after it, in order) that joins it.

    1 means ``first`` alone (no batch).  A batch starts only where
    :func:`starts_batch` says so; followers join while
    each needs its gather, is batchable, shares ``first``'s key and keeps the
    batch's bytes within the cap (``first`` alone may be larger: then nothing
    joins).  ``followers`` is read lazily, up to the first that does not join.
    """
    if not starts_batch(first, cap_bytes):
        return 1
    count, total = 1, first.nbytes
    for nxt in followers:
        if (not nxt.needs_gather or not nxt.batchable or nxt.key != first.key
                or total + nxt.nbytes > cap_bytes):
            break
        count += 1
        total += nxt.nbytes
    return count


def by_member_pays(sizes: Sequence[int]) -> bool:
    """Whether copying a batch out member by member, each at its turn, holds
    less at its worst than copying every member out at the first one's
    (``sizes``: the members' gathered bytes, or anything proportional).

    At once, the copy-out holds the receive buffer beside every member's copy:
    twice the batch.  Member by member, the receive buffer stays until the
    last turn, and a member's turn holds it beside that member's copy and the
    gradient its backward makes (about its size again): the batch plus twice
    the largest member.  Less, then, only where the largest member is under
    half the batch (three members or more of similar size; two equal members
    would hold as much at the peak and more after it)."""
    return 2 * max(sizes) < sum(sizes)


# ----------------------------------------------------------- gradient buckets


class GradItem(NamedTuple):
    """One flat parameter's gradient as the bucketing sees it.

    ``nbytes``: what it takes in a bucket's buffer (reduce dtype; padded to a
    world-size multiple where sharded); ``bucketable``: its reduction may
    share a collective (no communication hook, not a hybrid strategy's
    all-reduce across replicas, world size above 1, not an optimizer stepping
    in backward on it); ``sharded``: reduce-scattered (else all-reduced);
    ``key``: what the gradients of one bucket share (``sharded`` and the
    reduce dtype among it).
    """

    nbytes: int
    bucketable: bool
    sharded: bool
    key: Hashable


class OpenBucket(NamedTuple):
    """The open bucket: its gradients' key, bytes and number (empty: 0 members)."""

    key: Hashable = None
    nbytes: int = 0
    members: int = 0
    sharded: bool = False


class Placement(NamedTuple):
    """Where one gradient goes, in the order the steps happen.

    ``issue_open``: the open bucket is issued first; ``joins``: the gradient
    joins the (then) open bucket, else it is reduced on its own, exactly as
    without buckets; ``open``: the open bucket once it joined; ``issue_full``:
    that bucket reached the cap and is issued at once.
    """

    issue_open: bool
    joins: bool
    open: OpenBucket
    issue_full: bool


def place_gradient(open_bucket: OpenBucket, item: GradItem, cap_bytes: int) -> Placement:
    """Where ``item``'s gradient goes, the open bucket being ``open_bucket``.

    Alone (after the open bucket is issued: reductions keep the order of the
    post-backward hooks on every rank) where the cap is 0, the gradient is not
    bucketable, or it alone reaches the cap.  Otherwise it joins; a bucket of
    another key, or one it would take past the cap, is issued first; a bucket
    that reaches the cap with it is issued at once.
    """
    if cap_bytes <= 0 or not item.bucketable or item.nbytes >= cap_bytes:
        return Placement(open_bucket.members > 0, False, OpenBucket(), False)
    issue_open = open_bucket.members > 0 and (
        item.key != open_bucket.key or open_bucket.nbytes + item.nbytes > cap_bytes)
    base = OpenBucket() if issue_open else open_bucket
    joined = OpenBucket(item.key, base.nbytes + item.nbytes, base.members + 1, item.sharded)
    return Placement(issue_open, True, joined, joined.nbytes >= cap_bytes)


class Issue(NamedTuple):
    """How an issued bucket runs: ``wait_in_flight``: every bucket still in
    flight is waited for first (a sharded bucket's buffers are memory the step
    would not otherwise hold: at most one in flight; a NO_SHARD bucket's
    buffer *is* its units' reduced gradients, so NO_SHARD buckets all stay in
    flight until the end of backward); ``alone``: a bucket of one gradient is
    reduced as without buckets (no copy into a bucket buffer)."""

    wait_in_flight: bool
    alone: bool


def issue_bucket(bucket: OpenBucket) -> Issue:
    """How issuing ``bucket`` (not empty) runs."""
    return Issue(bucket.sharded, bucket.members == 1)
