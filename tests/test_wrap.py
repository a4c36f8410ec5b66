"""Wrapping policies of fsdp_wrap.wrap, checked against torch's FSDP1 wrap code.

Everything runs in one process: instead of a real FSDP class, both
implementations get :class:`FakeWrap`, which only holds the child and records
the keyword arguments it was built with.  For every policy and model we compare
the set of wrapped FQNs, each unit's kwargs, the returned numel and the log of
policy calls ``(module type, recurse, nonwrapped_numel)``.  Key cases also
assert hard-coded expectations (from the reference doc, section 4) so that a
shared mistake in the oracle comparison cannot hide.
"""

from __future__ import annotations

import copy
import functools
import threading
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
from fsdp_wrap.api import BackwardPrefetch, MixedPrecision, ShardingStrategy

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------
# Fake wrapper and helpers
# ---------------------------------------------------------------------------


class FakeWrap(nn.Module):
    """Stands in for an FSDP class: holds the child, records its kwargs."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self._fsdp_wrapped_module = module
        self.kwargs = kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)


def structure(model: nn.Module) -> dict[str, tuple[str, dict[str, Any]]]:
    """``{fqn without wrapper prefixes: (inner type name, kwargs)}`` for every FakeWrap."""
    param_names = {p: clean_fqn(n) for n, p in model.named_parameters()}
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, FakeWrap):
            kwargs = dict(mod.kwargs)
            # Models differ between runs: name a set of parameters by FQN.
            if isinstance(kwargs.get("ignored_states"), set):
                kwargs["ignored_states"] = (
                    "params",
                    sorted(param_names[p] for p in kwargs["ignored_states"]),
                )
            out[clean_fqn(name)] = (type(mod._fsdp_wrapped_module).__name__, kwargs)
    return out


def clean_fqn(name: str) -> str:
    return name.replace("._fsdp_wrapped_module", "").replace(
        "_fsdp_wrapped_module.", ""
    )


def logged(
    policy: Callable[..., bool], log: list[tuple[str, bool, int]]
) -> Callable[..., bool]:
    def policy_with_log(
        module: nn.Module, recurse: bool, nonwrapped_numel: int
    ) -> bool:
        log.append((type(module).__name__, recurse, nonwrapped_numel))
        return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)

    return policy_with_log


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def section4_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8), Block(8), Block(8), nn.Linear(8, 2))


def tied_model() -> nn.Module:
    """Tied embedding/head weights and one Block instance registered twice."""
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    shared = Block(8)
    return nn.Sequential(emb, shared, Block(8), shared, head)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.layers = nn.ModuleList(
            [
                Block(8),
                nn.ModuleList([Block(8), nn.Linear(8, 8)]),
                nn.ModuleDict({"a": Block(8)}),
            ]
        )
        self.attn = nn.MultiheadAttention(8, 2)
        self.head = nn.Linear(8, 2)


def nested_model() -> nn.Module:
    return Nested()


class BNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.block = Block(8)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.block(self.bn(self.lin(x))))


def bn_model() -> nn.Module:
    return BNModel()


MODELS: dict[str, Callable[[], nn.Module]] = {
    "section4": section4_model,
    "tied": tied_model,
    "nested": nested_model,
    "bn": bn_model,
}


def ignored_of(
    model: nn.Module, fqn: str | None
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """What FSDP would compute for ``ignored_modules=[model.get_submodule(fqn)]``."""
    if fqn is None:
        return set(), set()
    sub = model.get_submodule(fqn)
    return set(sub.modules()), set(sub.parameters())


def torch_root_kwargs(
    mp: Any = None, use_orig_params: bool = False, ignored_params: Any = None
) -> dict[str, Any]:
    """The kwargs dict torch's FSDP builds for its _auto_wrap."""
    return {
        "process_group": None,
        "sharding_strategy": ShardingStrategy.FULL_SHARD,
        "cpu_offload": None,
        "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
        "mixed_precision": mp,
        "param_init_fn": None,
        "device_id": CPU,
        "sync_module_states": False,
        "forward_prefetch": False,
        "limit_all_gathers": True,
        "use_orig_params": use_orig_params,
        "ignored_states": ignored_params,
        "device_mesh": None,
    }


def our_root_kwargs(policy: Any, **kw: Any) -> dict[str, Any]:
    """Our _auto_wrap gets the full constructor kwargs (two extra keys)."""
    return {
        **torch_root_kwargs(**kw),
        "auto_wrap_policy": policy,
        "ignored_modules": None,
    }


def expected_from_torch(
    torch_struct: dict[str, tuple[str, dict[str, Any]]],
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Our units carry the two extra keys: auto_wrap_policy=None, ignored_modules as given."""
    return {
        fqn: (name, {**kwargs, "auto_wrap_policy": None, "ignored_modules": None})
        for fqn, (name, kwargs) in torch_struct.items()
    }


# ---------------------------------------------------------------------------
# Function policies through _recursive_wrap
# ---------------------------------------------------------------------------


def function_policies(impl: Any) -> dict[str, Callable[..., bool]]:
    emb = functools.partial(
        impl.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Embedding)
    )
    blocks = functools.partial(
        impl.transformer_auto_wrap_policy, transformer_layer_cls={Block}
    )
    return {
        "always": impl.always_wrap_policy,
        "size_default": impl.size_based_auto_wrap_policy,
        "size_100": functools.partial(
            impl.size_based_auto_wrap_policy, min_num_params=100
        ),
        "size_force_leaf": functools.partial(
            impl.size_based_auto_wrap_policy,
            min_num_params=50,
            force_leaf_modules={Block},
        ),
        "size_exclude": functools.partial(
            impl.size_based_auto_wrap_policy,
            min_num_params=20,
            exclude_wrap_modules={nn.Linear},
        ),
        "size_small": functools.partial(
            impl.size_based_auto_wrap_policy, min_num_params=1
        ),
        "lambda_emb": emb,
        "transformer": blocks,
        "or": functools.partial(impl._or_policy, policies=[emb, blocks]),
        "module_wrap_fn": functools.partial(
            impl._module_wrap_policy, module_classes={Block, nn.BatchNorm1d}
        ),
        "cls_individually": functools.partial(
            impl._wrap_module_cls_individually, module_classes=(nn.Linear,)
        ),
        "module_wrap_policy_obj": impl.ModuleWrapPolicy({Block}),
    }


POLICY_NAMES = list(function_policies(our_wrap))


def run_recursive(
    impl: Any,
    policy_name: str,
    model_name: str,
    ignore: str | None,
    only_children: bool,
) -> Any:
    model = MODELS[model_name]()
    ignored_modules, ignored_params = ignored_of(model, ignore)
    log: list[tuple[str, bool, int]] = []
    policy = logged(function_policies(impl)[policy_name], log)
    result, numel = impl._recursive_wrap(
        model,
        policy,
        FakeWrap,
        ignored_modules,
        ignored_params,
        only_children,
        tag="x",
        device_id=CPU,
    )
    if only_children:
        assert result is model
    return structure(result), numel, log


IGNORES = {"section4": "1", "tied": "2", "nested": "layers.1", "bn": "block"}


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("with_ignored", [False, True])
@pytest.mark.parametrize("only_children", [True, False])
def test_recursive_wrap_matches_torch(
    policy_name: str, model_name: str, with_ignored: bool, only_children: bool
) -> None:
    ignore = IGNORES[model_name] if with_ignored else None
    ours = run_recursive(our_wrap, policy_name, model_name, ignore, only_children)
    theirs = run_recursive(torch_wrap, policy_name, model_name, ignore, only_children)
    assert ours == theirs
    assert ours[2], "the policy must have been asked at least once"


def test_section4_call_log_matches_reference() -> None:
    # Exact log from reference section 4 (size_based, min_num_params=100, root not wrapped).
    _, numel, log = run_recursive(our_wrap, "size_100", "section4", None, True)
    assert log == [
        ("Sequential", True, 386),
        ("Embedding", True, 80),
        ("Block", True, 144),
        ("Linear", True, 72),
        ("Linear", True, 72),
        ("Block", False, 144),
        ("Block", True, 144),
        ("Linear", True, 72),
        ("Linear", True, 72),
        ("Block", False, 144),
        ("Linear", True, 18),
    ]
    assert numel == 288


@pytest.mark.parametrize(
    ("policy_name", "expected"),
    [
        ("size_100", {"1": "Block", "2": "Block"}),
        ("size_default", {}),
        ("lambda_emb", {"0": "Embedding"}),
        ("transformer", {"1": "Block", "2": "Block"}),
        ("or", {"0": "Embedding", "1": "Block", "2": "Block"}),
        (
            "always",
            {
                "0": "Embedding",
                "1": "Block",
                "1.fc1": "Linear",
                "1.fc2": "Linear",
                "2": "Block",
                "2.fc1": "Linear",
                "2.fc2": "Linear",
                "3": "Linear",
            },
        ),
        ("module_wrap_policy_obj", {"1": "Block", "2": "Block"}),
    ],
)
def test_section4_structures_match_reference(
    policy_name: str, expected: dict[str, str]
) -> None:
    struct, _, _ = run_recursive(our_wrap, policy_name, "section4", None, True)
    assert {fqn: name for fqn, (name, _) in struct.items()} == expected
    for _, kwargs in struct.values():
        assert kwargs == {"tag": "x", "device_id": CPU}


def test_recursive_wrap_numel_and_root_wrapping() -> None:
    model = section4_model()
    wrapped, numel = our_wrap._recursive_wrap(
        model,
        our_wrap.always_wrap_policy,
        FakeWrap,
        set(),
        set(),
        only_wrap_children=False,
    )
    assert isinstance(wrapped, FakeWrap) and wrapped._fsdp_wrapped_module is model
    assert numel == 386
    model = section4_model()
    _, numel = our_wrap._recursive_wrap(
        model, our_wrap.always_wrap_policy, FakeWrap, set(), set(), True
    )
    assert numel == 80 + 144 + 144 + 18


def test_recursive_wrap_ignored_not_entered() -> None:
    model = section4_model()
    ignored_modules, ignored_params = ignored_of(model, "1")
    log: list[tuple[str, bool, int]] = []
    our_wrap._recursive_wrap(
        model,
        logged(our_wrap.always_wrap_policy, log),
        FakeWrap,
        ignored_modules,
        ignored_params,
        True,
    )
    assert log[0] == ("Sequential", True, 386 - 144)
    assert not isinstance(model[1], FakeWrap) and not isinstance(model[1].fc1, FakeWrap)
    assert isinstance(model[2], FakeWrap) and isinstance(
        model[2]._fsdp_wrapped_module.fc1, FakeWrap
    )


def test_recursive_wrap_rejects_already_wrapped_child() -> None:
    model = section4_model()
    model[1] = FakeWrap(model[1])
    with pytest.raises(ValueError, match="is already wrapped by"):
        our_wrap._recursive_wrap(
            model, our_wrap.always_wrap_policy, FakeWrap, set(), set(), True
        )
    # A function (not a class) as wrapper cannot be isinstance-checked: no error.
    our_wrap._recursive_wrap(
        model,
        our_wrap.always_wrap_policy,
        lambda m, **k: FakeWrap(m, **k),
        set(),
        set(),
        True,
    )


def test_tied_model_shared_module_wrapped_once() -> None:
    struct, _, _ = run_recursive(our_wrap, "transformer", "tied", None, True)
    # named_children yields a module once, so the second reference ("3") stays unwrapped.
    assert set(struct) == {"1", "2"}


# ---------------------------------------------------------------------------
# Policy objects (_run_policy)
# ---------------------------------------------------------------------------


def custom_lambda(model: nn.Module) -> Callable[[nn.Module], bool | dict[str, Any]]:
    def decide(m: nn.Module) -> bool | dict[str, Any]:
        if isinstance(m, Block):
            return True
        if isinstance(m, nn.Linear) and m.out_features == 2:
            return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
        if isinstance(m, nn.Embedding):
            return {}
        if m is model:
            return {"forward_prefetch": True}
        return False

    return decide


def object_policies(impl: Any, model: nn.Module) -> dict[str, Any]:
    return {
        "module_wrap_block": impl.ModuleWrapPolicy({Block}),
        "module_wrap_multi": impl.ModuleWrapPolicy([nn.Linear, nn.BatchNorm1d, Block]),
        "module_wrap_root": impl.ModuleWrapPolicy({nn.Sequential, Nested, BNModel}),
        "custom": impl.CustomPolicy(custom_lambda(model)),
    }


OBJECT_POLICY_NAMES = list(object_policies(our_wrap, nn.Linear(1, 1)))


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
