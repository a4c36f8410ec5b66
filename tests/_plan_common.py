"""Shared pieces of the planner tests (``tests/test_plan.py``,
``tests/test_plan_cli.py``): the configurations (model, policy, FSDP
arguments, optimizer), what a rank really holds, and ``make_stack``, the
model factory the command-line tests name (``tests._plan_common:make_stack``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import fsdp_wrap as fw
from fsdp_wrap.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from tests.models import Block, FrozenModel, Mlp, TinyTransformer
from tests.test_mixed_precision import BNBlock, BNNet

# ---------------------------------------------------------------------------
# configurations: (model, policy, FSDP kwargs, optimizer)
# ---------------------------------------------------------------------------


class Stack(nn.Module):
    """Blocks of odd sizes plus an untied head: padding on every world size."""

    def __init__(self, n: int = 4, d: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.Sequential(*(Block(d, 2 * d + 1) for _ in range(n)))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x).unsqueeze(1))).squeeze(1)


class MixedBlock(Block):
    """A Block whose norm and mixing are a frozen bf16 base, its MLP's up
    weight frozen fp32, the rest trainable fp32 (LoRA-like): three flat
    parameters of different dtypes and ``requires_grad``."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__(d, h)
        self.norm.to(torch.bfloat16).requires_grad_(False)
        self.mix.to(torch.bfloat16).requires_grad_(False)
        self.mlp.up.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = self.mix(self.norm(x.to(torch.bfloat16))).to(x.dtype)
        return x + mix + self.mlp(x.to(self.mlp.up.weight.dtype)).to(x.dtype)


class MixedDtype(nn.Module):
    """MixedBlocks; in the root a frozen fp32 input layer beside a trainable head."""

    def __init__(self, n: int = 2, d: int = 13) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.inp.requires_grad_(False)
        self.blocks = nn.Sequential(*(MixedBlock(d, 2 * d + 1) for _ in range(n)))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x).unsqueeze(1))).squeeze(1)


MODELS: dict[str, Any] = {
    "stack": (Stack, lambda g: torch.randn(3, 5, generator=g)),
    "transformer": (TinyTransformer, lambda g: torch.randint(0, 11, (2, 5), generator=g)),
    "frozen_mixed": (lambda: FrozenModel(mixed=True), lambda g: torch.randn(2, 4, 5, generator=g)),
    "bn": (BNNet, lambda g: torch.randn(4, 5, generator=g)),
    "mixed_dtype": (MixedDtype, lambda g: torch.randn(3, 5, generator=g)),
}


def _policy(name: str) -> Any:
    if name == "blocks":
        return ModuleWrapPolicy({Block})
    if name == "nested":
        return ModuleWrapPolicy({Block, Mlp})
    if name == "transformer_fn":
        import functools

        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if name == "size":
        import functools

        return functools.partial(size_based_auto_wrap_policy, min_num_params=200)
    if name == "custom":
        # Blocks are units; the first one keeps its parameters after forward.
        def decide(m: nn.Module) -> Any:
            if not isinstance(m, Block):
                return False
            return {"sharding_strategy": fw.ShardingStrategy.SHARD_GRAD_OP} if m.first else True

        return CustomPolicy(decide)
    if name == "bn":
        return ModuleWrapPolicy({BNBlock})
    if name == "none":
        return None
    raise ValueError(name)


def _configs() -> list[dict[str, Any]]:
    out = []

    def add(model: str, policy: str, opt: str = "adam", **kw: Any) -> None:
        out.append(dict(model=model, policy=policy, opt=opt, kw=kw, idx=len(out)))

    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for uop in (False, True):
            add("stack", "blocks", "adam", sharding_strategy=strategy, use_orig_params=uop)
    add("stack", "nested", "sgd-momentum", use_orig_params=True)
    add("stack", "transformer_fn", "sgd")
    add("stack", "size", "adam", sharding_strategy="SHARD_GRAD_OP")
    add("stack", "custom", "adam", use_orig_params=True)
    add("stack", "none", "adam")
    add("transformer", "blocks", "adam", use_orig_params=True)  # tied weights, a buffer
    add("transformer", "blocks", "adam", ignored_modules="blocks.1")
    add("frozen_mixed", "nested", "adam", use_orig_params=True)  # frozen params: no state
    # Units split into frozen and trainable flat parameters (and dtypes): frozen
    # ones hold no gradient or optimizer state (issue 20 item 6).
    add("frozen_mixed", "blocks", "adam")
    add("frozen_mixed", "none", "sgd-momentum", sharding_strategy="SHARD_GRAD_OP")
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for uop in (False, True):
            add("mixed_dtype", "blocks", "adam", sharding_strategy=strategy, use_orig_params=uop)
    add("mixed_dtype", "blocks", "adam", mixed_precision=dict(param_dtype=torch.bfloat16))
    add("stack", "blocks", "adam", mixed_precision=dict(param_dtype=torch.bfloat16))
    # fp16 gradients next to fp32 parameters: Adam refuses them, SGD takes them.
    add("stack", "blocks", "sgd-momentum", use_orig_params=True,
        mixed_precision=dict(param_dtype=torch.float16, keep_low_precision_grads=True))
    add("bn", "bn", "adam", mixed_precision=dict(param_dtype=torch.bfloat16))  # BN units added
    add("stack", "blocks", "adam", cpu_offload=True, use_orig_params=True)
    return out


def _kwargs(cfg: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    kw = dict(cfg["kw"])
    if "sharding_strategy" in kw:
        kw["sharding_strategy"] = fw.ShardingStrategy[kw["sharding_strategy"]]
    if "mixed_precision" in kw:
        kw["mixed_precision"] = fw.MixedPrecision(**kw["mixed_precision"])
    if kw.pop("cpu_offload", False):
        kw["cpu_offload"] = fw.CPUOffload(offload_params=True)
    if "ignored_modules" in kw:
        kw["ignored_modules"] = [model.get_submodule(kw["ignored_modules"])]
    kw["auto_wrap_policy"] = _policy(cfg["policy"])
    return kw


def _new_model(cfg: dict[str, Any]) -> nn.Module:
    torch.manual_seed(cfg["idx"])
    model = MODELS[cfg["model"]][0]()
    for i, m in enumerate(x for x in model.modules() if isinstance(x, Block)):
        m.first = i == 0  # type: ignore[assignment]
    return model


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind in ("adam", "adamw"):
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if kind == "sgd-momentum" else 0.0)


# ---------------------------------------------------------------------------
# measuring what a rank holds
# ---------------------------------------------------------------------------


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[tuple[int, str], int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device)) if st.nbytes() else (id(st), str(t.device))
        seen[key] = st.nbytes()
    return sum(seen.values())


def held(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Sharded parameters, gradients and optimizer state this rank holds for FSDP's units."""
    handles = [h for u in fw.FullyShardedDataParallel.fsdp_modules(model) for h in u._handles]
    params = [h.flat_param for h in handles] + [i.param for h in handles for i in h.infos]
    managed = set(params)
    state = [v for p, st in opt.state.items() if p in managed for v in st.values()
             if torch.is_tensor(v)]
    return {
        "params": _bytes(p.data for p in params),
        "grads": _bytes(p.grad for p in params),
        "optimizer": _bytes(state),
    }


def _real_units(model: nn.Module) -> dict[str, tuple[Any, ...]]:
    """Per unit, per flat parameter in order: sizes, strategy, dtype, requires_grad."""
    out = {}
    for st in fw.FullyShardedDataParallel.fsdp_modules(model):
        if st._handles:
            out[st._handles[0].unit_fqn] = tuple(
                (h.unpadded_numel, h.padded_numel, h.shard_numel, st.sharding_strategy.name,
                 str(h.orig_dtype), h.flat_param.requires_grad) for h in st._handles)
    return out


def _planned_units(p: fw.Plan) -> dict[str, tuple[Any, ...]]:
    return {u.fqn: tuple((f.layout.unpadded_numel, f.layout.padded_numel, f.layout.shard_numel,
                          f.strategy.name, str(f.dtype), f.requires_grad) for f in u.flats)
            for u in p.units}


def make_stack(n: int = 4, d: int = 64) -> nn.Module:
    """A factory for ``fsdp-wrap plan tests._plan_common:make_stack``."""
    return Stack(n=n, d=d)
