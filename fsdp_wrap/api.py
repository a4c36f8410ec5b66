"""Public configuration of fsdp_wrap: enums and config dataclasses.

Every name, field, default and enum value here matches
the ``api`` module of torch's FSDP package, so that a script written for torch's FSDP1
runs unchanged.  This module imports nothing from the rest of the package.

Each docstring states what the option gathers or frees, and when, because that
is what decides the memory/communication trade-off a user is choosing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, TypeVar

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
    "OptimStateKeyType",
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

    The default is ``FULL_SHARD``.  :doc:`/plan` shows what each one holds
    per rank for a given model before launch.
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

    The sharded master parameters always stay in their original dtype.  Each
    unit's shard is cast to ``param_dtype`` *before* its all-gather, so
    all-gathers move low-precision bytes and forward and backward compute on
    a low-precision unsharded copy, freed on the strategy's usual schedule.
    Gradients are reduced in ``reduce_dtype`` (``param_dtype`` when only that
    is given; set ``torch.float32`` for full-precision sums at twice the
    bytes of bf16) and the reduced shard is cast back to the master dtype,
    unless ``keep_low_precision_grads``.  ``buffer_dtype`` casts floating
    buffers in place at lazy initialisation; FULL and SHARDED state dicts
    return them in their original dtype.  ``cast_forward_inputs`` casts the
    floating inputs of every unit, ``cast_root_forward_inputs`` (default) those
    of the root.  With an ``auto_wrap_policy``, instances of
    ``_module_classes_to_ignore`` (BatchNorm) become units of their own that
    compute in full precision.  Inside ``summon_full_params`` and for state
    dicts parameters are gathered in full precision.  Example, bf16 compute
    with fp32 gradient sums::

        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    Use :class:`~fsdp_wrap.sharded_grad_scaler.ShardedGradScaler` with fp16.
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
    reduced gradient shard is copied back to CPU after reduction.  Device
    memory then holds only the units currently unsharded (and activations);
    each step costs two host-device copies of every shard (three with
    ``FULL_SHARD``'s backward gather) and a CPU optimizer step.  On CUDA the
    shards are pinned; a CPU compute device works too (torch's FSDP1 refuses
    it), which is useful to test scripts that offload on GPUs.
    """

    offload_params: bool = False


class StateDictType(Enum):
    """Which format ``state_dict()`` and ``load_state_dict()`` use.

    ``FULL_STATE_DICT``
        The unwrapped model's keys with full tensors; saving gathers one unit
        at a time, loading gathers nothing.  For small models, export, and
        ``torch.save`` files.
    ``SHARDED_STATE_DICT``
        The same keys, each rank holding dim-0 chunks (``ShardedTensor`` or
        ``DTensor``); nothing is gathered.  For training checkpoints with
        ``torch.distributed.checkpoint``; loads at another world size.
    ``LOCAL_STATE_DICT``
        Each unit's raw flat shard; no collective.  Only the same job layout
        reads it back.

    Set it with :meth:`FullyShardedDataParallel.state_dict_type
    <fsdp_wrap.FullyShardedDataParallel.state_dict_type>`; :doc:`/checkpointing`
    compares them.
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configs.

    ``offload_to_cpu=True`` copies the values to CPU as they are produced
    (device memory for one unit at a time instead of the whole dict).
    """

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Config of ``FULL_STATE_DICT``.

    ``rank0_only=True`` gathers each unit to rank 0 alone and returns the full
    dict there and ``{}`` elsewhere; with ``offload_to_cpu=True`` as well,
    rank 0 holds the model once, in CPU memory.  Loading needs the full dict
    on every rank, whatever the config (broadcast it from rank 0 yourself).
    """

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Config of ``LOCAL_STATE_DICT`` (only ``offload_to_cpu``)."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Config of ``SHARDED_STATE_DICT``.

    ``_use_dtensor=True`` returns ``DTensor`` values instead of
    ``ShardedTensor`` (the default with a ``device_mesh``).
    """

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs.

    Unlike the model's, ``offload_to_cpu`` defaults to ``True`` (torch's
    default): optimizer states are copied to CPU as they are produced.
    """

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Config of the FULL optimizer state dict.

    ``rank0_only=True`` keeps the result on rank 0 (``{}`` elsewhere); when
    loading, rank 0's dict is broadcast to every rank.
    """

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Config of the LOCAL optimizer state dict (does not offload by default)."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Config of the SHARDED optimizer state dict (``_use_dtensor`` as for the model's)."""

    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """The state-dict type and both configs of a module's units, as
    :meth:`FullyShardedDataParallel.get_state_dict_type
    <fsdp_wrap.FullyShardedDataParallel.get_state_dict_type>` returns them."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


class OptimStateKeyType(Enum):
    """Key type of an optimizer state dict's ``"state"`` (for :meth:`FullyShardedDataParallel.rekey_optim_state_dict`).

    ``PARAM_NAME`` keys by the parameter's clean FQN (what
    :meth:`~FullyShardedDataParallel.optim_state_dict` returns), ``PARAM_ID``
    by its position in the optimizer's parameter groups (what
    ``optimizer.state_dict()`` holds).
    """

    PARAM_NAME = auto()
    PARAM_ID = auto()


# ------------------------------------------- torch's own enums and configs

E = TypeVar("E", bound=Enum)
D = TypeVar("D")


def coerce_enum(value: Any, enum_cls: type[E], arg_name: str) -> E | None:
    """Accept our enum member, or torch's member of the same-named enum.

    A script that swapped only the wrapper import may still pass
    torch's own ``ShardingStrategy.FULL_SHARD`` (from torch's FSDP package); members are matched
    by class name and member name, never by importing torch's FSDP.
    """
    if value is None or isinstance(value, enum_cls):
        return value
    if isinstance(value, Enum) and type(value).__name__ == enum_cls.__name__:
        try:
            return enum_cls[value.name]
        except KeyError:
            pass
    raise TypeError(
        f"{arg_name} expects a {enum_cls.__name__} member (from fsdp_wrap or "
        f"torch's FSDP) but got {value!r} of type {type(value).__name__}"
    )


def coerce_dataclass(value: Any, cls: type[D], arg_name: str) -> D | None:
    """Accept our config dataclass, or torch's dataclass of the same name."""
    if value is None or isinstance(value, cls):
        return value
    if dataclasses.is_dataclass(value) and type(value).__name__ == cls.__name__:
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}  # type: ignore[arg-type]
        return cls(**fields)
    raise TypeError(
        f"{arg_name} expects a {cls.__name__} but got {value!r} of type {type(value).__name__}"
    )
