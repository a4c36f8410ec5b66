"""The constructor's steps after the unit's settings are resolved
(:mod:`fsdp_wrap.runtime.settings`): the machine checked, the unit's state,
its module placed, its handles.

``FullyShardedDataParallel.__init__`` calls them one after the other
(arguments are checked first, before any collective); the helpers they use
live in :mod:`fsdp_wrap.runtime.construct`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import fsdp_wrap.runtime.capability as capability
import fsdp_wrap.runtime.construct as construct
import fsdp_wrap.runtime.guards as guards
from fsdp_wrap.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    StateDictType,
)
from fsdp_wrap.comm.bucket import GradBuckets
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
