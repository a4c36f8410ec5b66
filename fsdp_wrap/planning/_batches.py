"""What batched all-gathers hold ahead of their turn, unit by unit.

The runtime (``fsdp_wrap/comm/gather_batch.py``) lets a unit whose gather is
needed and smaller than ``all_gather_batch_mb`` gather the units that come next
in the same collective, as long as each still needs a gather and the batch
stays within the cap.  Those followers then hold their unsharded copy until
their own turn, and at the moment the batch is copied out its receive buffer
lives beside every member's copy and the shards each member sends (cast
copies in a low compute dtype).  This replays those decisions over one
order of units (forward: the units in order; backward: reversed, without the
units kept gathered since forward), as the runtime makes them:

* a batch starts at a unit that needs a gather and is not already gathered;
  followers join while each needs a gather, shares the first one's compute
  dtype and keeps the batch's bytes within the cap (the first unit alone may
  be larger: then nothing joins);
* a prefetch (``forward_prefetch``; ``BACKWARD_PRE`` / ``BACKWARD_POST``) of
  the next unit starts a batch there in the same way, in flight while the
  current unit computes; without ``forward_prefetch`` the forward still starts
  the next *batch* (not a unit alone) once the current one's last unit runs.

In backward every member of a batch whose largest member is under half of it
(``by_member_pays``) copies its part out at its own turn, so the receive
buffer stays until the last member's turn and a member's copy is made only
then (forward, and backward's other batches, copy every member out at once).

Only where gathers are synchronous (gloo with ``limit_all_gathers=True``, the
runtime's CPU path); elsewhere every unit gathers on its own and nothing is
held ahead beyond the prefetch the schedule already counts.  Units are
batched whole here, where the runtime chains their flat parameters one by
one (a unit of several flat parameters may be split between two batches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from fsdp_wrap.comm.gather_batch import by_member_pays


@dataclasses.dataclass(frozen=True)
class BatchedAhead:
    """Per position of the order: bytes gathered ahead of the unit running there
    (before and after that position's prefetch was issued), and the peak a
    batch's gather or copy-out adds there (receive buffer, members' copies, the
    cast shards they sent)."""

    before_prefetch: tuple[int, ...]
    after_prefetch: tuple[int, ...]
    batch_copy: tuple[int, ...]


def batched_ahead(
    order: Sequence[int],
    gathered: Sequence[int],
    needs: Sequence[bool],
    keys: Sequence[Hashable],
    cap_bytes: int,
    prefetch: bool,
    sources: Sequence[int] | None = None,
    prefetch_alone: bool = True,
    each_at_its_turn: bool = False,
) -> BatchedAhead:
    """Replay the batching over ``order`` (unit indices).

    ``gathered[i]``: unit ``i``'s unsharded bytes in the compute dtype;
    ``needs[i]``: whether it gathers at its turn (sharded, not kept);
    ``keys[i]``: what units of one batch must share (the compute dtype);
    ``sources[i]``: the copy of its shard a gather sends, where one is made
    (cast to the compute dtype or moved; 0 where the shard itself is sent);
    ``prefetch_alone``: whether a prefetch gathers the next unit also where it
    makes no batch (a real prefetch) or only starts batches (the forward's
    batch look-ahead without ``forward_prefetch``);
    ``each_at_its_turn``: members copy their part out at their own turn
    (backward), not all at once, in batches where the runtime does so.
    """
    n = len(order)
    pending: dict[int, int] = {}  # unit -> bytes gathered ahead of its turn
    # each_at_its_turn: batch of each member not yet at its turn, and the
    # receive buffer's bytes per batch (held until its last member's turn)
    batch_of: dict[int, int] = {}
    rows: dict[int, int] = {}
    before, after, copy = [0] * n, [0] * n, [0] * n

    src = sources if sources is not None else [0] * len(gathered)

    def start_batch(k: int) -> tuple[int, int]:
        """Gather from position ``k`` on: the batch's bytes and its members' sent
        shards if it has followers, else ``(0, 0)``."""
        first = order[k]
        total, members = gathered[first], [first]
        for j in range(k + 1, n):
            nxt = order[j]
            if (not needs[nxt] or nxt in pending or keys[nxt] != keys[first]
                    or total + gathered[nxt] > cap_bytes):
                break
            members.append(nxt)
            total += gathered[nxt]
        if len(members) == 1:
            return 0, 0
        by_member = each_at_its_turn and by_member_pays([gathered[m] for m in members])
        for m in members:
            pending[m] = 0 if by_member else gathered[m]
            if by_member:
                batch_of[m] = k
        if by_member:
            rows[k] = total
        return total, sum(src[m] for m in members)

    def ahead() -> int:
        return sum(pending.values()) + sum(rows[b] for b in set(batch_of.values()))

    if cap_bytes <= 0:
        return BatchedAhead((0,) * n, (0,) * n, (0,) * n)
    for k in range(n):
        unit = order[k]
        if needs[unit] and unit not in pending:
            # (gathered and copied out at once: receive buffer, copies, sent
            # shards; or, member by member, the receive buffer and sent shards)
            total, sent = start_batch(k)
            if total:
                copy[k] = max(copy[k], total + sent if unit in batch_of else 2 * total + sent)
        if unit in batch_of:
            # (its copy is made beside the receive buffer, then the last
            # member's turn frees that)
            copy[k] = max(copy[k], rows[batch_of[unit]] + gathered[unit])
            batch_of.pop(unit)
        pending.pop(unit, None)
        before[k] = ahead()
        nxt = order[k + 1] if prefetch and k + 1 < n else None
        if nxt is not None and needs[nxt] and nxt not in pending:
            total, sent = start_batch(k + 1)
            if total:
                # In flight while this unit computes (issued beside its copy and
                # the sent shards), copied out when the next unit waits for it.
                copy[k] = max(copy[k], gathered[unit] + total + sent)
                if nxt not in batch_of:
                    copy[k + 1] = 2 * total
            if prefetch_alone:
                pending.setdefault(nxt, gathered[nxt])  # (alone: gathered all the same)
        after[k] = ahead()
    return BatchedAhead(tuple(before), tuple(after), tuple(copy))
