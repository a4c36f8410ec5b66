"""When a unit's gathered parameters are freed in backward.

fsdp_wrap frees a unit's unsharded parameters as soon as autograd has produced
the gradients of all its parameter views (before the gradient concat and the
post-backward reduction), which is what puts its backward peak one unit below
torch FSDP1's.  These tests pin that schedule, and the cases where freeing
early would be wrong: SHARD_GRAD_OP under ``no_sync`` keeps its parameters,
and with several forwards before one backward nothing is freed until the last
forward's views are done.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
import torch.nn as nn

import fsdp_wrap as fw
import fsdp_wrap.handle.full_copies as full_copies
from fsdp_wrap.handle.flat_param import FlatParamHandle
from fsdp_wrap.handle.grads import FlatGrads
from fsdp_wrap.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.Sequential(Block(d), Block(d), Block(d))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _trace_one_backward(strategy: str, no_sync: bool, forwards: int) -> list[tuple[str, int, int]]:
    """Events ``(kind, unit index, storage bytes of its gathered copy)`` in one backward."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = fw.FullyShardedDataParallel(
        Net(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fw.ShardingStrategy[strategy],
    )
    handles = [m._handle for m in fw.FullyShardedDataParallel.fsdp_modules(model)]
    index = {id(h): i for i, h in enumerate(handles)}
    owner = {id(h.grads): h for h in handles}
    events: list[tuple[str, int, int]] = []

    def storage_bytes(h: FlatParamHandle) -> int:
        buf = h._gathered[False].buffer
        return 0 if buf is None else buf.untyped_storage().size()

    real_free = FlatParamHandle.free_unsharded_storage
    # Every reduction (one unit's or a bucket's) starts by taking the gradient.
    real_reduce = FlatGrads.take_grad_for_reduction

    def free(self: FlatParamHandle) -> None:
        events.append(("free_early", index[id(self)], storage_bytes(self)))
        real_free(self)

    def reduce(self: FlatGrads, sync: bool) -> torch.Tensor | None:
        handle = owner[id(self)]
        events.append(("reduce", index[id(handle)], storage_bytes(handle)))
        return real_reduce(self, sync)

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    FlatParamHandle.free_unsharded_storage = free  # type: ignore[method-assign]
    FlatGrads.take_grad_for_reduction = reduce  # type: ignore[method-assign]
    try:
        ctx = model.no_sync() if no_sync else torch.enable_grad()
        with ctx:
            loss = sum(model(x * (i + 1)).pow(2).sum() for i in range(forwards))
            loss.backward()
    finally:
        FlatParamHandle.free_unsharded_storage = real_free  # type: ignore[method-assign]
        FlatGrads.take_grad_for_reduction = real_reduce  # type: ignore[method-assign]
    return events


def _check_schedule() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for no_sync in (False, True):
            for forwards in (1, 2):
                out[f"{strategy}/no_sync={no_sync}/forwards={forwards}"] = _trace_one_backward(
                    strategy, no_sync, forwards
                )
    return out


def test_backward_frees_each_unit_before_its_reduction(pool2: Any) -> None:
    for rank_result in pool2.run(_check_schedule):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            events = rank_result[f"{strategy}/no_sync=False/forwards=1"]
            reduced = [u for kind, u, _ in events if kind == "reduce"]
            freed = [u for kind, u, _ in events if kind == "free_early"]
            assert sorted(reduced) == [0, 1, 2, 3], events
            assert sorted(freed) == [0, 1, 2, 3], events
            for unit in reduced:
                kinds = [(k, b) for k, u, b in events if u == unit]
                # freed (while still holding its gathered bytes) before being reduced
                assert kinds[0][0] == "free_early" and kinds[0][1] > 0, (strategy, unit, kinds)
                assert kinds[1] == ("reduce", 0), (strategy, unit, kinds)


def test_shard_grad_op_keeps_parameters_under_no_sync(pool2: Any) -> None:
    for rank_result in pool2.run(_check_schedule):
        for forwards in (1, 2):
            events = rank_result[f"SHARD_GRAD_OP/no_sync=True/forwards={forwards}"]
            assert events and all(kind == "reduce" for kind, _, _ in events), events
            full_shard = rank_result[f"FULL_SHARD/no_sync=True/forwards={forwards}"]
            assert {u for k, u, _ in full_shard if k == "free_early"} == {0, 1, 2, 3}


def test_several_forwards_free_only_after_the_last_graph(pool2: Any) -> None:
    for rank_result in pool2.run(_check_schedule):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            events = rank_result[f"{strategy}/no_sync=False/forwards=2"]
            # one early free per unit (after the second graph), never two
            freed = [u for kind, u, _ in events if kind == "free_early"]
            assert sorted(freed) == [0, 1, 2, 3], events


def _two_forward_parity() -> list[str]:
    """Values stay right when storage is freed early (vs a plain replicated model)."""
    warnings.simplefilter("ignore")
    fails = []
    torch.manual_seed(0)
    base = Net()
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        ref = copy.deepcopy(base)
        model = fw.FullyShardedDataParallel(
            copy.deepcopy(base),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=fw.ShardingStrategy[strategy],
            use_orig_params=True,
        )
        world = torch.distributed.get_world_size()
        xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        mine = xs[torch.distributed.get_rank()]
        (model(mine).pow(2).sum() + model(2 * mine).pow(2).sum()).backward()
        for x in xs:
            ((ref(x).pow(2).sum() + ref(2 * x).pow(2).sum()) / world).backward()
        with fw.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if not torch.allclose(p.grad, q.grad, atol=1e-5):
                    fails.append(f"{strategy} {name}")
    return fails


def test_early_free_keeps_gradients_exact(pool2: Any) -> None:
    assert pool2.run(_two_forward_parity) == [[], []]


def _full_save_once(uop: bool, rank0_only: bool, offload: bool) -> dict[str, Any]:
    """How many other units are gathered while each unit is copied in a FULL save."""
    torch.manual_seed(0)
    model = fw.FullyShardedDataParallel(
        Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=uop
    )
    model(torch.randn(2, 4)).sum().backward()
    handles = [m._handle for m in fw.FullyShardedDataParallel.fsdp_modules(model) if m._handle]
    others_gathered: list[int] = []
    full_gathers = [0]
    real_copies = full_copies.full_param_copies
    real_finish = FlatParamHandle.finish_unshard

    def copies(handle: FlatParamHandle, *a: Any, **k: Any) -> Any:
        others_gathered.append(
            sum(h.is_unsharded or h.holds_unsharded_storage for h in handles if h is not handle)
        )
        return real_copies(handle, *a, **k)

    def finish(self: FlatParamHandle, *a: Any, **k: Any) -> None:
        full_gathers[0] += 1
        real_finish(self, *a, **k)

    cfg = fw.FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
    full_copies.full_param_copies = copies
    FlatParamHandle.finish_unshard = finish  # type: ignore[method-assign]
    try:
        with fw.FullyShardedDataParallel.state_dict_type(
            model, fw.StateDictType.FULL_STATE_DICT, cfg
        ):
            sd = model.state_dict()
    finally:
        full_copies.full_param_copies = real_copies
        FlatParamHandle.finish_unshard = real_finish  # type: ignore[method-assign]
    return {
        "others_gathered": others_gathered,
        "full_gathers": full_gathers[0],
        "keys": sorted(sd),
        "printable": "Linear" in repr(model) and model.module.blocks[0].fc1.weight is not None,
    }


def _full_save_streams() -> dict[str, Any]:
    warnings.simplefilter("ignore")
    return {
        f"uop={uop}/rank0_only={r0}/offload={off}": _full_save_once(uop, r0, off)
        for uop, r0, off in itertools.product([False, True], [False, True], [False, True])
    }


def test_full_state_dict_streams_one_unit_at_a_time(pool2: Any) -> None:
    plain_keys = sorted(Net().state_dict())
    for rank, res in enumerate(pool2.run(_full_save_streams)):
        for mode, r in res.items():
            assert r["others_gathered"] == [0, 0, 0, 0], (rank, mode, r)
            assert r["printable"], (rank, mode)
            if "rank0_only=True" in mode:
                # gathered to rank 0 only: no rank runs an all-gather of a whole unit
                assert r["full_gathers"] == 0, (rank, mode, r)
                assert r["keys"] == (plain_keys if rank == 0 else []), (rank, mode, r)
            else:
                assert r["keys"] == plain_keys, (rank, mode, r)


def _full_load_once(uop: bool) -> list[str]:
    torch.manual_seed(0)
    source = Net()
    torch.manual_seed(1)
    model = fw.FullyShardedDataParallel(
        Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=uop
    )
    gathers = [0]
    real_finish = FlatParamHandle.finish_unshard

    def finish(self: FlatParamHandle, *a: Any, **k: Any) -> None:
        gathers[0] += 1
        real_finish(self, *a, **k)

    FlatParamHandle.finish_unshard = finish  # type: ignore[method-assign]
    try:
        result = model.load_state_dict(source.state_dict())
    finally:
        FlatParamHandle.finish_unshard = real_finish  # type: ignore[method-assign]
    fails = []
    if gathers[0] or result.missing_keys or result.unexpected_keys:
        fails.append(f"uop={uop}: {gathers[0]} gathers, {result}")
    with fw.FullyShardedDataParallel.summon_full_params(model):
        for (name, p), q in zip(model.module.named_parameters(), source.parameters()):
            if not torch.equal(p, q):
                fails.append(f"uop={uop}: {name} differs after load")
    return fails


def _full_load_gathers_nothing() -> list[str]:
    warnings.simplefilter("ignore")
    return _full_load_once(False) + _full_load_once(True)


def test_full_state_dict_load_gathers_nothing(pool2: Any) -> None:
    assert pool2.run(_full_load_gathers_nothing) == [[], []]


# ---------------------------------------------------------------------------
# NO_SHARD computing on a cast copy (mixed precision): freed after forward
# ---------------------------------------------------------------------------


def _no_shard_cast_copies() -> list[str]:
    """The low-precision copy of every NO_SHARD unit is freed once its forward is
    done (torch does the same), made again for backward in the same storage, and
    nothing (module attributes included) keeps it alive between steps."""
    warnings.simplefilter("ignore")
    fails: list[str] = []
    for uop in (False, True):
        torch.manual_seed(0)
        base = Net()
        mp = fw.MixedPrecision(param_dtype=torch.bfloat16)
        model = fw.FullyShardedDataParallel(
            copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=fw.ShardingStrategy.NO_SHARD, mixed_precision=mp,
            use_orig_params=uop,
        )
        handles = [m._handle for m in fw.FullyShardedDataParallel.fsdp_modules(model)]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            out = model(torch.randn(5, 4))
            held = [h._gathered[False].buffer.untyped_storage().nbytes() for h in handles]
            if any(held):
                fails.append(f"uop={uop} step {step}: bytes of cast copies after forward {held}")
            storages = [h._gathered[False].buffer.untyped_storage() for h in handles]
            out.float().pow(2).mean().backward()
            same = [h._gathered[False].buffer.untyped_storage()._cdata == s._cdata
                    for h, s in zip(handles, storages)]
            if not all(same):
                fails.append(f"uop={uop} step {step}: backward made new storage {same}")
            opt.step()
            opt.zero_grad()
            held = [h._gathered[False].buffer.untyped_storage().nbytes() for h in handles]
            if any(held):
                fails.append(f"uop={uop} step {step}: bytes of cast copies between steps {held}")
    return fails


def test_no_shard_cast_copies_freed_after_forward(pool2: Any) -> None:
    for rank, fails in enumerate(pool2.run(_no_shard_cast_copies)):
        assert not fails, (rank, fails)
