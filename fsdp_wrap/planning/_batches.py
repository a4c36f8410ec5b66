"""What batched all-gathers hold ahead of their turn, unit by unit.

The runtime (``fsdp_wrap/comm/gather_batch.py``) lets a flat parameter whose
gather is needed and smaller than ``all_gather_batch_mb`` gather the flat
parameters that come next in the same collective, as long as each still needs
a gather and the batch stays within the cap.  Those followers then hold their
unsharded copy until their own turn, and at the moment the batch is copied
out its receive buffer lives beside every member's copy and the shards each
member sends (cast copies in a low compute dtype).  This walks one order of
units (forward: the units in order; backward: reversed, without the units
kept gathered since forward) and makes the runtime's decisions with the
runtime's own rule (:func:`fsdp_wrap.comm.schedule.gather_batch`, over a
:class:`~fsdp_wrap.comm.schedule.GatherItem` per flat parameter built here
from the plan's rows), at the runtime's granularity:

* flat parameters are chained one by one, as the runtime chains its handles:
  a unit's own in order (backward: last first), then the next unit's; a unit
  of several flat parameters may be split between a batch and gathers of its
  own, and a unit with none is not in the chain at all;
* a batch starts only at a unit's first flat parameter in that order, where
  it needs a gather and is not already gathered (the others of the unit that
  no batch took gather alone at its turn);
* a prefetch (``forward_prefetch``; ``BACKWARD_PRE`` / ``BACKWARD_POST``) of
  the next unit starts a batch there in the same way, in flight while the
  current unit computes, and gathers the next unit's other flat parameters
  alone; without ``forward_prefetch`` the forward still starts the next
  *batch* (not a flat parameter alone) once the current unit's last runs.

In backward every member of a batch whose largest member is under half of it
(:func:`~fsdp_wrap.comm.schedule.by_member_pays`) copies its part out at its
own turn, so the receive buffer stays until the last member's turn and a
member's copy is made only then (forward, and backward's other batches, copy
every member out at once).

Only where gathers are synchronous (gloo with ``limit_all_gathers=True``, the
runtime's CPU path); elsewhere every unit gathers on its own and nothing is
held ahead beyond the prefetch the schedule already counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from fsdp_wrap.comm.schedule import GatherItem, by_member_pays, gather_batch


@dataclasses.dataclass(frozen=True)
class BatchedAhead:
    """Per position of the order: bytes gathered ahead of the unit running there
    (before and after that position's prefetch was issued), and the peak a
    batch's gather or copy-out adds there (receive buffer, members' copies, the
    cast shards they sent).  ``batches``: the flat parameters of each batch
    formed, in the order they were formed."""

    before_prefetch: tuple[int, ...]
    after_prefetch: tuple[int, ...]
    batch_copy: tuple[int, ...]
    batches: tuple[tuple[int, ...], ...] = ()


def batched_ahead(
    order: Sequence[int | Sequence[int]],
    gathered: Sequence[int],
    needs: Sequence[bool],
    keys: Sequence[Hashable],
    cap_bytes: int,
    prefetch: bool,
    sources: Sequence[int] | None = None,
    prefetch_alone: bool = True,
    each_at_its_turn: bool = False,
) -> BatchedAhead:
    """Replay the batching over ``order``: per position, the flat parameters
    (indices) of the unit that runs there, in the order the runtime chains
    them (an int: a unit of that one flat parameter).

    Per flat parameter ``i``: ``gathered[i]``: its unsharded bytes in the
    compute dtype; ``needs[i]``: whether it gathers at its turn (sharded, not
    kept); ``keys[i]``: what flat parameters of one batch must share (the
    compute dtype); ``sources[i]``: the copy of its shard a gather sends, where
    one is made (cast to the compute dtype or moved; 0 where the shard itself
    is sent).  ``prefetch_alone``: whether a prefetch gathers the next unit
    also where it makes no batch (a real prefetch) or only starts batches (the
    forward's batch look-ahead without ``forward_prefetch``);
    ``each_at_its_turn``: members copy their part out at their own turn
    (backward), not all at once, in batches where the runtime does so.
    """
    units = [[p] if isinstance(p, int) else list(p) for p in order]
    walk = _Walk(units, gathered, needs, keys, cap_bytes,
                 sources if sources is not None else [0] * len(gathered), each_at_its_turn)
    n = len(units)
    if cap_bytes <= 0:
        return BatchedAhead((0,) * n, (0,) * n, (0,) * n)
    # (the runtime looks ahead to the next unit that has flat parameters)
    ahead_of = [next((j for j in range(k + 1, n) if units[j]), None) for k in range(n)]
    before, after = [0] * n, [0] * n
    for k in range(n):
        if not units[k]:  # (no flat parameter: no hook of it gathers anything)
            before[k] = after[k] = walk.ahead()
            continue
        walk.turn(k)
        before[k] = walk.ahead()
        nxt = ahead_of[k] if prefetch else None
        if nxt is not None:
            walk.prefetch(k, nxt, prefetch_alone)
        after[k] = walk.ahead()
    return BatchedAhead(tuple(before), tuple(after), tuple(walk.copy), tuple(walk.formed))


class _Walk:
    """The state :func:`batched_ahead` carries from position to position."""

    def __init__(self, units: list[list[int]], gathered: Sequence[int], needs: Sequence[bool],
                 keys: Sequence[Hashable], cap_bytes: int, sources: Sequence[int],
                 each_at_its_turn: bool) -> None:
        self.units, self.g, self.needs, self.keys = units, gathered, needs, keys
        self.cap, self.src, self.each_at_its_turn = cap_bytes, sources, each_at_its_turn
        self.chain = [f for u in units for f in u]  # every flat parameter, in chain order
        self.start = []  # position -> index in the chain of its first flat parameter
        i = 0
        for u in units:
            self.start.append(i)
            i += len(u)
        self.pending: dict[int, int] = {}  # flat -> bytes gathered ahead of its turn
        # each_at_its_turn: the batch of each member not yet at its turn, and the
        # receive buffer's bytes per batch (held until its last member's turn)
        self.batch_of: dict[int, int] = {}
        self.rows: dict[int, int] = {}
        self.copy = [0] * len(units)
        self.formed: list[tuple[int, ...]] = []

    def ahead(self) -> int:
        return (sum(self.pending.values())
                + sum(self.rows[b] for b in set(self.batch_of.values())))

    def _item(self, f: int) -> GatherItem:
        return GatherItem(self.g[f], self.needs[f] and f not in self.pending, True, self.keys[f])

    def _wants_batch(self, k: int) -> bool:
        first = self.units[k][0]
        return self.needs[first] and first not in self.pending

    def start_batch(self, k: int) -> tuple[int, int]:
        """Gather from unit ``k``'s first flat parameter on: the batch's bytes and
        its members' sent shards if it has followers, else ``(0, 0)``."""
        c = self.start[k]
        count = gather_batch(self._item(self.chain[c]),
                             (self._item(f) for f in self.chain[c + 1:]), self.cap)
        if count == 1:
            return 0, 0
        members = self.chain[c:c + count]
        self.formed.append(tuple(members))
        sizes = [self.g[m] for m in members]
        by_member = self.each_at_its_turn and by_member_pays(sizes)
        for m in members:
            self.pending[m] = 0 if by_member else self.g[m]
            if by_member:
                self.batch_of[m] = c
        if by_member:
            self.rows[c] = sum(sizes)
        return sum(sizes), sum(self.src[m] for m in members)

    def turn(self, k: int) -> None:
        """Unit ``k`` runs: a batch may start at it; its flat parameters' parts
        of a batch are copied out (or were), the rest gather alone."""
        copy = self.copy
        if self._wants_batch(k):
            # (gathered and copied out at once: receive buffer, copies, sent
            # shards; or, member by member, the receive buffer and sent shards)
            total, sent = self.start_batch(k)
            if total:
                first = self.units[k][0]
                copy[k] = max(copy[k], total + sent if first in self.batch_of
                              else 2 * total + sent)
        own = 0
        for f in self.units[k]:
            if f in self.batch_of:
                # (its copy is made beside the receive buffer and the unit's
                # copies before it; the last member's turn frees the buffer)
                own += self.g[f]
                copy[k] = max(copy[k], self.rows[self.batch_of.pop(f)] + own)
            self.pending.pop(f, None)

    def prefetch(self, k: int, nxt: int, alone: bool) -> None:
        """Unit ``k``'s prefetch of unit ``nxt`` (a batch in flight while ``k``
        computes; with ``alone``, the flat parameters no batch took too)."""
        if self._wants_batch(nxt):
            total, sent = self.start_batch(nxt)
            if total:
                # In flight while this unit computes (issued beside its copies and
                # the sent shards), copied out when the next unit waits for it.
                own = sum(self.g[f] for f in self.units[k])
                self.copy[k] = max(self.copy[k], own + total + sent)
                if self.units[nxt][0] not in self.batch_of:
                    self.copy[nxt] = max(self.copy[nxt], 2 * total)
        if alone:
            for f in self.units[nxt]:
                if self.needs[f]:
                    self.pending.setdefault(f, self.g[f])  # (alone: gathered all the same)
