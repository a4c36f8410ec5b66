"""The constructor's steps, in order: each sets one group of a unit's
:class:`~fsdp_wrap.runtime.state.UnitState` attributes.

``FullyShardedDataParallel.__init__`` calls them one after the other
(arguments are checked first, before any collective); the helpers they use
live in :mod:`fsdp_wrap.runtime.construct`.
"""

from __future__ import annotations

import os
import warnings
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
from fsdp_wrap.comm.quant.wire import build_wire, ineffective
from fsdp_wrap.handle.config import HandleConfig
from fsdp_wrap.handle.flat_param import FlatParamHandle
from fsdp_wrap.handle.flat_tensor import FLAT_PARAM_NAME
from fsdp_wrap.handle.layout import (
    check_quantized_storage,
    check_unit_params,
    collect_unit_params,
    keep_quantized_layout,
    split_unit_params,
)
from fsdp_wrap.runtime.agreement import in_auto_wrap
from fsdp_wrap.runtime.exec_order import ExecOrder
from fsdp_wrap.runtime.state import TrainingState, UnitState, is_unit

__all__ = [
    "check_machine",
    "init_process_groups",
    "init_wire",
    "init_settings",
    "init_runtime_state",
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
    state: UnitState, process_group: Any, device_mesh: Any, strategy: ShardingStrategy,
    auto_wrap: bool, device: torch.device | None = None,
) -> tuple[construct.ProcessGroupState, Any]:
    """The unit's groups and gradient divide factors.

    Returns the groups' state and what the children made by auto-wrapping get
    as ``process_group`` (a hybrid unit's children share its groups).
    ``device``: the compute device, which the groups' backends must carry.
    """
    pg_state = construct.resolve_process_group(process_group, device_mesh, strategy, auto_wrap)
    if device is not None:
        arg = "device_mesh" if device_mesh is not None else "process_group"
        capability.check_group_device([pg_state.group, pg_state.replicate_group], device, arg)
        capability.check_mesh_device(device_mesh, device)
    state.process_group = pg_state.group
    state.rank = pg_state.rank
    state.world_size = pg_state.world_size
    state._device_mesh = device_mesh
    state._inter_node_pg = pg_state.replicate_group
    divide = C.divide_factors(state.world_size * pg_state.replicate_size)
    state._gradient_predivide_factor, state._gradient_postdivide_factor = divide
    if pg_state.replicate_group is not None and device_mesh is None:
        process_group = (pg_state.group, pg_state.replicate_group)
    return pg_state, process_group


def init_wire(state: UnitState, quant: QuantSpec | None, pg_state: construct.ProcessGroupState,
              strategy: ShardingStrategy, module: nn.Module) -> None:
    """How the unit's collectives move their bytes (``quantize_collectives``):
    checked here, before the handle is built and before any collective of
    the unit (it may create sub-groups for a group spanning nodes)."""
    label = f"[rank {C.global_rank()}] FSDP unit of {type(module).__name__}: "
    state._quantize = quant
    replicas = pg_state.replicate_group if pg_state.replicate_size > 1 else None
    kinds = dict(hybrid=strategy in HYBRID_STRATEGIES,
                 gathers=strategy is not ShardingStrategy.NO_SHARD)
    state._wire = build_wire(quant, pg_state.group, replicas, label=label, **kinds)
    if not in_auto_wrap():  # (once per tree: the children share the root's groups)
        for why in ineffective(quant, state._wire, pg_state.group, replicas, **kinds):
            warnings.warn(f"{label}quantize_collectives (or $FSDP_WRAP_QUANTIZE_COLLECTIVES) "
                          f"{quant}: {why}", stacklevel=3)


def init_settings(
    state: UnitState, strategy: ShardingStrategy, cpu_offload: CPUOffload | None,
    mixed_precision: MixedPrecision | None, backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool, limit_all_gathers: bool, use_orig_params: bool,
    sync_module_states: bool,
) -> None:
    """The unit's options (the strategy clamped to what its world size allows)."""
    state.sharding_strategy = construct.clamp_strategy(strategy, state.world_size)
    state.cpu_offload = cpu_offload or CPUOffload()
    state.mixed_precision = mixed_precision or MixedPrecision()
    state.backward_prefetch = backward_prefetch
    state.forward_prefetch = forward_prefetch
    state.limit_all_gathers = limit_all_gathers
    state._use_orig_params = use_orig_params
    state._use_full_prec_in_eval = os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1"
    state._sync_module_states = sync_module_states
    state._comm_hook = None
    state._comm_hook_state = None
    state._state_dict_type = StateDictType.FULL_STATE_DICT
    state._state_dict_config = FullStateDictConfig()
    state._optim_state_dict_config = FullOptimStateDictConfig()


def init_runtime_state(state: UnitState, bucket_cap_mb: float, batch_mb: float) -> None:
    """Training flags and the tree's bookkeeping, before lazy init makes a root."""
    state.training_state = TrainingState.IDLE
    state._buffers_in_full_precision = False  # (root) see hooks._buffers_for_eval
    state._optims_in_backward = False  # set at lazy init (_apply_optimizer_in_backward)
    state._is_root = None
    # Plain attribute, not a submodule: the root is not a child of its units.
    object.__setattr__(state, "_root", state)
    state._sync_gradients = True
    state._reshard_after_backward = None
    state._is_last_backward = True
    state._ran_pre_backward = False
    state._final_callback_queued = False
    state._forward_pending_backward = False
    state._frozen_open_graphs = 0
    state._grad_inputs = []
    state._hooked_handles = set()
    state._exec_order = ExecOrder()
    # Used at the root only (the root's value counts for the whole tree).
    state._grad_buckets = GradBuckets(int(bucket_cap_mb * 1024 * 1024))
    state._all_gather_batch_bytes = int(batch_mb * 1024 * 1024)
    state._all_fsdp_states = []
    state._all_handles = []
    state._state_of = {}
    # Original dtypes of buffers cast to ``buffer_dtype`` (clean FQN under the
    # wrapped module -> dtype); state dicts save them in these dtypes.
    state._buffer_orig_dtypes = {}
    state._replicas_checked = False  # (root) guards.check_replicas, at the first forward
    state._built_from_meta = False


def _stops_walk(state: UnitState) -> Any:
    """The modules a unit's walk does not enter: child units and ignored modules."""
    ignored = state._ignored_modules
    return lambda m: is_unit(m) or m in ignored


def place_module(
    state: UnitState, module: nn.Module, device_id: Any, param_init_fn: Any,
    sync_module_states: bool,
) -> None:
    """The unit's own tensors materialised, on the compute device, and (if
    asked) the same on every rank as on rank 0."""
    stop, ignored = _stops_walk(state), state._ignored_params
    state.compute_device = construct.resolve_device(module, device_id, stop, ignored)
    state._built_from_meta = construct.materialize_meta(
        module, stop, ignored, param_init_fn, state.compute_device, state.rank
    )
    construct.move_to_device(module, state.compute_device, stop, ignored)
    if sync_module_states:
        groups = [g for g in (state._inter_node_pg, state.process_group) if g is not None]
        construct.sync_module_states(module, stop, ignored, groups)


def build_handle(
    state: UnitState, module: nn.Module, pg_state: construct.ProcessGroupState
) -> None:
    """Flatten the unit's own parameters into its :class:`FlatParamHandle` s:
    none for a unit without parameters, one per ``(requires_grad, dtype)``
    group otherwise (``handle.layout.split_unit_params``; docs/fine_tuning.rst)."""
    params, shared = collect_unit_params(module, _stops_walk(state), state._ignored_params)
    construct.check_no_cross_unit_sharing(module, params, state.rank)
    state._handles = []
    if params:
        where = f"(rank {state.rank}, FSDP unit '<root>')"
        check_unit_params(params, where, state._use_orig_params)
        mp = state.mixed_precision
        check_quantized_storage(params, mp.param_dtype, where)
        keep_quantized_layout(params)
        config = HandleConfig(
            device=state.compute_device,
            strategy=state.sharding_strategy,
            process_group=state.process_group,
            rank=state.rank,
            world_size=state.world_size,
            use_orig_params=state._use_orig_params,
            divide=C.DivideFactors(
                state._gradient_predivide_factor, state._gradient_postdivide_factor
            ),
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            keep_low_precision_grads=mp.keep_low_precision_grads,
            offload_params=state.cpu_offload.offload_params,
            replicate_group=state._inter_node_pg if pg_state.replicate_size > 1 else None,
            limit_all_gathers=state.limit_all_gathers,
            use_full_prec_in_eval=state._use_full_prec_in_eval,
            wire=state._wire,
        )
        for i, (group, group_shared) in enumerate(split_unit_params(params, shared)):
            name = FLAT_PARAM_NAME if i == 0 else f"{FLAT_PARAM_NAME}_{i}"
            # (FQNs set at lazy init)
            state._handles.append(FlatParamHandle(module, group, group_shared, config,
                                                  flat_name=name))
    state.params = [h.flat_param for h in state._handles]
    guards.mark_unit_params(state)
    guards.install_optimizer_check()
