"""``_auto_wrap`` (the FSDP constructor's entry point) against torch's ``_auto_wrap``.

One process, no FSDP class (:mod:`tests._wrap_common`): the units made, their
kwargs (mixed-precision overrides for BatchNorm included), the frozen-parameter
checks, shared and tied modules, and the refusals, each against torch's FSDP1.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp._wrap_utils import _auto_wrap as torch_auto_wrap

import fsdp_wrap.wrap as our_wrap
from fsdp_wrap.api import MixedPrecision, ShardingStrategy
from tests._wrap_common import (
    IGNORES,
    MODELS,
    OBJECT_POLICY_NAMES,
    POLICY_NAMES,
    Block,
    BNModel,
    FakeWrap,
    bn_model,
    custom_lambda,
    expected_from_torch,
    function_policies,
    ignored_of,
    object_policies,
    our_root_kwargs,
    section4_model,
    structure,
    torch_root_kwargs,
)

# ---------------------------------------------------------------------------
# _auto_wrap (the FSDP constructor's entry point) against torch's _auto_wrap
# ---------------------------------------------------------------------------


def both_auto_wrap(
    model_name: str,
    our_policy: Callable[[nn.Module], Any],
    torch_policy: Callable[[nn.Module], Any],
    *,
    mp: Any = None,
    ignore: str | None = None,
    use_orig_params: bool = False,
) -> tuple[Any, Any, list[str], list[str], nn.Module]:
    """Run both _auto_wrap implementations on fresh copies; return structures and warnings."""
    out = []
    for impl, make_policy in (("ours", our_policy), ("torch", torch_policy)):
        model = MODELS[model_name]()
        policy = make_policy(model)
        ignored_modules, ignored_params = ignored_of(model, ignore)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if impl == "ours":
                kwargs = our_root_kwargs(
                    policy,
                    mp=mp,
                    use_orig_params=use_orig_params,
                    ignored_params=ignored_params,
                )
                snapshot = dict(kwargs)
                our_wrap._auto_wrap(
                    model, policy, ignored_modules, ignored_params, kwargs, FakeWrap
                )
                assert kwargs == snapshot, "root_kwargs must not be modified"
            else:
                kwargs = torch_root_kwargs(
                    mp=mp,
                    use_orig_params=use_orig_params,
                    ignored_params=ignored_params,
                )
                torch_auto_wrap(
                    model, policy, ignored_modules, ignored_params, kwargs, FakeWrap
                )
        out.append((structure(model), [str(w.message) for w in caught], model))
    (ours, our_warn, our_model), (theirs, their_warn, _) = out
    return ours, theirs, our_warn, their_warn, our_model


def _fn_policy(impl: Any, name: str) -> Callable[[nn.Module], Any]:
    return lambda model: function_policies(impl)[name]


AUTO_WRAP_POLICIES: dict[
    str, tuple[Callable[[nn.Module], Any], Callable[[nn.Module], Any]]
] = {
    **{
        name: (
            lambda model, n=name: object_policies(our_wrap, model)[n],
            lambda model, n=name: object_policies(torch_wrap, model)[n],
        )
        for name in OBJECT_POLICY_NAMES
    },
    **{
        name: (_fn_policy(our_wrap, name), _fn_policy(torch_wrap, name))
        for name in POLICY_NAMES
        if name != "module_wrap_policy_obj"
    },
}


@pytest.mark.parametrize("policy_name", list(AUTO_WRAP_POLICIES))
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("mp_kind", [None, "ours", "torch"])
@pytest.mark.parametrize("with_ignored", [False, True])
def test_auto_wrap_matches_torch(
    policy_name: str, model_name: str, mp_kind: str | None, with_ignored: bool
) -> None:
    mp: Any = None
    if mp_kind == "ours":
        mp = MixedPrecision(param_dtype=torch.bfloat16)
    elif mp_kind == "torch":
        mp = TorchMixedPrecision(param_dtype=torch.bfloat16)
    ours_policy, torch_policy = AUTO_WRAP_POLICIES[policy_name]
    ours, theirs, our_warn, their_warn, _ = both_auto_wrap(
        model_name,
        ours_policy,
        torch_policy,
        mp=mp,
        ignore=IGNORES[model_name] if with_ignored else None,
    )
    assert ours == expected_from_torch(theirs)
    assert our_warn == their_warn


def test_auto_wrap_section4_module_wrap_policy_exact() -> None:
    ours, _, warns, _, model = both_auto_wrap(
        "section4",
        lambda m: our_wrap.ModuleWrapPolicy({Block}),
        lambda m: torch_wrap.ModuleWrapPolicy({Block}),
    )
    assert warns == []
    assert {fqn: name for fqn, (name, _) in ours.items()} == {
        "1": "Block",
        "2": "Block",
    }
    expected_kwargs = {
        **our_root_kwargs(None, ignored_params=set()),
        "ignored_states": ("params", []),
    }
    assert ours["1"][1] == expected_kwargs
    assert isinstance(model[1], FakeWrap) and isinstance(
        model[1]._fsdp_wrapped_module.fc1, nn.Linear
    )
    assert not isinstance(model, FakeWrap)


def test_auto_wrap_custom_policy_exact() -> None:
    ours, _, _, _, _ = both_auto_wrap(
        "section4",
        lambda m: our_wrap.CustomPolicy(custom_lambda(m)),
        lambda m: torch_wrap.CustomPolicy(custom_lambda(m)),
    )
    base = {
        **our_root_kwargs(None, ignored_params=set()),
        "ignored_states": ("params", []),
    }
    assert ours == {
        "1": ("Block", base),
        "2": ("Block", base),
        "3": ("Linear", {**base, "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}),
    }


def test_auto_wrap_function_policy_children_get_no_policy() -> None:
    policy = functools.partial(our_wrap.size_based_auto_wrap_policy, min_num_params=100)
    model = section4_model()
    kwargs = our_root_kwargs(policy, ignored_params=set())
    kwargs["ignored_modules"] = ["marker"]
    our_wrap._auto_wrap(model, policy, set(), set(), kwargs, FakeWrap)
    assert set(structure(model)) == {"1", "2"}
    assert model[1].kwargs == {**kwargs, "auto_wrap_policy": None}
    assert model[1].kwargs["ignored_modules"] == ["marker"]
    assert kwargs["auto_wrap_policy"] is policy


@pytest.mark.parametrize("policy_kind", ["object", "function"])
def test_auto_wrap_batchnorm_mixed_precision(policy_kind: str) -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    if policy_kind == "object":
        pair = (
            lambda m: our_wrap.ModuleWrapPolicy({Block}),
            lambda m: torch_wrap.ModuleWrapPolicy({Block}),
        )
    else:
        pair = (
            _fn_policy(our_wrap, "transformer"),
            _fn_policy(torch_wrap, "transformer"),
        )
    ours, theirs, our_warn, their_warn, model = both_auto_wrap("bn", *pair, mp=mp)
    assert ours == expected_from_torch(theirs)
    # The installed torch's sentence, whatever its wording (torch 2.14 corrected
    # a misspelling in it): one warning, naming the class mixed precision skips.
    assert our_warn == their_warn and len(their_warn) == 1, (our_warn, their_warn)
    assert their_warn[0].startswith(
        "Both mixed precision and an auto_wrap_policy were specified to FSDP"
    ), their_warn
    assert "{<class 'torch.nn.modules.batchnorm.BatchNorm1d'>}" in their_warn[0], their_warn
    assert {fqn: name for fqn, (name, _) in ours.items()} == {
        "bn": "BatchNorm1d",
        "block": "Block",
        "inner.1": "BatchNorm1d",
    }
    assert ours["bn"][1]["mixed_precision"] is None
    assert ours["inner.1"][1]["mixed_precision"] is None
    assert ours["block"][1]["mixed_precision"] is mp
    assert model.bn._fsdp_wrapped_module._wrap_overrides == {"mixed_precision": None}


def test_mixed_precision_cast_hooks() -> None:
    """The BatchNorm unit computes in float32 and hands back the input's dtype."""
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    outputs = []
    for impl in ("ours", "torch"):
        torch.manual_seed(0)
        model = BNModel()
        seen: list[torch.dtype] = []
        inner_dtypes: list[torch.dtype] = []
        model.bn.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(args[0].dtype), prepend=True
        )
        # Registered before auto-wrap, so it runs before the cast-back hook.
        model.bn.register_forward_hook(
            lambda m, a, o, out=inner_dtypes: out.append(o.dtype)
        )
        if impl == "ours":
            policy = our_wrap.ModuleWrapPolicy({Block})
            with pytest.warns(
                UserWarning, match="Both mixed precision and an auto_wrap_policy"
            ):
                our_wrap._auto_wrap(
                    model,
                    policy,
                    set(),
                    set(),
                    our_root_kwargs(policy, mp=mp),
                    FakeWrap,
                )
        else:
            torch_policy = torch_wrap.ModuleWrapPolicy({Block})
            with pytest.warns(
                UserWarning, match="Both mixed precision and an auto_wrap_policy"
            ):
                torch_auto_wrap(
                    model,
                    torch_policy,
                    set(),
                    set(),
                    torch_root_kwargs(mp=mp),
                    FakeWrap,
                )
        x = torch.randn(3, 8, dtype=torch.bfloat16)
        out = model.bn(x)
        first = (out.dtype, list(seen), list(inner_dtypes))
        # A later float32 call stays float32 (nothing left over from the bf16 call).
        second = model.bn(torch.randn(3, 8)).dtype
        outputs.append((first, second))
    assert (
        outputs[0][0]
        == outputs[1][0]
        == (torch.bfloat16, [torch.bfloat16], [torch.float32])
    )
    assert outputs[0][1] == outputs[1][1] == torch.float32


def test_auto_wrap_already_wrapped_raises() -> None:
    model = section4_model()
    model[1].fc2 = FakeWrap(model[1].fc2)
    policy = our_wrap.ModuleWrapPolicy({Block})
    with pytest.raises(ValueError) as info:
        our_wrap._auto_wrap(
            model, policy, set(), set(), our_root_kwargs(policy), FakeWrap
        )
    # torch's sentence first, filled as torch fills it (the first wrapped module's name
    # after "found", then " in"); then every one by FQN and the fix; no module repr
    # (a unit's spells out FSDP internals).
    assert str(info.value).startswith(
        "FSDP auto wrapping requires modules to not already have FSDP applied but found 1.fc2 "
        "in Sequential (every FakeWrap in it: '1.fc2'). Either give auto_wrap_policy a module "
        "with no FSDP inside"
    ), str(info.value)
    assert "\n" not in str(info.value) and "without auto_wrap_policy" in str(info.value)
    with pytest.raises(ValueError, match="found 1.fc2 in"):
        our_wrap._auto_wrap(
            model,
            our_wrap.always_wrap_policy,
            set(),
            set(),
            our_root_kwargs(None),
            FakeWrap,
        )


def frozen_model(model: nn.Module) -> nn.Module:
    model[1].fc1.weight.requires_grad_(False)
    return model


def run_frozen(
    impl: str, policy_kind: str, use_orig_params: bool
) -> tuple[str | None, list[str]]:
    model = frozen_model(section4_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if impl == "ours":
                policy: Any = (
                    our_wrap.ModuleWrapPolicy({Block})
                    if policy_kind == "object"
                    else function_policies(our_wrap)["transformer"]
                )
                kwargs = our_root_kwargs(policy, use_orig_params=use_orig_params)
                our_wrap._auto_wrap(model, policy, set(), set(), kwargs, FakeWrap)
            else:
                policy = (
                    torch_wrap.ModuleWrapPolicy({Block})
                    if policy_kind == "object"
                    else function_policies(torch_wrap)["transformer"]
                )
                kwargs = torch_root_kwargs(use_orig_params=use_orig_params)
                torch_auto_wrap(model, policy, set(), set(), kwargs, FakeWrap)
        except ValueError as exc:
            return str(exc), [str(w.message) for w in caught]
    return None, [str(w.message) for w in caught]


def test_frozen_params_error() -> None:
    """torch refuses a unit mixing frozen and trainable parameters without
    use_orig_params; fsdp_wrap splits it into two flat parameters instead."""
    assert run_frozen("ours", "object", use_orig_params=False) == (None, [])
    theirs = run_frozen("torch", "object", use_orig_params=False)
    assert theirs[0] == (
        "1 has both parameters with requires_grad=True and False. FSDP does not support wrapping such modules "
        "when use_orig_params=False. If possible, wrap the frozen parameters with FSDP separately.\n"
        "The following parameters have requires_grad=True:\n['1.fc1.bias', '1.fc2.weight', '1.fc2.bias']\n"
        "The following parameters have requires_grad=False:\n['1.fc1.weight']"
    )


def test_frozen_params_warning() -> None:
    """torch warns that the frozen part costs gradient memory; with the split
    it costs none, so fsdp_wrap does not warn."""
    assert run_frozen("ours", "object", use_orig_params=True) == (None, [])
    theirs = run_frozen("torch", "object", use_orig_params=True)
    assert theirs[0] is None
    assert theirs[1] == [
        (
            "1 has both parameters with requires_grad=True and False. We do not recommend wrapping such modules "
            "since the gradient memory usage will be higher than expected (144 numel instead of 80 numel before "
            "sharding via reduce-scatter). If possible, wrap the frozen parameters with FSDP separately.\n"
            "The following parameters have requires_grad=True:\n['1.fc1.bias', '1.fc2.weight', '1.fc2.bias']\n"
            "The following parameters have requires_grad=False:\n['1.fc1.weight']"
        )
    ]


def test_frozen_params_not_checked_for_function_policies() -> None:
    ours = run_frozen("ours", "function", use_orig_params=False)
    assert ours == run_frozen("torch", "function", use_orig_params=False) == (None, [])


def test_frozen_params_root_unit_and_nested_units() -> None:
    """torch's check (kept as ``_check_frozen_params``, no longer run by the
    auto-wrap pass, which splits such units) looks at the root only if the
    policy picked it; inner units take their params first."""
    model = section4_model()
    model[0].weight.requires_grad_(False)
    policy = our_wrap.ModuleWrapPolicy({Block, nn.Sequential})
    our_wrap._auto_wrap(model, policy, set(), set(), our_root_kwargs(policy), FakeWrap)
    assert set(structure(model)) == {"1", "2"}  # (no refusal: the root unit splits)
    model = section4_model()
    model[0].weight.requires_grad_(False)
    our_wrap._check_frozen_params(model, {model[1], model[2]}, set(), False, stacklevel=1)
    with pytest.raises(ValueError, match=r"^ has both parameters") as info:
        our_wrap._check_frozen_params(model, {model, model[1], model[2]}, set(), False,
                                      stacklevel=1)
    assert "requires_grad=True:\n['3.weight', '3.bias']" in str(info.value)
    # An ignored frozen param does not count.
    our_wrap._check_frozen_params(model, {model, model[1], model[2]}, {model[0].weight}, False,
                                  stacklevel=1)


def test_auto_wrap_accepts_torch_policy_object() -> None:
    """A policy object from torch's module takes the one-pass path (duck typing)."""
    model = frozen_model(section4_model())
    policy = torch_wrap.ModuleWrapPolicy({Block})
    our_wrap._auto_wrap(model, policy, set(), set(), our_root_kwargs(policy), FakeWrap)
    assert set(structure(model)) == {"1", "2"}  # (a mixed unit is split, not refused)
    model = section4_model()
    our_wrap._auto_wrap(model, policy, set(), set(), our_root_kwargs(policy), FakeWrap)
    assert set(structure(model)) == {"1", "2"}
    assert model[1].kwargs["auto_wrap_policy"] is None


def test_auto_wrap_shared_module_and_tied_params() -> None:
    ours, theirs, _, _, model = both_auto_wrap(
        "tied",
        lambda m: our_wrap.ModuleWrapPolicy({Block}),
        lambda m: torch_wrap.ModuleWrapPolicy({Block}),
    )
    assert ours == expected_from_torch(theirs)
    assert set(ours) == {"1", "2"}
    # Only the first reference to the shared block is replaced.
    assert isinstance(model[1], FakeWrap) and model[3] is model[1]._fsdp_wrapped_module
    assert model[4].weight is model[0].weight


def test_auto_wrap_rejects_non_callable_policy() -> None:
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        not_a_policy: Any = 3
        our_wrap._auto_wrap(
            section4_model(), not_a_policy, set(), set(), our_root_kwargs(3), FakeWrap
        )


def test_root_kwargs_values_are_shallow_copied() -> None:
    """Each unit gets its own dict; values (e.g. a MixedPrecision) are shared objects."""
    mp = MixedPrecision(param_dtype=torch.float16)
    policy = our_wrap.ModuleWrapPolicy({Block, nn.BatchNorm1d})
    model = bn_model()
    with pytest.warns(UserWarning, match="BatchNorm1d"):
        our_wrap._auto_wrap(
            model,
            policy,
            set(),
            set(),
            our_root_kwargs(policy, mp=copy.copy(mp)),
            FakeWrap,
        )
    kwargs_block = model.block.kwargs
    kwargs_bn = model.bn.kwargs
    assert kwargs_block is not kwargs_bn
    assert (
        kwargs_block["mixed_precision"] == mp and kwargs_bn["mixed_precision"] is None
    )


def test_module_shared_across_parents_wrapped_once() -> None:
    """A module under two different parents is wrapped through the first parent only."""
    results = []
    for impl, wrap_mod in (("ours", our_wrap), ("torch", torch_wrap)):
        shared = Block(4)
        model = nn.Sequential(
            nn.Sequential(shared), nn.Sequential(nn.Linear(4, 4), shared)
        )
        policy = wrap_mod.ModuleWrapPolicy({Block})
        if impl == "ours":
            our_wrap._auto_wrap(
                model, policy, set(), set(), our_root_kwargs(policy), FakeWrap
            )
        else:
            torch_auto_wrap(model, policy, set(), set(), torch_root_kwargs(), FakeWrap)
        assert (
            isinstance(model[0][0], FakeWrap)
            and model[0][0]._fsdp_wrapped_module is shared
        )
        assert model[1][1] is shared
        results.append(set(structure(model)))
    assert results[0] == results[1] == {"0.0"}
