"""The planner's replay of batched all-gathers (``fsdp_wrap/planning/_batches.py``).

The replay must make the runtime's decisions (``fsdp_wrap/comm/gather_batch.py``):
a batch starts where a unit needs a gather it does not already have, followers
join while each needs a gather, shares the first one's dtype and fits the cap,
and a prefetch starts a batch at the next unit.  Then ``fsdp_wrap.plan`` counts
what those batches hold ahead only where the runtime batches (CPU, synchronous
gathers).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_wrap as fw
from fsdp_wrap.comm.gather_batch import ALL_GATHER_BATCH_ENV, by_member_pays
from fsdp_wrap.planning._batches import batched_ahead
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests.models import Block

ORDER = list(range(6))
SIZES = [1, 1, 1, 1, 3, 1]


def test_batches_without_prefetch() -> None:
    b = batched_ahead(ORDER, SIZES, [True] * 6, [0] * 6, cap_bytes=2, prefetch=False)
    # Batches [0, 1] and [2, 3]; unit 4 is larger than what is left of a cap of 2
    # (alone), and so is unit 5 after it (nothing follows).
    assert b.before_prefetch == b.after_prefetch == (1, 0, 1, 0, 0, 0)
    # The copy out of a batch: its receive buffer and every member's copy,
    assert b.batch_copy == (4, 0, 4, 0, 0, 0)
    # and the cast shards the members sent, where a gather sends a copy.
    cast = batched_ahead(ORDER, SIZES, [True] * 6, [0] * 6, cap_bytes=2, prefetch=False,
                         sources=[1] * 6)
    assert cast.batch_copy == (6, 0, 6, 0, 0, 0) and cast.before_prefetch == b.before_prefetch


def test_batches_with_prefetch() -> None:
    b = batched_ahead(ORDER, SIZES, [True] * 6, [0] * 6, cap_bytes=2, prefetch=True)
    # 0 gathers [0, 1]; 1's prefetch gathers [2, 3]; 2 and 3 were gathered
    # already; 3's prefetch gathers 4 alone, 4's gathers 5 alone.
    assert b.before_prefetch == (1, 0, 1, 0, 0, 0)
    assert b.after_prefetch == (1, 2, 1, 3, 1, 0)
    # 1's prefetch issues [2, 3] beside 1's own copy (its receive buffer); 2 copies
    # it out when it waits for it (receive buffer and both members' copies).
    assert b.batch_copy == (4, 1 + 2, 4, 0, 0, 0)
    # The forward without forward_prefetch starts only batches ahead, never a
    # unit alone: 4 and 5 wait for their turn.
    fwd = batched_ahead(ORDER, SIZES, [True] * 6, [0] * 6, cap_bytes=2, prefetch=True,
                        prefetch_alone=False)
    assert fwd.after_prefetch == (1, 2, 1, 0, 0, 0) and fwd.batch_copy == b.batch_copy


def test_backward_batches_copy_each_member_out_at_its_turn() -> None:
    # Backward, batches of three units of 1 ([0, 1, 2], [3, 4, 5] at a cap of 3):
    # the receive buffer (3) stays until a batch's last member has copied its part
    # out; each member's copy is made at its own turn, beside it.
    even = [1] * 6
    alone = batched_ahead(ORDER, even, [True] * 6, [0] * 6, cap_bytes=3, prefetch=False,
                          each_at_its_turn=True)
    assert alone.before_prefetch == alone.after_prefetch == (3, 3, 0, 3, 3, 0)
    assert alone.batch_copy == (4,) * 6
    # The sent cast shards live at the gather (receive buffer beside them).
    cast = batched_ahead(ORDER, even, [True] * 6, [0] * 6, cap_bytes=3, prefetch=False,
                         sources=[2] * 6, each_at_its_turn=True)
    assert cast.batch_copy == (3 + 6, 4, 4, 3 + 6, 4, 4)
    # 2's prefetch issues [3, 4, 5] (its receive buffer, 3, beside 2's copy).
    b = batched_ahead(ORDER, even, [True] * 6, [0] * 6, cap_bytes=3, prefetch=True,
                      each_at_its_turn=True)
    assert b.before_prefetch == (3, 3, 0, 3, 3, 0)
    assert b.after_prefetch == (3, 3, 3, 3, 3, 0)
    assert b.batch_copy == (4,) * 6
    # Against copying every member out at the first one's turn (twice the batch):
    # the most held at any position (the unit's own copy and what waits ahead,
    # or a copy-out) drops from 6 to 4.
    at_once = batched_ahead(ORDER, even, [True] * 6, [0] * 6, cap_bytes=3, prefetch=True)
    assert at_once.batch_copy == (6, 0, 3 + 1, 6, 0, 0)

    def most(r: Any) -> int:
        return max(max(g + a, c) for g, a, c in zip(even, r.after_prefetch, r.batch_copy))

    assert most(b) == 4 < most(at_once) == 6


def test_backward_batches_of_two_even_members_copy_out_at_once() -> None:
    # Two members of one size: one at a time would hold as much at the first
    # turn (receive buffer, the copy, its gradient) and more at the second, so
    # such batches copy out at once in backward too (``by_member_pays``).
    assert not by_member_pays([1, 1]) and not by_member_pays([2, 1]) and by_member_pays([1, 1, 1])
    for prefetch in (False, True):
        assert (batched_ahead(ORDER, SIZES, [True] * 6, [0] * 6, cap_bytes=2, prefetch=prefetch,
                              each_at_its_turn=True)
                == batched_ahead(ORDER, SIZES, [True] * 6, [0] * 6, cap_bytes=2,
                                 prefetch=prefetch))


def test_batches_stop_where_the_runtime_stops() -> None:
    # A unit that needs no gather (kept since forward, NO_SHARD) ends the chain.
    b = batched_ahead(ORDER, SIZES, [True, False, True, True, True, True], [0] * 6,
                      cap_bytes=2, prefetch=False)
    assert b.before_prefetch == (0, 0, 1, 0, 0, 0)
    # So does another compute dtype.
    b = batched_ahead(ORDER, SIZES, [True] * 6, [0, 1, 0, 0, 0, 0], cap_bytes=2,
                      prefetch=False)
    assert b.before_prefetch == (0, 0, 1, 0, 0, 0)
    # Cap 0: no batches at all.
    b = batched_ahead(ORDER, SIZES, [True] * 6, [0] * 6, cap_bytes=0, prefetch=True)
    assert b.before_prefetch == b.after_prefetch == b.batch_copy == (0,) * 6


class _Stack(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_plan_counts_batches_only_where_the_runtime_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALL_GATHER_BATCH_ENV, raising=False)
    with torch.device("meta"):
        model = _Stack(n=6, d=64)  # 6 units of about 66 KB (fp32)
    kw = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), bucket_cap_mb=0, device="cpu")
    off = fw.plan(model, 2, **kw, all_gather_batch_mb=0)
    on = fw.plan(model, 2, **kw, all_gather_batch_mb=1)
    default = fw.plan(model, 2, **kw)
    assert default.settings["all_gather_batch_mb"] == 1.0 and default.memory == on.memory
    unit = max(u.flats[0].layout.padded_numel for u in on.units[1:]) * 4
    # Forward: the first unit's batch takes the other five, held until their turn.
    assert on.memory.unsharded_forward >= off.memory.unsharded_forward + 4 * unit
    assert on.memory.unsharded_backward > off.memory.unsharded_backward
    # Asynchronous gathers (accelerators, limit_all_gathers=False) never batch.
    for extra in (dict(device="cuda"), dict(limit_all_gathers=False)):
        kw2 = dict(kw, **extra)
        assert (fw.plan(model, 2, **kw2, all_gather_batch_mb=1).memory
                == fw.plan(model, 2, **kw2, all_gather_batch_mb=0).memory)
    monkeypatch.setenv(ALL_GATHER_BATCH_ENV, "0")
    env_off = fw.plan(model, 2, **kw)
    assert env_off.settings["all_gather_batch_mb"] == 0.0 and env_off.memory == off.memory


def test_cli_takes_the_batch_cap(capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from fsdp_wrap.cli import main

    monkeypatch.delenv(ALL_GATHER_BATCH_ENV, raising=False)
    forward = {}
    for cap in ("0", "1"):
        assert main(["plan", "tests._plan_common:make_stack", "--world-size", "2", "--device",
                     "cpu", "--policy", "transformer:Block", "--all-gather-batch-mb", cap,
                     "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["settings"]["all_gather_batch_mb"] == float(cap)
        forward[cap] = data["memory"]["unsharded_forward"]
    # 4 blocks of ~66 KB: at 1 MiB the first gathers the other three with it.
    assert forward["1"] > forward["0"]
