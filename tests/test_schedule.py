"""One copy of each scheduling rule: the runtime and the planner decide alike.

Which flat parameters one all-gather takes and which gradients share a bucket
are decided by :mod:`fsdp_wrap.comm.schedule`, called by the runtime
(``comm/gather_batch.py``, ``comm/bucket.py``) over its handles and by the
planner (``planning/_batches.py``, ``planning/_buckets.py``) over its plan
rows.  Here both are fed the same models: each is wrapped for real on two
gloo ranks and trained (the batches its all-gathers form and the buckets its
reductions issue are recorded in the second step, once the forward order is
known), and planned with the same arguments (``Plan.memory.schedule``).  The
two must name the same flat parameters, batch for batch and bucket for bucket,
over a sweep of unit sizes and their order, units split into several flat
parameters (frozen and trainable, two dtypes), a unit without parameters,
batch and bucket caps, strategies, prefetch kinds and mixed precision.

The expectation is the runtime's behaviour, recorded from the collectives it
issues; the planner's copy of the decisions is the thing checked.  (The
single-process tests at the end pin the rules themselves on documented cases.)
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_wrap as fw
import fsdp_wrap.comm.gather_batch as gather_batch
import fsdp_wrap.comm.schedule as S
from fsdp_wrap import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from fsdp_wrap._compat import in_backward
from fsdp_wrap.comm.bucket import GradBuckets
from fsdp_wrap.comm.schedule import GatherItem, GradItem, OpenBucket, issue_bucket, place_gradient
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._options_common import rank_tag, run_configs
from tests._sweep import Injection, injected

D = 8  # the width every block maps to and from


class Block(nn.Module):
    """``fc1`` (``D -> h``) and ``fc2`` (``h -> D``): ``17h + 8`` parameters.

    ``frozen``: ``fc1`` does not train (the unit gets a trainable and a frozen
    flat parameter); ``half``: a bfloat16 scale joins (a second flat
    parameter of its own dtype).
    """

    def __init__(self, h: int, frozen: bool = False, half: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, h)
        self.fc2 = nn.Linear(h, D)
        self.fc1.requires_grad_(not frozen)
        self.scale = nn.Parameter(torch.ones(D, dtype=torch.bfloat16)) if half else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y * self.scale.float() if self.scale is not None else y


class Empty(nn.Module):
    """A unit with no parameters (no flat parameter: not in the chain)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Net(nn.Module):
    """The root holds an input layer (first in forward, so its gradient is
    complete last in backward) and the head."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _blocks(cfg: dict[str, Any]) -> list[nn.Module]:
    out: list[nn.Module] = []
    for i, h in enumerate(cfg["sizes"]):
        if h == 0:
            out.append(Empty())
        else:
            out.append(Block(h, frozen=i in cfg.get("frozen", ()), half=i in cfg.get("half", ())))
    return out


def _kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        auto_wrap_policy=ModuleWrapPolicy({Block, Empty}),
        sharding_strategy=ShardingStrategy[cfg.get("strategy", "FULL_SHARD")],
        use_orig_params=cfg.get("uop", False),
        backward_prefetch=cfg.get("bp", BackwardPrefetch.BACKWARD_PRE),
        forward_prefetch=cfg.get("fp", False),
        all_gather_batch_mb=cfg["batch"] * 4 * 2**-20,  # (caps given in fp32 elements)
        bucket_cap_mb=cfg["bucket"] * 4 * 2**-20,
    )
    if cfg.get("mp"):
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    return kw


Name = tuple[str, int]


def _record(model: nn.Module, x: torch.Tensor) -> dict[str, list[tuple[Name, ...]]]:
    """What the runtime decides in one training step: the flat parameters of
    each batched all-gather (forward, backward) and of each bucket issued."""
    name_of: dict[int, Name] = {}
    for fqn, m in model.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            for j, h in enumerate(m._handles):
                name_of[id(h)] = name_of[id(h.grads)] = (clean_fqn(fqn), j)
    seen: dict[str, list[tuple[Name, ...]]] = {"forward": [], "backward": [], "buckets": []}
    real_gather, real_issue = gather_batch._gather, GradBuckets._issue

    def spy_gather(batch: list[Any], *a: Any, **k: Any) -> None:
        seen["backward" if in_backward() else "forward"].append(
            tuple(name_of[id(h)] for h in batch))
        real_gather(batch, *a, **k)

    def spy_issue(self: GradBuckets) -> None:
        if len(self._open.units) > 1:
            seen["buckets"].append(tuple(name_of[id(u)] for u in self._open.units))
        real_issue(self)

    gather_batch._gather = spy_gather  # type: ignore[assignment]
    GradBuckets._issue = spy_issue  # type: ignore[method-assign]
    try:
        model(x).float().pow(2).mean().backward()
    finally:
        gather_batch._gather = real_gather  # type: ignore[assignment]
        GradBuckets._issue = real_issue  # type: ignore[method-assign]
    return seen


def _same_decisions(cfg: dict[str, Any]) -> list[str]:
    torch.manual_seed(0)
    net = Net(_blocks(cfg))
    kw = _kwargs(cfg)
    planned = fw.plan(net, 2, device="cpu", **kw).memory.schedule
    model = FullyShardedDataParallel(net, **kw)
    x = torch.randn(3, D)
    model(x).float().pow(2).mean().backward()  # (the forward order is known from step 2)
    model.zero_grad(set_to_none=True)
    ran = _record(model, x)
    tag = f"{rank_tag()} {cfg}"
    fails = []
    for what, plan_side in (("forward", planned.forward_batches),
                            ("backward", planned.backward_batches),
                            ("buckets", planned.buckets)):
        msg = injected(f"{tag} {what}")
        if msg is not None:
            fails.append(msg)
        elif list(plan_side) != ran[what]:
            fails.append(f"{tag}: {what}: the runtime formed {ran[what]}, the plan {list(plan_side)}")
    return fails


# Blocks: h=8 is 144 elements, h=64 is 1096 (frozen: fc2 alone, 520 trainable
# and 576 frozen); the root 108.  Caps (in fp32 elements) around those.
SIZES = {
    "small-big-small": [8, 8, 8, 64, 8, 8],
    "big-first": [64, 8, 8, 8, 8, 64],
    "growing": [4, 8, 16, 32, 64, 96],
}


def _configs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, batch, bucket in itertools.product(SIZES, (400, 1500), (300, 1200)):
        out.append(dict(sizes=SIZES[name], batch=batch, bucket=bucket))
    base = dict(sizes=SIZES["small-big-small"], batch=1200, bucket=1200)
    # Units split in two flat parameters: a batch may take a unit's first and
    # not its second; the gradients of a frozen part are never bucketed.
    out.append(dict(base, frozen=(1, 3, 4)))
    out.append(dict(base, frozen=(0, 1, 2, 3, 4, 5), batch=700))
    out.append(dict(base, half=(1, 4), bucket=600))  # a second dtype: its own batches, buckets
    out.append(dict(base, sizes=[8, 0, 8, 64, 0, 8]))  # units with no parameters
    for strategy, uop in (("SHARD_GRAD_OP", False), ("NO_SHARD", True), ("FULL_SHARD", True)):
        out.append(dict(base, strategy=strategy, uop=uop, frozen=(3,)))
    for bp, fp in ((BackwardPrefetch.BACKWARD_POST, True), (None, False), (None, True)):
        out.append(dict(base, bp=bp, fp=fp, frozen=(2,)))
    out.append(dict(base, mp=True, frozen=(2,), batch=900))
    out.append(dict(base, batch=0, bucket=0))  # nothing batched, nothing bucketed
    return out


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """No decision here gates a collective: every step runs on every rank."""
    return run_configs(configs, _same_decisions, inject=inject)


def test_runtime_and_planner_form_the_same_batches_and_buckets(pool2: Any) -> None:
    configs = _configs()
    fails = [f for r in pool2.run(_sweep, configs) for f in r]
    assert not fails, "\n".join(fails[:8])


def _ran(configs: list[dict[str, Any]]) -> list[int]:
    """How many batches and buckets each configuration formed (rank 0)."""
    counts = []
    for cfg in configs:
        torch.manual_seed(0)
        model = FullyShardedDataParallel(Net(_blocks(cfg)), **_kwargs(cfg))
        x = torch.randn(3, D)
        model(x).sum().backward()
        seen = _record(model, x)
        counts.append(sum(len(v) for v in seen.values()))
    return counts


def test_the_sweep_batches_and_buckets(pool2: Any) -> None:
    """The sweep is not vacuous: configurations with caps form batches and
    buckets (and split units form batches that take part of a unit)."""
    configs = _configs()
    counts = pool2.run(_ran, configs)[0]
    assert all(n > 0 for c, n in zip(configs, counts) if c["batch"] or c["bucket"]), counts
    assert counts[-1] == 0


# ------------------------------------------------------ the rules themselves


def _g(nbytes: int, needs: bool = True, key: Any = "fp32") -> GatherItem:
    return GatherItem(nbytes, needs, True, key)


def test_gather_batch_rule() -> None:
    # A batch takes followers while each needs a gather, shares the key and fits.
    assert S.gather_batch(_g(1), [_g(1), _g(1), _g(1)], 3) == 3
    assert S.gather_batch(_g(1), [_g(1), _g(1, needs=False), _g(1)], 9) == 2
    assert S.gather_batch(_g(1), [_g(1, key="bf16"), _g(1)], 9) == 1
    # The first alone may be larger than the cap: then nothing joins.
    assert S.gather_batch(_g(5), [_g(1)], 3) == 1
    # No batch at cap 0, from a first that needs no gather, or from one that is
    # not batchable (asynchronous gathers; full precision in eval).
    assert S.gather_batch(_g(1), [_g(1)], 0) == 1
    assert S.gather_batch(_g(1, needs=False), [_g(1)], 9) == 1
    assert S.gather_batch(GatherItem(1, True, False, "fp32"), [_g(1)], 9) == 1
    assert S.gather_batch(_g(1), [GatherItem(1, True, False, "fp32")], 9) == 1

    # Followers are read lazily: nothing past the first that does not join.
    def followers() -> Any:
        yield _g(1)
        yield _g(9)
        raise AssertionError("read past the first follower that does not join")

    assert S.gather_batch(_g(1), followers(), 3) == 2


def test_bucket_rules() -> None:
    item = GradItem(4, True, True, "k")
    empty = OpenBucket()
    first = place_gradient(empty, item, 10)
    assert first == (False, True, OpenBucket("k", 4, 1, True), False)
    second = place_gradient(first.open, item, 10)
    assert not second.issue_open and second.open.members == 2 and not second.issue_full
    # Past the cap: the open bucket goes first; reaching it: issued at once.
    assert place_gradient(second.open, GradItem(3, True, True, "k"), 10).issue_open
    assert place_gradient(second.open, GradItem(2, True, True, "k"), 10).issue_full
    # Another key goes in a bucket of its own (also after a bucket of one).
    other = place_gradient(second.open, GradItem(1, True, True, "j"), 10)
    assert other.issue_open and other.open == OpenBucket("j", 1, 1, True)
    assert place_gradient(first.open, GradItem(1, True, False, "j"), 10) == (
        True, True, OpenBucket("j", 1, 1, False), False)
    # Alone (after the open bucket is issued): at the cap, not bucketable, cap 0;
    # no bucket joined, so none is full and the open one is empty.
    for it, cap in ((GradItem(10, True, True, "k"), 10), (GradItem(1, False, True, "k"), 10),
                    (item, 0)):
        assert place_gradient(second.open, it, cap) == (True, False, OpenBucket(), False)
    assert not place_gradient(empty, GradItem(10, True, True, "k"), 10).issue_open
    # One gradient in a bucket is reduced alone; sharded buckets wait for those in flight.
    assert issue_bucket(first.open) == (True, True)
    assert issue_bucket(OpenBucket("k", 8, 2, False)) == (False, False)


def test_member_by_member_copy_out_rule() -> None:
    # At once: twice the batch; member by member: the batch plus twice the
    # largest member.  Less only where the largest is under half the batch.
    assert S.by_member_pays([1, 1, 1]) and S.by_member_pays([3, 2, 2])
    assert not S.by_member_pays([1, 1]) and not S.by_member_pays([2, 1])
    assert not S.by_member_pays([2, 1, 1])  # exactly half: as much, not less


@pytest.mark.parametrize("cap", [0, 1])
def test_unbatched_plan_forms_nothing(cap: int) -> None:
    """Where the runtime never batches (asynchronous gathers) the plan forms no batch."""
    with torch.device("meta"):
        net = Net(_blocks(dict(sizes=[8, 8, 8])))
    kw = _kwargs(dict(batch=10**6 * cap, bucket=0))
    s = fw.plan(net, 2, device="cuda", **kw).memory.schedule
    assert s.forward_batches == s.backward_batches == s.buckets == ()
    on_cpu = fw.plan(net, 2, device="cpu", **kw).memory.schedule
    assert bool(on_cpu.forward_batches) == bool(cap)
