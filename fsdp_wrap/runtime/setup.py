"""The constructor's steps, in order: groups, the wire, the unit's settings
(every option resolved once, :func:`resolve_settings`), its state, its module
placed, its handles.

``FullyShardedDataParallel.__init__`` calls them one after the other
(arguments are checked first, before any collective); the helpers they use
live in :mod:`fsdp_wrap.runtime.construct`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.runtime.capability as capability
import fsdp_wrap.runtime.construct as construct
import fsdp_wrap.runtime.guards as guards
from fsdp_wrap.api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from fsdp_wrap.comm.bucket import GradBuckets
from fsdp_wrap.comm.quant.config import QuantSpec
from fsdp_wrap.comm.quant.wire import Wire, build_wire
from fsdp_wrap.handle.config import UnitSettings
from fsdp_wrap.handle.flat_param import FlatParamHandle
from fsdp_wrap.handle.flat_tensor import FLAT_PARAM_NAME
from fsdp_wrap.handle.layout import (
    check_quantized_storage,
    check_unit_params,
    collect_unit_params,
    keep_quantized_layout,
    split_unit_params,
)
from fsdp_wrap.runtime.exec_order import ExecOrder
from fsdp_wrap.runtime.state import UnitState, is_unit

__all__ = [
    "check_machine",
    "init_process_groups",
    "init_wire",
    "resolve_settings",
    "new_unit_state",
    "place_module",
    "build_handle",
]


def check_machine(
    module: nn.Module, device_id: Any, mixed_precision: MixedPrecision | None, ignored: set[Any],
) -> torch.device:
    """The device the unit will compute on, once this machine is known to have
    it and to compute in ``mixed_precision``'s dtypes (no collective)."""
    device = capability.check_device_id(device_id)
    if device is None:
        device = next(
            (p.device for p in module.parameters() if p not in ignored and not p.is_meta),
            torch.device("cpu"),
        )
    capability.check_mixed_precision(mixed_precision, device)
    return device


def init_process_groups(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy,
    auto_wrap: bool, device: torch.device | None = None,
) -> tuple[construct.ProcessGroupState, Any]:
    """The unit's groups, and what the children made by auto-wrapping get as
    ``process_group`` (a hybrid unit's children share its groups).
    ``device``: the compute device, which the groups' backends must carry.
    """
    pg_state = construct.resolve_process_group(process_group, device_mesh, strategy, auto_wrap)
    if device is not None:
        arg = "device_mesh" if device_mesh is not None else "process_group"
        capability.check_group_device([pg_state.group, pg_state.replicate_group], device, arg)
        capability.check_mesh_device(device_mesh, device)
    if pg_state.replicate_group is not None and device_mesh is None:
        process_group = (pg_state.group, pg_state.replicate_group)
    return pg_state, process_group


def init_wire(quant: QuantSpec | None, pg_state: construct.ProcessGroupState,
              strategy: ShardingStrategy, module: nn.Module) -> Wire:
    """How the unit's collectives move their bytes (``quantize_collectives``):
    checked here, before the handle is built and before any collective of
    the unit (it may create sub-groups for a group spanning nodes)."""
    label = f"[rank {C.global_rank()}] FSDP unit of {type(module).__name__}: "
    return build_wire(
        quant, pg_state.group,
        pg_state.replicate_group if pg_state.replicate_size > 1 else None,
        hybrid=strategy in HYBRID_STRATEGIES, label=label)


def resolve_settings(
    module: nn.Module, pg_state: construct.ProcessGroupState, device_mesh: Any,
    device_id: Any, ignored: tuple[set[nn.Module], set[nn.Parameter]], *,
    strategy: ShardingStrategy, cpu_offload: CPUOffload | None,
    mixed_precision: MixedPrecision | None, backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool, limit_all_gathers: bool, use_orig_params: bool,
    sync_module_states: bool, quant: QuantSpec | None, wire: Wire,
) -> UnitSettings:
    """Every option of the unit, resolved once into its one settings object:
    the strategy clamped to what the world size allows, the compute device
    found (``device_id``, else the unit's own tensors' device), the
    gradient divide factors from the number of ranks a gradient is averaged
    over."""
    ignored_modules, ignored_params = ignored
    stop = _stops_walk(ignored_modules)
    return UnitSettings(
        device=construct.resolve_device(module, device_id, stop, ignored_params),
        strategy=construct.clamp_strategy(strategy, pg_state.world_size),
        process_group=pg_state.group,
        rank=pg_state.rank,
        world_size=pg_state.world_size,
        use_orig_params=use_orig_params,
        divide=C.divide_factors(pg_state.world_size * pg_state.replicate_size),
        mixed_precision=mixed_precision or MixedPrecision(),
        cpu_offload=cpu_offload or CPUOffload(),
        replicate_group=pg_state.replicate_group if pg_state.replicate_size > 1 else None,
        inter_node_pg=pg_state.replicate_group,
        device_mesh=device_mesh,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        limit_all_gathers=limit_all_gathers,
        use_full_prec_in_eval=os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1",
        sync_module_states=sync_module_states,
        quantize=quant,
        wire=wire,
    )


def new_unit_state(facade: nn.Module, module: nn.Module, settings: UnitSettings,
                   ignored: tuple[set[nn.Module], set[nn.Parameter]], bucket_cap_mb: float,
                   batch_mb: float) -> UnitState:
    """The unit's state, idle, before lazy init makes a root; FSDP1's default
    state-dict type (``FULL_STATE_DICT``)."""
    state = UnitState(
        facade, module, settings, *ignored,
        buckets=GradBuckets(int(bucket_cap_mb * 1024 * 1024)),
        exec_order=ExecOrder(),
        batch_bytes=int(batch_mb * 1024 * 1024),
    )
    state._state_dict_type = StateDictType.FULL_STATE_DICT
    state._state_dict_config = FullStateDictConfig()
    state._optim_state_dict_config = FullOptimStateDictConfig()
    return state


def _stops_walk(ignored: set[nn.Module]) -> Any:
    """The modules a unit's walk does not enter: child units and ignored modules."""
    return lambda m: is_unit(m) or m in ignored


def place_module(state: UnitState, param_init_fn: Any) -> None:
    """The unit's own tensors materialised, on the compute device, and (with
    ``sync_module_states``) the same on every rank as on rank 0."""
    module, settings = state.wrapped_module, state.settings
    stop, ignored = _stops_walk(state._ignored_modules), state._ignored_params
    state._built_from_meta = construct.materialize_meta(
        module, stop, ignored, param_init_fn, settings.device, settings.rank
    )
    construct.move_to_device(module, settings.device, stop, ignored)
    if settings.sync_module_states:
        groups = [g for g in (settings.inter_node_pg, settings.process_group) if g is not None]
        construct.sync_module_states(module, stop, ignored, groups)


def build_handle(state: UnitState) -> None:
    """Flatten the unit's own parameters into its :class:`FlatParamHandle` s:
    none for a unit without parameters, one per ``(requires_grad, dtype)``
    group otherwise (``handle.layout.split_unit_params``; docs/fine_tuning.rst).
    Every handle holds the unit's settings object."""
    module, settings = state.wrapped_module, state.settings
    params, shared = collect_unit_params(module, _stops_walk(state._ignored_modules),
                                         state._ignored_params)
    construct.check_no_cross_unit_sharing(module, params, settings.rank)
    if params:
        where = f"(rank {settings.rank}, FSDP unit '<root>')"
        check_unit_params(params, where, settings.use_orig_params)
        check_quantized_storage(params, settings.param_dtype, where)
        keep_quantized_layout(params)
        for i, (group, group_shared) in enumerate(split_unit_params(params, shared)):
            name = FLAT_PARAM_NAME if i == 0 else f"{FLAT_PARAM_NAME}_{i}"
            # (FQNs set at lazy init)
            state._handles.append(FlatParamHandle(module, group, group_shared, settings,
                                                  flat_name=name))
    guards.mark_unit_params(state)
    guards.install_optimizer_check()
