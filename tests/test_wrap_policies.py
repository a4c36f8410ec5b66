"""Policy objects (``_run_policy``), the function policies' own behaviour,
the exports, and ``enable_wrap`` / ``wrap``, checked against torch's FSDP1.

One process, no FSDP class (:mod:`tests._wrap_common`); key cases assert
hard-coded expectations besides the comparison with torch.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

import fsdp_wrap.wrap as our_wrap
from fsdp_wrap.api import ShardingStrategy
from tests._wrap_common import (
    CPU,
    IGNORES,
    MODELS,
    OBJECT_POLICY_NAMES,
    Block,
    FakeWrap,
    custom_lambda,
    ignored_of,
    object_policies,
    section4_model,
    structure,
)

# ---------------------------------------------------------------------------
# Policy objects (_run_policy)
# ---------------------------------------------------------------------------


def fqn_map(
    model: nn.Module, targets: dict[nn.Module, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    names = {mod: name for name, mod in model.named_modules()}
    return {names[mod]: kwargs for mod, kwargs in targets.items()}


@pytest.mark.parametrize("policy_name", OBJECT_POLICY_NAMES)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("with_ignored", [False, True])
def test_run_policy_matches_torch(
    policy_name: str, model_name: str, with_ignored: bool
) -> None:
    results = []
    for impl in (our_wrap, torch_wrap):
        model = MODELS[model_name]()
        ignored_modules, _ = ignored_of(
            model, IGNORES[model_name] if with_ignored else None
        )
        root_kwargs = {
            "sharding_strategy": ShardingStrategy.FULL_SHARD,
            "auto_wrap_policy": None,
        }
        targets = object_policies(impl, model)[policy_name]._run_policy(
            model, ignored_modules, root_kwargs
        )
        for kwargs in targets.values():
            assert kwargs is not root_kwargs
        assert root_kwargs == {
            "sharding_strategy": ShardingStrategy.FULL_SHARD,
            "auto_wrap_policy": None,
        }
        results.append((list(fqn_map(model, targets)), fqn_map(model, targets)))
    assert results[0] == results[1]


def test_custom_policy_dict_overrides_exact() -> None:
    model = section4_model()
    policy = our_wrap.CustomPolicy(custom_lambda(model))
    root_kwargs = {
        "sharding_strategy": ShardingStrategy.FULL_SHARD,
        "use_orig_params": False,
    }
    targets = fqn_map(model, policy._run_policy(model, set(), root_kwargs))
    assert targets == {
        "": {
            "sharding_strategy": ShardingStrategy.FULL_SHARD,
            "use_orig_params": False,
            "forward_prefetch": True,
        },
        "1": root_kwargs,
        "2": root_kwargs,
        "3": {
            "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
            "use_orig_params": False,
        },
    }


@pytest.mark.parametrize("bad", [3, None, "yes", [("a", 1)]])
def test_custom_policy_bad_return(bad: Any) -> None:
    messages = []
    for impl in (our_wrap, torch_wrap):
        with pytest.raises(ValueError) as info:
            impl.CustomPolicy(lambda m: bad)._run_policy(section4_model(), set(), {})
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert messages[0] == (
        "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, "
        f"but it returned {bad}"
    )


def test_module_wrap_policy_repr_and_call() -> None:
    ours = our_wrap.ModuleWrapPolicy([Block])
    theirs = torch_wrap.ModuleWrapPolicy([Block])
    assert repr(ours).startswith("<fsdp_wrap.wrap.ModuleWrapPolicy object at 0x")
    assert repr(ours).endswith(f"({ {Block} })")
    assert (
        repr(ours).split(")", 1)[0].split("(", 1)[1]
        == repr(theirs).split(")", 1)[0].split("(", 1)[1]
    )
    assert ours(Block(2), recurse=True) is True
    assert ours(nn.Linear(2, 2), True, 5) is True
    assert ours(Block(2), recurse=False, nonwrapped_numel=0) is True
    assert ours(nn.Linear(2, 2), False) is False
    assert isinstance(ours, our_wrap._Policy)


def test_policy_abc_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        our_wrap._Policy()  # type: ignore[abstract]


# ---------------------------------------------------------------------------
# Function policy unit behaviour and exports
# ---------------------------------------------------------------------------


def test_exports_match_torch() -> None:
    assert sorted(our_wrap.__all__) == sorted(torch_wrap.__all__)
    for name in our_wrap.__all__ + [
        "_or_policy",
        "_module_wrap_policy",
        "_wrap_module_cls_individually",
        "_Policy",
        "_recursive_wrap",
        "_auto_wrap",
    ]:
        assert callable(getattr(our_wrap, name)), name


def test_size_based_defaults() -> None:
    ours = our_wrap.size_based_auto_wrap_policy
    theirs = torch_wrap.size_based_auto_wrap_policy
    assert (
        ours.FORCE_LEAF_MODULES == theirs.FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    )  # type: ignore[attr-defined]
    assert (
        ours.EXCLUDE_WRAP_MODULES
        == theirs.EXCLUDE_WRAP_MODULES
        == {nn.ModuleList, nn.ModuleDict}
    )  # type: ignore[attr-defined]
    mha = nn.MultiheadAttention(8, 2)
    ml = nn.ModuleList()
    cases = [
        (nn.Linear(2, 2), True, int(1e8)),
        (nn.Linear(2, 2), True, int(1e8) - 1),
        (nn.Linear(2, 2), False, int(1e8)),
        (mha, True, int(1e9)),
        (mha, False, int(1e9)),
        (ml, True, int(1e9)),
        (ml, False, int(1e9)),
    ]
    got = [ours(module=m, recurse=r, nonwrapped_numel=n) for m, r, n in cases]
    assert got == [theirs(module=m, recurse=r, nonwrapped_numel=n) for m, r, n in cases]
    assert got == [True, False, True, False, True, True, False]


def test_or_policy_short_circuits() -> None:
    calls: list[str] = []

    def first(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        calls.append("first")
        return True

    def second(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        calls.append("second")
        return False

    assert (
        our_wrap._or_policy(nn.Linear(1, 1), False, 0, policies=[first, second]) is True
    )
    assert calls == ["first"]
    assert (
        our_wrap._or_policy(nn.Linear(1, 1), False, 0, policies=[second, second])
        is False
    )


# ---------------------------------------------------------------------------
# enable_wrap / wrap
# ---------------------------------------------------------------------------


def test_enable_wrap_and_wrap() -> None:
    results = []
    for impl in (our_wrap, torch_wrap):
        with impl.enable_wrap(
            wrapper_cls=FakeWrap,
            device_id=CPU,
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        ):
            m = section4_model()
            m[1] = impl.wrap(m[1])
            m[2] = impl.wrap(m[2], sharding_strategy=ShardingStrategy.FULL_SHARD)
            root = impl.wrap(m)
        results.append(structure(root))
    assert results[0] == results[1]
    assert results[0] == {
        "": (
            "Sequential",
            {"device_id": CPU, "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
        ),
        "1": (
            "Block",
            {"device_id": CPU, "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
        ),
        "2": (
            "Block",
            {"device_id": CPU, "sharding_strategy": ShardingStrategy.FULL_SHARD},
        ),
    }


def test_wrap_outside_enable_wrap_returns_module() -> None:
    lin = nn.Linear(2, 2)
    assert our_wrap.wrap(lin) is lin
    assert our_wrap.wrap(lin, sharding_strategy=ShardingStrategy.FULL_SHARD) is lin
    with our_wrap.enable_wrap(wrapper_cls=FakeWrap):
        assert isinstance(our_wrap.wrap(lin), FakeWrap)
    assert our_wrap.wrap(lin) is lin


def test_nested_enable_wrap_raises_and_context_is_cleared() -> None:
    messages = []
    for impl in (our_wrap, torch_wrap):
        with (
            pytest.raises(NotImplementedError) as info,
            impl.enable_wrap(wrapper_cls=FakeWrap),
            impl.enable_wrap(wrapper_cls=FakeWrap),
        ):
            pass
        messages.append(str(info.value))
        lin = nn.Linear(2, 2)
        assert impl.wrap(lin) is lin
    assert messages[0] == messages[1]
    # The outer block also ends cleanly on other exceptions.
    with pytest.raises(RuntimeError), our_wrap.enable_wrap(wrapper_cls=FakeWrap):
        raise RuntimeError("boom")
    with our_wrap.enable_wrap(wrapper_cls=FakeWrap):
        pass


def test_enable_wrap_context_is_per_thread() -> None:
    seen: list[nn.Module] = []
    lin = nn.Linear(2, 2)
    with our_wrap.enable_wrap(wrapper_cls=FakeWrap):
        thread = threading.Thread(target=lambda: seen.append(our_wrap.wrap(lin)))
        thread.start()
        thread.join()
        assert isinstance(our_wrap.wrap(lin), FakeWrap)
    assert seen == [lin]


def test_wrap_overrides_attribute_wins() -> None:
    bn = nn.BatchNorm1d(4)
    bn._wrap_overrides = {"mixed_precision": None}  # type: ignore[assignment]
    with our_wrap.enable_wrap(wrapper_cls=FakeWrap, mixed_precision="mp"):
        wrapped = our_wrap.wrap(bn, mixed_precision="override", x=1)
    assert isinstance(wrapped, FakeWrap)
    assert wrapped.kwargs == {"mixed_precision": None, "x": 1}
