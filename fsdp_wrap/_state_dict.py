"""Model state dicts and the unshard-for-summon machinery they share.

``state_dict()`` and ``load_state_dict()`` stay ``nn.Module``'s; hooks on each
FSDP unit adapt them:

* save, FULL: the pre-hook gathers the unit and registers its original
  parameters (full shapes) in place of the flat parameter, so ``nn.Module``
  emits them in the unwrapped model's key order; the post-hook clones the
  unit's values (to CPU if asked, dropped off rank 0 under ``rank0_only``),
  removes ``_fsdp_wrapped_module.`` from the keys and frees the unit again.
  Units are gathered one nested level at a time.
* load, FULL: the pre-hook gathers the unit and re-prefixes the keys; after
  ``nn.Module`` copies into the full views, the post-hook writes this rank's
  part back into the shard, frees the unit, and cleans the names in the
  missing/unexpected key lists.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from . import _compat
from ._flat_param import walk_unit_modules
from ._runtime import TrainingState
from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

WRAPPED = "_fsdp_wrapped_module."

_CONFIG_CLASSES: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


# ------------------------------------------------------------- settings


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: Any,
    state_dict_config: StateDictConfig | None,
    optim_state_dict_config: OptimStateDictConfig | None,
) -> StateDictSettings:
    """Set the type and configs on every FSDP unit in ``module``; return the previous ones."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    sd_type = _compat.coerce_enum(state_dict_type, StateDictType, "state_dict_type")
    if sd_type is None:
        raise TypeError("state_dict_type must be a StateDictType member, not None")
    cfg_cls, optim_cls = _CONFIG_CLASSES[sd_type]
    cfg = _compat.coerce_dataclass(state_dict_config, cfg_cls, "state_dict_config") if (
        state_dict_config is not None and type(state_dict_config).__name__ == cfg_cls.__name__
    ) else state_dict_config
    optim_cfg = _compat.coerce_dataclass(
        optim_state_dict_config, optim_cls, "optim_state_dict_config"
    ) if (
        optim_state_dict_config is not None
        and type(optim_state_dict_config).__name__ == optim_cls.__name__
    ) else optim_state_dict_config
    cfg = cfg if cfg is not None else cfg_cls()
    optim_cfg = optim_cfg if optim_cfg is not None else optim_cls()
    if type(cfg) is not cfg_cls:
        raise RuntimeError(
            f"Expected state_dict_config of type {cfg_cls} but got {type(cfg)}"
        )
    if type(optim_cfg) is not optim_cls:
        raise RuntimeError(
            f"Expected optim_state_dict_config of type {optim_cls} but got {type(optim_cfg)}"
        )
    states = FSDP.fsdp_modules(module)
    if not states:
        raise ValueError(f"set_state_dict_type found no FSDP unit in {type(module).__name__}")
    previous = get_state_dict_type(module)
    for st in states:
        st._state_dict_type = sd_type
        st._state_dict_config = cfg
        st._optim_state_dict_config = optim_cfg
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    settings: StateDictSettings | None = None
    for st in FSDP.fsdp_modules(module):
        mine = StateDictSettings(
            st._state_dict_type, st._state_dict_config, st._optim_state_dict_config
        )
        if settings is None:
            settings = mine
        elif mine != settings:
            raise AssertionError(
                "All FSDP modules must have the same state dict settings. Got "
                f"{mine} and {settings}."
            )
    if settings is None:
        raise ValueError(f"get_state_dict_type found no FSDP unit in {type(module).__name__}")
    return settings


# -------------------------------------------------------------- summon


@contextlib.contextmanager
def unshard_for_summon(states: Sequence[FSDP], writeback: bool) -> Generator[None, None, None]:
    """Gather ``states``' units and register full original parameters.

    On exit the (possibly changed) data is written back to the local shards
    if ``writeback``, and every unit is freed.
    """
    for st in states:
        st._lazy_init()
        if st.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError("Cannot manually unshard parameters when already unsharding parameters")
        if st.training_state is not TrainingState.IDLE:
            raise AssertionError("Cannot manually unshard parameters during forward/backward")
    entered: list[FSDP] = []
    try:
        for st in states:
            st.training_state = TrainingState.SUMMON_FULL_PARAMS
            entered.append(st)
            if st._handle is not None:
                st._handle.finish_unshard()
                st._handle.use_unsharded_views(as_params=True)
        yield
    finally:
        for st in reversed(entered):
            if st._handle is not None:
                if writeback:
                    st._handle.write_back_unsharded()
                st._handle.reshard(free=True)
            st.training_state = TrainingState.IDLE


# ---------------------------------------------------------------- hooks


def register_hooks(state: FSDP) -> None:
    state.register_state_dict_pre_hook(_pre_state_dict_hook)
    _compat.register_state_dict_post_hook(state, _post_state_dict_hook)
    _compat.register_load_state_dict_pre_hook(state, _pre_load_state_dict_hook)
    state.register_load_state_dict_post_hook(_post_load_state_dict_hook)


def _effective_type(state: FSDP) -> StateDictType:
    if state._state_dict_type is not StateDictType.FULL_STATE_DICT and (
        state.sharding_strategy is ShardingStrategy.NO_SHARD
    ):
        warnings.warn(
            "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned.",
            stacklevel=4,
        )
        return StateDictType.FULL_STATE_DICT
    if state._state_dict_type is not StateDictType.FULL_STATE_DICT:
        raise NotImplementedError(
            f"{state._state_dict_type} is not implemented in this release of fsdp_wrap yet; "
            "use StateDictType.FULL_STATE_DICT"
        )
    return state._state_dict_type


def _pre_state_dict_hook(state: FSDP, prefix: str, keep_vars: bool) -> None:
    state._lazy_init()
    _effective_type(state)
    if state.training_state is not TrainingState.IDLE:
        raise RuntimeError(
            f"[rank {state.rank}] state_dict() called on FSDP unit '{prefix.rstrip('.')}' during "
            f"{state.training_state}; call it outside forward/backward"
        )
    if state._handle is not None:
        state._handle.finish_unshard()
        state._handle.use_unsharded_views(as_params=True)


def _unit_keys(state: FSDP) -> list[str]:
    """Keys (relative, under the wrapped module) that this unit itself emits."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    keys: list[str] = []
    for mod_fqn, mod in walk_unit_modules(
        state._fsdp_wrapped_module, lambda m: isinstance(m, FSDP)
    ):
        pre = f"{mod_fqn}." if mod_fqn else ""
        keys.extend(pre + n for n, p in mod._parameters.items() if p is not None)
        keys.extend(
            pre + n
            for n, b in mod._buffers.items()
            if b is not None and n not in mod._non_persistent_buffers_set
        )
        keys.append(pre + "_extra_state")
    return keys


def _post_state_dict_hook(
    state: FSDP, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    cfg = state._state_dict_config
    rank0_only = isinstance(cfg, FullStateDictConfig) and cfg.rank0_only
    drop = rank0_only and state.rank != 0
    try:
        for rel in _unit_keys(state):
            key = prefix + WRAPPED + rel
            if key not in state_dict:
                continue
            value = state_dict[key]
            if drop:
                del state_dict[key]
            elif isinstance(value, torch.Tensor):
                value = value.detach()
                value = value.to("cpu", copy=True) if cfg.offload_to_cpu else value.clone()
                state_dict[key] = value
        old = prefix + WRAPPED
        for key in [k for k in state_dict if k.startswith(old)]:
            state_dict[prefix + key[len(old) :]] = state_dict.pop(key)
    finally:
        if state._handle is not None:
            state._handle.reshard(free=True)


def _pre_load_state_dict_hook(
    state: FSDP,
    state_dict: dict[str, Any],
    prefix: str,
    *args: Any,
) -> None:
    state._lazy_init()
    _effective_type(state)
    if state._handle is not None:
        state._handle.finish_unshard()
        state._handle.use_unsharded_views(as_params=True)
    wrapped = prefix + WRAPPED
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        state_dict[wrapped + key[len(prefix) :]] = state_dict.pop(key)


def _post_load_state_dict_hook(state: FSDP, incompatible_keys: Any) -> None:
    if state._handle is not None:
        state._handle.write_back_unsharded()
        state._handle.reshard(free=True)
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [k.replace(WRAPPED, "") for k in keys]
