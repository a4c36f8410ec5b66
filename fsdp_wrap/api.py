"""Public configuration of fsdp_wrap: enums and config dataclasses.

Every name, field, default and enum value here matches
the ``api`` module of torch's FSDP package, so that a script written for torch's FSDP1
runs unchanged.  This module imports nothing from the rest of the package.

Each docstring states what the option gathers or frees, and when, because that
is what decides the memory/communication trade-off a user is choosing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "StateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "ShardedStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "StateDictSettings",
]


class ShardingStrategy(Enum):
    """How a unit's parameters, gradients and optimizer state are split.

    ``FULL_SHARD``
        Parameters are all-gathered before forward, freed after forward,
        all-gathered again before backward and freed after it; gradients are
        reduce-scattered.  Lowest memory; moves 3x the parameter bytes a step.
    ``SHARD_GRAD_OP``
        Parameters are all-gathered before forward and kept until the unit's
        backward is done (ZeRO-2 style); gradients are reduce-scattered.
        Moves 2x the parameter bytes; holds every unit unsharded between
        forward and backward.
    ``NO_SHARD``
        Nothing is sharded; gradients are all-reduced (DDP-like).  Deprecated
        in torch; kept for compatibility.
    ``HYBRID_SHARD``
        ``FULL_SHARD`` within a shard group, replicated across a replicate
        group whose gradients are all-reduced.
    ``_HYBRID_SHARD_ZERO2``
        ``SHARD_GRAD_OP`` within a shard group, replicated across groups.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()



# Which strategies shard parameters, free them after forward, and replicate
# over a second group (fsdp_wrap's own groupings, not torch API).
SHARDED_STRATEGIES = frozenset(
    {
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy._HYBRID_SHARD_ZERO2,
    }
)
RESHARD_AFTER_FORWARD = frozenset({ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD})
HYBRID_STRATEGIES = frozenset({ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2})

class BackwardPrefetch(Enum):
    """When backward issues the next unit's all-gather.

    ``BACKWARD_PRE`` issues it when the current unit's backward begins, so the
    next unit's parameters are in flight while this unit computes gradients
    (peak: two unsharded units plus one unsharded gradient).
    ``BACKWARD_POST`` issues it after the current unit's parameters are freed
    (peak: one unsharded unit plus one unsharded gradient).  ``None`` disables
    prefetching.
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Dtypes used for compute, gradient reduction and buffers.

    The sharded master parameters always stay in their original dtype; the
    unsharded copy that forward and backward use is cast to ``param_dtype``
    right after the all-gather of the full-precision shard (so all-gathers move
    low-precision bytes).  ``reduce_dtype`` defaults to ``param_dtype`` when
    only that is given.  ``buffer_dtype`` casts buffers at the first forward;
    state dicts return buffers in their original dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    """Keep sharded parameters and gradients in CPU memory.

    With ``offload_params=True`` the optimizer steps on CPU; each unit's
    shard is copied to the compute device just before its all-gather, and the
    reduced gradient shard is copied back to CPU after reduction.
    """

    offload_params: bool = False


class StateDictType(Enum):
    """Which format ``state_dict()`` and ``load_state_dict()`` use."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configs."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only=True`` returns the full dict on rank 0 and ``{}`` elsewhere."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """``_use_dtensor=True`` returns DTensor values instead of ShardedTensor."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs (note: offloads by default)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
