"""Shared pieces of the wrap-policy tests (tests/test_wrap_*.py).

Instead of a real FSDP class, both implementations get :class:`FakeWrap`,
which only holds the child and records the keyword arguments it was built
with; the models, the policies by name and the helpers comparing fsdp_wrap's
wrap pass with torch's FSDP1's live here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fsdp_wrap.wrap as our_wrap
from fsdp_wrap.api import BackwardPrefetch, ShardingStrategy

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
