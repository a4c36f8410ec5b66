"""What every FSDP unit carries, as one typed object (torch's ``_FSDPState`` idea).

:class:`FullyShardedDataParallel` inherits :class:`UnitState`; the layers below
the façade (runtime, state dicts, optimizer state, summon, checkpoints) receive
a ``UnitState`` and ask "is this a unit" with :func:`is_unit`, never importing
the façade.  The attributes are set by the façade's constructor (construction
order: :mod:`fsdp_wrap.runtime.construct`) and at lazy init
(:mod:`fsdp_wrap.runtime.tree`).
"""

from __future__ import annotations

import weakref
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from fsdp_wrap.api import (
        BackwardPrefetch,
        CPUOffload,
        MixedPrecision,
        OptimStateDictConfig,
        ShardingStrategy,
        StateDictConfig,
        StateDictType,
    )
    from fsdp_wrap.comm.bucket import GradBuckets
    from fsdp_wrap.comm.quant.config import QuantSpec
    from fsdp_wrap.comm.quant.wire import Wire
    from fsdp_wrap.handle.flat_param import FlatParamHandle
    from fsdp_wrap.runtime.exec_order import ExecOrder

__all__ = ["TrainingState", "UnitState", "is_unit", "live_units", "register_unit"]


class TrainingState(Enum):
    """What an FSDP instance is doing (same members and values as torch's)."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


class UnitState(nn.Module):
    """The state of one FSDP unit; declared here, set by the façade.

    A module (the façade is one): lower layers may register hooks on it and
    walk its tree.

    Per unit: the wrapped module, the handles of its flat parameters (none for
    a unit without parameters; several where the unit mixes dtypes or frozen
    and trainable parameters, trainable first), its process groups and
    options.  Per tree,
    kept on the root only: every unit and handle (``_all_fsdp_states``,
    ``_all_handles``, ``_state_of``), the execution order, the gradient buckets.
    """

    # the wrapped module and its flat parameter
    _fsdp_wrapped_module: nn.Module
    _handles: list[FlatParamHandle]
    params: list[nn.Parameter]
    _ignored_modules: set[nn.Module]
    _ignored_params: set[nn.Parameter]
    _buffer_orig_dtypes: dict[str, torch.dtype]  # clean FQN under the unit -> dtype
    # process groups
    process_group: Any
    rank: int
    world_size: int
    _device_mesh: Any
    _inter_node_pg: Any  # HYBRID_SHARD's replicate group, else None
    _gradient_predivide_factor: float
    _gradient_postdivide_factor: float
    compute_device: torch.device
    # options
    sharding_strategy: ShardingStrategy
    cpu_offload: CPUOffload
    mixed_precision: MixedPrecision
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    _use_orig_params: bool
    _use_full_prec_in_eval: bool
    _sync_module_states: bool
    _comm_hook: Callable[..., Any] | None
    _quantize: QuantSpec | None  # quantize_collectives, resolved
    _wire: Wire  # how the unit's collectives move bytes (fsdp_wrap.comm.quant.wire)
    _comm_hook_state: object
    # state-dict settings
    _state_dict_type: StateDictType
    _state_dict_config: StateDictConfig
    _optim_state_dict_config: OptimStateDictConfig
    # runtime flags
    training_state: TrainingState
    _sync_gradients: bool
    _ran_pre_backward: bool
    _final_callback_queued: bool
    _forward_pending_backward: bool
    _frozen_open_graphs: int  # forwards whose frozen flat parameters await their backward
    _grad_inputs: list[weakref.ref[torch.Tensor]]  # the last forward's inputs that require grad
    _hooked_handles: set[FlatParamHandle]  # flat parameters whose gradient hooks are registered
    _buffers_in_full_precision: bool
    _optims_in_backward: bool
    # accumulation controls (fsdp_wrap.runtime.accumulation)
    _reshard_after_backward: bool | None  # None: FSDP1's rule
    _is_last_backward: bool  # (the root's counts)
    _replicas_checked: bool  # (root) replicas compared at the first forward (runtime.guards)
    _built_from_meta: bool  # this rank materialised the unit from the meta device
    # FSDP2's explicit controls, once one is set: an ExplicitControls of
    # fsdp_wrap.runtime.explicit.controls (which imports this module)
    _explicit: Any = None
    # the tree (root bookkeeping)
    _is_root: bool | None  # None until lazy init
    _root: UnitState
    _all_fsdp_states: list[UnitState]
    _all_handles: list[FlatParamHandle]
    _state_of: dict[FlatParamHandle, UnitState]
    _exec_order: ExecOrder
    _grad_buckets: GradBuckets
    _all_gather_batch_bytes: int

    @property
    def _handle(self) -> FlatParamHandle | None:
        """The unit's first flat parameter's handle (torch's one-handle name,
        which frameworks read); the library itself walks ``_handles``."""
        handles = self.__dict__.get("_handles")
        return handles[0] if handles else None


def is_unit(module: object) -> bool:
    """Is ``module`` an FSDP unit (an instance of the façade)?"""
    return isinstance(module, UnitState)


# Every unit built in this process, held weakly (a dropped model is freed): the
# framework glue finds the unit tree a module given to it lives in, which a
# module cannot tell (it has no parent pointer).
_LIVE: weakref.WeakSet[UnitState] = weakref.WeakSet()


def register_unit(state: UnitState) -> None:
    _LIVE.add(state)


def live_units() -> list[UnitState]:
    """The units built in this process that are still alive."""
    return list(_LIVE)
