"""Batched all-gathers (``all_gather_batch_mb``) on real gloo groups.

Two copies of one model train in lockstep on different data per rank, one
gathering every unit on its own (``all_gather_batch_mb=0``) and one batching
small units; gradients and parameters must be bit-identical every step (a
gather moves data, it adds nothing).  The all-gathers are counted by
wrapping :mod:`fsdp_wrap.comm.collectives`, and the bytes held unsharded are
checked against the cap.  Cases: FULL_SHARD and SHARD_GRAD_OP, both
``use_orig_params``, backward prefetch kinds, forward prefetch, mixed
precision, CPU offload, ``no_sync``, several forwards, units unused in a
step, an evaluation forward without grad between steps, non-reentrant
activation checkpointing, 3 ranks, gloo's broadcast form (each rank's
shards written straight into its row of the batch's buffer).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
from fsdp_wrap import BackwardPrefetch, FullyShardedDataParallel
from fsdp_wrap._compat import in_backward
from fsdp_wrap.comm.gather_batch import (
    ALL_GATHER_BATCH_ENV,
    DEFAULT_ALL_GATHER_BATCH_MB,
    resolve_all_gather_batch_mb,
)
from tests._options_common import rank_tag, run_configs
from tests._sweep import Injection
from tests.test_buckets import Net, _batch, _differences, _grads, _kwargs

UNIT_MB = 280 * 4 / 2**20  # one small block's fp32 gather


def _wrap(net: Net, batch_mb: float, **kw: Any) -> nn.Module:
    for i, block in enumerate(net.blocks):
        net.blocks[i] = FullyShardedDataParallel(block, **kw)
    return FullyShardedDataParallel(net, all_gather_batch_mb=batch_mb, bucket_cap_mb=0.0, **kw)


class GatherSpy:
    """Counts all-gathers and records the most bytes held unsharded at a gather."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        self.model = model
        self.max_held = 0
        self.real = C.all_gather_into

    def __enter__(self) -> GatherSpy:
        def all_gather_into(output: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.calls += 1
            held = sum(h.gather_nbytes for h in self.model._all_handles  # type: ignore[union-attr]
                       if h._gathered[False].valid)
            self.max_held = max(self.max_held, held)
            return self.real(output, *a, **k)

        C.all_gather_into = all_gather_into  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        C.all_gather_into = self.real  # type: ignore[assignment]


def _step(model: nn.Module, step: int, cfg: dict[str, Any], net: Net) -> None:
    net.skip = set(cfg.get("skip", {}).get(step, ()))
    net.checkpoint = bool(cfg.get("ckpt"))
    if cfg.get("nosync"):
        with model.no_sync():  # type: ignore[operator]
            model(_batch(step, 1)).float().pow(2).mean().backward()
    if cfg.get("eval"):
        with torch.no_grad():
            model(_batch(step, 5))
    k = cfg.get("forwards", 1)
    loss = sum(model(_batch(step, 2 + i)).float().pow(2).mean() for i in range(k))
    loss.backward()  # type: ignore[union-attr]


def _batched_vs_single(cfg: dict[str, Any]) -> list[str]:
    if not cfg.get("bcast"):
        return _compare(cfg)
    # Every gather by broadcasts, the batches' own shards written in place.
    threshold, C.GLOO_BROADCAST_MIN_BYTES = C.GLOO_BROADCAST_MIN_BYTES, 1
    try:
        return _compare(cfg)
    finally:
        C.GLOO_BROADCAST_MIN_BYTES = threshold


def _compare(cfg: dict[str, Any]) -> list[str]:
    torch.manual_seed(0)
    base = Net()
    nets = [copy.deepcopy(base), copy.deepcopy(base)]
    kw = _kwargs(cfg)
    kw["backward_prefetch"] = cfg.get("bp", BackwardPrefetch.BACKWARD_PRE)
    kw["forward_prefetch"] = cfg.get("fp", False)
    models = [_wrap(nets[0], 0.0, **kw), _wrap(nets[1], cfg["batch"], **kw)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    tag = f"{rank_tag()} {cfg}"
    fails: list[str] = []
    counts = []
    for step in range(3):
        for i, m in enumerate(models):
            with GatherSpy(m) as spy:
                _step(m, step, cfg, nets[i])
            counts.append(spy.calls)
            # The unit being gathered, the cap's worth of followers, and the root
            # (kept gathered through forward, as torch does).
            limit = cfg["batch"] * 2**20 + 2 * 2128 * 4 + 68 * 4 if i else None
            if limit is not None and spy.max_held > limit:
                fails.append(f"{tag}: {spy.max_held} bytes held unsharded > {limit}")
        fails += _differences(f"{tag} step {step} grad", _grads(models[0]), _grads(models[1]))
        for o in opts:
            o.step()
            o.zero_grad()
        fails += _differences(f"{tag} step {step} param", list(models[0].parameters()),
                              list(models[1].parameters()))
    single, batched = counts[-2], counts[-1]
    if cfg.get("fewer", True) and not batched < single:
        fails.append(f"{tag}: {batched} all-gathers batched vs {single} single in the last step")
    return fails[:6]


def _configs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for strategy, uop in itertools.product(["FULL_SHARD", "SHARD_GRAD_OP"], [False, True]):
        base = dict(strategy=strategy, uop=uop)
        out.append(dict(base, batch=3 * UNIT_MB))
        out.append(dict(base, batch=1.0, fp=True))
        out.append(dict(base, batch=2 * UNIT_MB, nosync=True, eval=True))
        out.append(dict(base, batch=3 * UNIT_MB, forwards=2, bp=BackwardPrefetch.BACKWARD_POST))
        out.append(dict(base, batch=3 * UNIT_MB, skip={1: (1, 4)}, bp=None))
        out.append(dict(base, batch=0.5 * UNIT_MB, fewer=False))  # no unit is small enough
        # Recomputed forwards in backward do not batch (their next units are done).
        out.append(dict(base, batch=3 * UNIT_MB, ckpt=True))
    for uop in (False, True):
        out.append(dict(strategy="FULL_SHARD", uop=uop, batch=3 * UNIT_MB, bcast=True))
        out.append(dict(strategy="FULL_SHARD", uop=uop, batch=3 * UNIT_MB, mp=torch.float32))
        out.append(dict(strategy="FULL_SHARD", uop=uop, batch=3 * UNIT_MB, offload=True))
    return out


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """No decision here gates a collective: every step and comparison runs on
    every rank; the comparisons are tests/test_buckets.py's ``_differences``."""
    return run_configs(configs, _batched_vs_single, inject=inject)


def test_batched_gathers_bit_identical(pool2: Any) -> None:
    fails = [f for r in pool2.run(_sweep, _configs()) for f in r]
    assert not fails, "\n".join(fails)


def test_batched_gathers_three_ranks(pool3: Any) -> None:
    configs = [c for c in _configs() if not c.get("mp") and not c.get("offload")][:6]
    configs += [c for c in _configs() if c.get("bcast")]
    fails = [f for r in pool3.run(_sweep, configs) for f in r]
    assert not fails, "\n".join(fails)


def _count_forward_gathers(batch_mb: float) -> list[int]:
    torch.manual_seed(0)
    model = _wrap(Net(), batch_mb)
    counts = []
    for _ in range(2):  # the forward order is known from the second iteration on
        with GatherSpy(model) as spy:
            model(_batch(0)).sum().backward()
        counts.append(spy.calls)
    return counts


def test_gather_counts(pool2: Any) -> None:
    """7 units; FULL_SHARD gathers 7 in forward and 6 in backward (the root stays)."""
    assert pool2.run(_count_forward_gathers, 0.0)[0] == [13, 13]
    # Up to 3 small units' bytes per batch.  Backward: 5+4, 3 (big, alone),
    # 2+1+0 (prefetched as one batch).  Forward, once its order is known (from
    # the second iteration): root+0+1, 2 (3 would not fit), 3, 4+5.
    assert pool2.run(_count_forward_gathers, 3 * UNIT_MB)[0] == [7 + 3, 4 + 3]


def _gathers_in_place(batch_mb: float) -> tuple[int, int]:
    """(all-gathers, those whose shard was already in its row of the output)
    in two steps' forward and backward over two gloo ranks, where
    ``all_gather_into`` fills the output row by row (``gathers_in_rows``)."""
    torch.manual_seed(0)
    model = _wrap(Net(), batch_mb)
    real = C.all_gather_into
    calls = in_place = 0

    def spy(output: torch.Tensor, shard: torch.Tensor, group: Any, *a: Any, **k: Any) -> Any:
        nonlocal calls, in_place
        assert C.gathers_in_rows(output, group)
        row = output.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        calls += 1
        in_place += shard.data_ptr() == row.data_ptr()
        return real(output, shard, group, *a, **k)

    C.all_gather_into = spy  # type: ignore[assignment]
    try:
        for _ in range(2):
            model(_batch(0)).sum().backward()
    finally:
        C.all_gather_into = real  # type: ignore[assignment]
    return calls, in_place


def test_batches_gather_into_their_own_row_without_a_send_buffer(pool2: Any) -> None:
    """gloo over two ranks fills the output row by row: a batch writes its
    shards straight into this rank's row of its receive buffer (the module
    docstring's "broadcast form"; ``collectives.gathers_in_rows``), no send
    buffer and no copy."""
    calls, in_place = pool2.run(_gathers_in_place, 3 * UNIT_MB)[0]
    # (test_gather_counts' batches: the first step's forward 7 alone (its order
    # not known yet), backward 5+4, 3, 2+1+0; the second's forward root+0+1, 2,
    # 3, 4+5: 17 gathers, 6 of them batches; units alone may or may not copy)
    assert calls == 17 and in_place >= 6, (calls, in_place)


def _held_after_a_step_with_an_unused_follower() -> list[int]:
    """The blocks still holding a gathered copy after a step whose forward left
    block 1 out, though its batch (root+0+1, the order known from the first
    step) gathered it."""
    torch.manual_seed(0)
    net = Net()
    model = _wrap(net, 3 * UNIT_MB)
    blocks = list(model.blocks)  # type: ignore[union-attr, arg-type]
    for step in range(2):
        net.skip = {1} if step else set()
        model(_batch(step)).sum().backward()
    return [j for j, b in enumerate(blocks)
            if b._handles[0]._gathered[False].valid
            or b._handles[0]._gathered[False].pending is not None]


def test_a_follower_that_did_not_run_is_freed_at_the_end_of_backward(pool2: Any) -> None:
    """The module docstring: "A follower that then does not run (control flow)
    is freed with every other unit at the end of backward"."""
    assert pool2.run(_held_after_a_step_with_an_unused_follower) == [[], []]


def _count_full_precision_eval_gathers() -> list[int]:
    """bfloat16 compute, in eval mode under ``FSDP_USE_FULL_PREC_IN_EVAL=1``
    (with grad): every unit computes in full precision, which a batch (of
    compute copies) does not hold, so none batches."""
    import os

    from fsdp_wrap import MixedPrecision

    torch.manual_seed(0)
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        model = _wrap(Net(), 3 * UNIT_MB, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    model.eval()
    counts = []
    for _ in range(2):
        with GatherSpy(model) as spy:
            out = model(_batch(0))
            assert out.dtype == torch.float32, out.dtype
            out.sum().backward()
        counts.append(spy.calls)
    return counts


def test_units_computing_in_full_precision_do_not_batch(pool2: Any) -> None:
    """As many gathers as with batching off (test_gather_counts: 13 a step)."""
    assert pool2.run(_count_full_precision_eval_gathers)[0] == [13, 13]


def _in_flight_during_forward(batch_mb: float) -> list[list[int]]:
    """Per block, the blocks whose batched gather is still in flight (issued, not
    yet waited for) while it computes, in the second iteration."""
    torch.manual_seed(0)
    model = _wrap(Net(), batch_mb)
    blocks = list(model.blocks)  # type: ignore[union-attr, arg-type]
    seen: list[list[int]] = []

    def record(*_: Any) -> None:
        slots = [b._handles[0]._gathered[False] for b in blocks]
        # (in flight: issued, not yet copied out; the first member's wait copies
        # every member's part out)
        seen.append([j for j, slot in enumerate(slots)
                     if slot.pending is not None and not slot.valid])

    for b in blocks:
        b.module.register_forward_pre_hook(record)
    for _ in range(2):
        seen.clear()
        model(_batch(0)).sum().backward()
    return seen


def test_forward_gathers_the_next_batch_while_the_last_unit_computes(pool2: Any) -> None:
    """Batches as in test_gather_counts (root+0+1, 2, 3, 4+5): the 4+5 batch is
    issued when 3, the unit before it, starts its forward, and is in flight while
    3 computes; units that gather alone (2, 3) wait for their turn, as without
    ``forward_prefetch``, and so does everything with batching off."""
    seen = pool2.run(_in_flight_during_forward, 3 * UNIT_MB)[0]
    assert seen == [[], [], [], [4, 5], [], []], seen
    assert pool2.run(_in_flight_during_forward, 0.0)[0] == [[]] * 6


def _copied_before_their_turn(batch_mb: float, uop: bool, bp: Any) -> list[str]:
    """Second iteration's backward: every copy of a block's part out of a batch's
    receive buffer, in order, as ``(block, whether its backward had begun)``."""
    torch.manual_seed(0)
    model = _wrap(Net(), batch_mb, use_orig_params=uop, backward_prefetch=bp)
    blocks = list(model.blocks)  # type: ignore[union-attr, arg-type]
    copies: list[tuple[int, bool]] = []

    def spy(j: int, take: Any) -> Any:
        def take_gathered(rows: torch.Tensor) -> None:
            take(rows)
            if in_backward():
                began = blocks[j]._handle._training_state.name.startswith("BACKWARD")
                copies.append((j, began))
        return take_gathered

    for j, b in enumerate(blocks):
        b._handles[0].take_gathered = spy(j, b._handles[0].take_gathered)
    for _ in range(2):
        copies.clear()
        model(_batch(0)).sum().backward()
    # 5+4 (two even members) at 5's turn, 4 with it; 2+1+0 each at its own turn
    ok = copies == [(5, True), (4, False), (2, True), (1, True), (0, True)]
    return [] if ok else [f"{rank_tag()} uop={uop} bp={bp}: {copies}"]


def test_backward_copies_each_member_out_at_its_turn(pool2: Any) -> None:
    """Backward batches as in test_gather_counts (5+4 at 5's turn, 3 alone, 2+1+0
    prefetched): in 2+1+0 each member copies its own part out of the batch's
    receive buffer when its backward begins, so a follower's unsharded copy does
    not exist before its turn and the first member's copy-out does not hold the
    receive buffer and every member's copy at once.  5+4, two members of one
    size, copies out at once (one at a time would not hold less:
    ``by_member_pays``), as forward does with every batch (its activations grow
    while a batch lasts)."""
    fails = []
    for uop, bp in itertools.product([False, True], [BackwardPrefetch.BACKWARD_PRE,
                                                     BackwardPrefetch.BACKWARD_POST, None]):
        fails += sum(pool2.run(_copied_before_their_turn, 3 * UNIT_MB, uop, bp), [])
    assert not fails, fails


def test_resolution_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALL_GATHER_BATCH_ENV, raising=False)
    assert resolve_all_gather_batch_mb(None) == DEFAULT_ALL_GATHER_BATCH_MB == 1.0
    monkeypatch.setenv(ALL_GATHER_BATCH_ENV, "1.5")
    assert resolve_all_gather_batch_mb(None) == 1.5
    with pytest.raises(ValueError, match="all_gather_batch_mb must be >= 0"):
        FullyShardedDataParallel(nn.Linear(2, 2), all_gather_batch_mb=-1)
    assert not dist.is_initialized()
