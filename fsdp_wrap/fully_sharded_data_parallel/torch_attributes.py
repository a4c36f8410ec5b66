"""The attributes code written for torch's FSDP1 reads on an FSDP module.

torch's FSDP1 module *is* its state: frameworks, torch's own tests and DCP's
helpers read ``module.sharding_strategy``, ``module._handle``,
``module.training_state``, ``module._is_root`` and the like.  fsdp_wrap keeps
a unit's state in a plain object (:class:`~fsdp_wrap.runtime.state.UnitState`,
the façade's ``_fsdp_state``); the names below are properties of the façade
that read it (and, for the run-time controls code may set, write it).  None
is stored twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.nn as nn

if TYPE_CHECKING:
    from fsdp_wrap.runtime.state import UnitState

__all__ = ["TorchAttributes"]


def _setting(name: str, doc: str) -> Any:
    """A read-only attribute of the unit's settings."""
    return property(lambda self: getattr(self._fsdp_state.settings, name), doc=doc)


def _state(name: str, doc: str, writable: bool = False) -> Any:
    """An attribute of the unit's state (settable where code written for torch sets it)."""

    def get(self: Any) -> Any:
        return getattr(self._fsdp_state, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self._fsdp_state, name, value)

    return property(get, set_ if writable else None, doc=doc)


class TorchAttributes:
    """torch's FSDP1 attribute names on the façade, reading its unit's state."""

    _fsdp_state: UnitState

    # options (settings: read-only, resolved at construction)
    sharding_strategy = _setting("strategy", "The unit's ``ShardingStrategy``.")
    mixed_precision = _setting("mixed_precision", "The unit's ``MixedPrecision``.")
    cpu_offload = _setting("cpu_offload", "The unit's ``CPUOffload``.")
    backward_prefetch = _setting("backward_prefetch", "The unit's ``BackwardPrefetch``.")
    forward_prefetch = _setting("forward_prefetch", "Whether the unit prefetches in forward.")
    limit_all_gathers = _setting("limit_all_gathers", "torch's ``limit_all_gathers``.")
    _use_orig_params = _setting("use_orig_params", "torch's ``use_orig_params``.")
    _use_full_prec_in_eval = _setting("use_full_prec_in_eval", "FSDP_USE_FULL_PREC_IN_EVAL.")
    _sync_module_states = _setting("sync_module_states", "torch's ``sync_module_states``.")
    _quantize = _setting("quantize", "The resolved ``quantize_collectives``.")
    _wire = _setting("wire", "How the unit's collectives move their bytes.")
    # groups
    process_group = _setting("process_group", "The group the unit shards over.")
    rank = _setting("rank", "This rank in ``process_group``.")
    world_size = _setting("world_size", "The size of ``process_group``.")
    compute_device = _setting("device", "The device the unit computes on.")
    _device_mesh = _setting("device_mesh", "The ``device_mesh`` the unit was given.")
    _inter_node_pg = _setting("inter_node_pg", "The hybrid strategies' replicate group.")

    @property
    def _gradient_predivide_factor(self) -> float:
        return self._fsdp_state.settings.divide.pre

    @property
    def _gradient_postdivide_factor(self) -> float:
        return self._fsdp_state.settings.divide.post

    # run-time state
    training_state = _state("training_state", "The unit's ``TrainingState``.", writable=True)
    _is_root = _state("_is_root", "Whether the unit is its tree's root (None before lazy init).",
                      writable=True)
    _sync_gradients = _state("_sync_gradients", "False inside ``no_sync()``.", writable=True)
    _state_dict_type = _state("_state_dict_type", "The state-dict type.", writable=True)
    _state_dict_config = _state("_state_dict_config", "The state-dict config.", writable=True)
    _optim_state_dict_config = _state("_optim_state_dict_config",
                                      "The optimizer state-dict config.", writable=True)
    _comm_hook = _state("_comm_hook", "The registered communication hook.", writable=True)
    _comm_hook_state = _state("_comm_hook_state", "The communication hook's state.",
                              writable=True)
    _handles = _state("_handles", "The unit's flat parameters' handles.")
    _ignored_modules = _state("_ignored_modules", "The ignored modules.")
    _ignored_params = _state("_ignored_params", "The ignored parameters.")
    _buffer_orig_dtypes = _state("_buffer_orig_dtypes", "Cast buffers' original dtypes.")
    # the tree (meaningful on the root)
    _all_handles = _state("_all_handles", "(root) Every handle of the tree.")
    _exec_order = _state("_exec_order", "(root) The recorded execution order.")
    _grad_buckets = _state("_grad_buckets", "(root) The gradient buckets.")

    @property
    def _handle(self) -> Any:
        """The unit's first flat parameter's handle (torch's one-handle name,
        which frameworks read); a unit with several flat parameters has them
        all in ``_handles``."""
        handles = self._fsdp_state._handles
        return handles[0] if handles else None

    @property
    def _has_params(self) -> bool:
        return bool(self._fsdp_state._handles)

    @property
    def _flat_param(self) -> nn.Parameter | None:
        handle = self._handle
        return handle.flat_param if handle is not None else None

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's flat parameters."""
        return [h.flat_param for h in self._fsdp_state._handles]

    @property
    def _all_fsdp_states(self) -> list[nn.Module]:
        """(root) Every unit of the tree, as modules (torch's list)."""
        return [st.module for st in self._fsdp_state._all_fsdp_states]

    @property
    def _root(self) -> nn.Module:
        """The root unit of this unit's tree (itself before lazy init)."""
        return self._fsdp_state._root.module
