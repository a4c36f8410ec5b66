"""The units FSDP would build, found with the library's own wrap pass and layout.

Nothing is allocated and no process group is needed: the model is copied with
every parameter and buffer on the meta device (a model already on meta costs
nothing to copy), the copy is auto-wrapped by :func:`fsdp_wrap.wrap._auto_wrap`
with a stand-in for the FSDP class that only records its arguments, and each
unit's parameters are collected and laid out by the same functions the
:class:`~fsdp_wrap.handle.flat_param.FlatParamHandle` uses.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from fsdp_wrap.api import (
    RESHARD_AFTER_FORWARD,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    coerce_dataclass,
    coerce_enum,
)
from fsdp_wrap.api import SHARDED_STRATEGIES as SHARDED
from fsdp_wrap.handle.dtensor import is_dtensor
from fsdp_wrap.handle.layout import (
    FlatLayout,
    alignment,
    check_quantized_storage,
    check_unit_params,
    collect_unit_params,
    is_quantized,
    split_unit_params,
)
from fsdp_wrap.runtime.construct import resolve_ignored
from fsdp_wrap.wrap import _auto_wrap


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """One original parameter of a unit, as the flat parameter holds it."""

    fqn: str  # clean FQN from the model root
    numel: int
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """One flat parameter of a unit: its parameters, layout, dtypes and how it runs.

    A unit mixing ``requires_grad`` or dtypes has several (one per group of
    :func:`fsdp_wrap.handle.layout.split_unit_params`, trainable first); each is
    sharded, gathered and reduced on its own, in its own dtype.  A frozen one
    has no gradient and no optimizer state.
    """

    params: tuple[ParamEntry, ...]
    layout: FlatLayout
    dtype: torch.dtype  # the parameters' dtype (the sharded master copy)
    requires_grad: bool
    strategy: ShardingStrategy
    mixed_precision: MixedPrecision
    offload_params: bool
    use_orig_params: bool
    shared_numel: int = 0  # elements of tied parameters' later uses (extra gradients)
    #: elements of parameters used (held, or tied into) by a module that comes
    #: after the unit's first nested unit in module order: an output head, a
    #: final norm, a tied embedding's later use.  Their gradients exist before
    #: the nested units' backward and wait for the unit's own.
    late_numel: int = 0
    #: bitsandbytes 4-bit weights in this flat parameter: their logical
    #: (dequantized) element counts; the packed storage is what ``layout`` holds.
    quantized_numels: tuple[int, ...] = ()
    quant_state_bytes: int = 0  # their quantization states (kept whole on every rank)

    @property
    def numel(self) -> int:
        """Parameters this flat parameter holds (without padding)."""
        return sum(p.numel for p in self.params)

    @property
    def trainable(self) -> bool:
        return self.requires_grad

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy in RESHARD_AFTER_FORWARD

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mixed_precision.param_dtype or self.dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        mp = self.mixed_precision
        return mp.reduce_dtype or mp.param_dtype or self.dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        """The sharded gradient's dtype (the compute dtype with keep_low_precision_grads)."""
        return self.compute_dtype if self.mixed_precision.keep_low_precision_grads else self.dtype

    def optimizer_numel(self, rank: int) -> tuple[int, int]:
        """``(elements, tensors)`` the optimizer sees on ``rank`` for this flat parameter.

        ``use_orig_params=False``: the whole flat shard, as one tensor (if
        trainable).  ``True``: each trainable parameter's piece of the shard,
        without the padding (parameters with no piece on this rank get no
        gradient, hence no optimizer state).
        """
        if not self.requires_grad:
            return 0, 0
        if not self.use_orig_params:
            return self.layout.shard_numel, 1
        numel = tensors = 0
        for sl in self.layout.shard_slices(rank):
            if sl is not None:
                numel += sl[1] - sl[0]
                tensors += 1
        return numel, tensors


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """One FSDP unit: what it owns, how it is laid out, how it runs.

    ``flats`` are its flat parameters (one, unless the unit mixes frozen and
    trainable parameters or dtypes).  ``layout`` and ``dtype`` are the first
    one's (the trainable one if any: what torch's ``_flat_param`` shows);
    sizes and bytes over the whole unit are sums over ``flats``.
    """

    fqn: str  # clean FQN of the wrapped module ("" for the root)
    module_type: str
    flats: tuple[FlatPlan, ...]

    @property
    def params(self) -> tuple[ParamEntry, ...]:
        return tuple(e for f in self.flats for e in f.params)

    @property
    def layout(self) -> FlatLayout:
        return self.flats[0].layout

    @property
    def dtype(self) -> torch.dtype:
        return self.flats[0].dtype

    @property
    def numel(self) -> int:
        """Parameters this unit owns (without padding)."""
        return sum(f.numel for f in self.flats)

    @property
    def trainable(self) -> bool:
        return any(f.requires_grad for f in self.flats)

    @property
    def strategy(self) -> ShardingStrategy:
        return self.flats[0].strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self.flats[0].mixed_precision

    @property
    def offload_params(self) -> bool:
        return self.flats[0].offload_params

    @property
    def use_orig_params(self) -> bool:
        return self.flats[0].use_orig_params

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy in RESHARD_AFTER_FORWARD

    @property
    def shard_bytes(self) -> int:
        """Bytes of this unit's shards on one rank (every flat parameter, own dtype)."""
        return sum(f.layout.shard_numel * f.dtype.itemsize for f in self.flats)

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of this unit's unsharded (padded) flat parameters, own dtypes."""
        return sum(f.layout.padded_numel * f.dtype.itemsize for f in self.flats)

    def optimizer_numel(self, rank: int) -> tuple[int, int]:
        """``(elements, tensors)`` the optimizer sees on ``rank`` for this unit
        (:meth:`FlatPlan.optimizer_numel` summed; frozen flat parameters: none)."""
        numel = tensors = 0
        for f in self.flats:
            n, t = f.optimizer_numel(rank)
            numel, tensors = numel + n, tensors + t
        return numel, tensors


class _RecordedUnit(nn.Module):
    """Takes the place of the FSDP class in the wrap pass: keeps the module and kwargs."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.wrapped = module
        self.kwargs = kwargs


def meta_copy(model: nn.Module) -> tuple[nn.Module, dict[int, Any]]:
    """A deep copy of ``model`` with every parameter and buffer on the meta device.

    Ties survive (one meta tensor per original tensor).  Returns the copy and
    the memo mapping ``id(original)`` to its copy (modules included).
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        # (a DTensor parameter, tensor parallelism: its local shape, what a rank flattens)
        shape = p.to_local().shape if is_dtensor(p) else p.shape  # type: ignore[attr-defined]
        shadow_p = nn.Parameter(
            torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
        )
        if is_quantized(p):
            # What the flat parameter needs to know of a 4-bit weight, kept on
            # the meta stand-in (its quantization state is not copied).
            shadow_p.bnb_quantized = True  # type: ignore[attr-defined]
            shadow_p.plan_quant = quant_info(p)  # type: ignore[attr-defined]
        memo[id(p)] = shadow_p
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    shadow = copy.deepcopy(model, memo)
    return shadow, memo


def quant_info(param: nn.Parameter) -> tuple[int, int]:
    """``(logical elements, quantization-state bytes)`` of a bitsandbytes 4-bit weight.

    The packed storage (``param`` itself) is what the flat parameter shards;
    the state (block scales, the code book, a nested state for double
    quantization) stays on the Parameter object, whole on every rank.
    """
    state = getattr(param, "quant_state", None)
    if state is None:
        return param.numel(), 0
    shape = getattr(state, "shape", None)
    numel = int(torch.Size(shape).numel()) if shape is not None else param.numel()
    return numel, _tensor_bytes(state, set())


def _tensor_bytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the tensors an object holds in its attributes (nested objects too)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    attrs = getattr(obj, "__dict__", None)
    if attrs is None or isinstance(obj, (type, torch.dtype)):
        return 0
    return sum(_tensor_bytes(v, seen) for v in attrs.values())


def discover_units(
    model: nn.Module,
    *,
    shard_size: int,
    sharding_strategy: Any = None,
    auto_wrap_policy: Any = None,
    cpu_offload: Any = None,
    mixed_precision: Any = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    ignored_states: Iterable[Any] | None = None,
    use_orig_params: bool = False,
) -> tuple[list[UnitPlan], list[tuple[str, int, torch.dtype, bool]]]:
    """Every unit FSDP(model, ...) would build over a shard group of ``shard_size`` ranks,
    and the ignored parameters ``(fqn, numel, dtype, requires_grad)`` (held in full).

    Root first, then the auto-wrapped units in module order, parents before
    their nested units (the order a forward usually runs them in).
    """
    strategy = coerce_enum(sharding_strategy, ShardingStrategy, "sharding_strategy")
    root_kwargs: dict[str, Any] = dict(
        sharding_strategy=strategy or ShardingStrategy.FULL_SHARD,
        cpu_offload=coerce_dataclass(cpu_offload, CPUOffload, "cpu_offload"),
        mixed_precision=coerce_dataclass(mixed_precision, MixedPrecision, "mixed_precision"),
        use_orig_params=use_orig_params,
        auto_wrap_policy=auto_wrap_policy,
    )
    shadow, memo = meta_copy(model)
    ignored_mods = [memo.get(id(m), m) for m in ignored_modules] if ignored_modules else None
    ignored_sts = [memo.get(id(s), s) for s in ignored_states] if ignored_states else None
    mods, ignored_params = resolve_ignored(shadow, ignored_mods, ignored_sts)
    if auto_wrap_policy is not None:
        _auto_wrap(shadow, auto_wrap_policy, mods, ignored_params, dict(root_kwargs),
                   _RecordedUnit)

    def stop(m: nn.Module) -> bool:
        return isinstance(m, _RecordedUnit) or m in mods

    units: list[UnitPlan] = []
    found: list[tuple[str, nn.Module, dict[str, Any]]] = [("", shadow, root_kwargs)]
    found += _recorded(shadow)
    for fqn, module, kwargs in found:
        plan = _unit_plan(fqn, module, kwargs, stop, ignored_params, shard_size)
        if plan is not None:
            units.append(plan)
    ignored = [(n, p.numel(), p.dtype, p.requires_grad)
               for n, p in shadow.named_parameters() if p in ignored_params]
    return units, ignored


def _recorded(root: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module, dict[str, Any]]]:
    """``(clean fqn, wrapped module, kwargs)`` of every recorded unit under ``root``."""
    out: list[tuple[str, nn.Module, dict[str, Any]]] = []
    for name, child in root.named_children():
        fqn = f"{prefix}{name}"
        if isinstance(child, _RecordedUnit):
            out.append((fqn, child.wrapped, child.kwargs))
            out += _recorded(child.wrapped, f"{fqn}.")
        else:
            out += _recorded(child, f"{fqn}.")
    return out


def _late_param_ids(module: nn.Module, stop: Any) -> set[int]:
    """``id`` of each parameter of ``module``'s own modules met after its first
    nested unit, in module order (the order a forward usually runs them in)."""
    late: set[int] = set()
    after = False

    def visit(m: nn.Module) -> None:
        nonlocal after
        if after:
            late.update(id(p) for p in m._parameters.values() if p is not None)
        for child in m._modules.values():
            if child is None:
                continue
            if isinstance(child, _RecordedUnit):
                after = True
            elif not stop(child):
                visit(child)

    visit(module)
    return late


def _unit_plan(
    fqn: str,
    module: nn.Module,
    kwargs: dict[str, Any],
    stop: Any,
    ignored_params: set[nn.Parameter],
    shard_size: int,
) -> UnitPlan | None:
    params, shared = collect_unit_params(module, stop, ignored_params)
    late = _late_param_ids(module, stop)
    if not params:
        return None
    strategy = coerce_enum(kwargs.get("sharding_strategy"), ShardingStrategy, "sharding_strategy")
    strategy = strategy or ShardingStrategy.FULL_SHARD
    if shard_size == 1:
        strategy = ShardingStrategy.NO_SHARD  # what the constructor switches to
    mp = coerce_dataclass(kwargs.get("mixed_precision"), MixedPrecision, "mixed_precision")
    mp = mp or MixedPrecision()
    offload = coerce_dataclass(kwargs.get("cpu_offload"), CPUOffload, "cpu_offload")
    uop = bool(kwargs.get("use_orig_params", False))
    # What the constructor refuses (scalars, integers, a cast of packed
    # quantized weights), with its messages.
    where = f"(planned FSDP unit '{fqn or '<root>'}')"
    check_unit_params(params, where, uop)
    check_quantized_storage(params, mp.param_dtype, where)
    prefix = f"{fqn}." if fqn else ""
    flats = []
    # The runtime's own grouping: one flat parameter per (requires_grad, dtype).
    for group, group_shared in split_unit_params(params, shared):
        dtype = group[0][3].dtype
        quant = [getattr(p, "plan_quant", None) or quant_info(p)
                 for *_, p in group if is_quantized(p)]
        flats.append(FlatPlan(
            params=tuple(ParamEntry(prefix + name, p.numel(), p.requires_grad)
                         for name, *_, p in group),
            layout=FlatLayout.build(
                [p.numel() for *_, p in group],
                align=alignment(mp.param_dtype or dtype, uop),
                world_size=shard_size,
                sharded=strategy in SHARDED,
            ),
            dtype=dtype,
            requires_grad=group[0][3].requires_grad,
            strategy=strategy,
            mixed_precision=mp,
            offload_params=bool(offload and offload.offload_params),
            use_orig_params=uop,
            shared_numel=sum(group[index][3].numel() for *_, index in group_shared),
            late_numel=sum(p.numel() for *_, p in group if id(p) in late),
            quantized_numels=tuple(n for n, _ in quant),
            quant_state_bytes=sum(b for _, b in quant),
        ))
    return UnitPlan(fqn=fqn, module_type=type(module).__name__, flats=tuple(flats))
