"""From the constructor's arguments to one unit's :class:`UnitSettings`.

Every option of a unit is resolved here, once, and read afterwards from the
one settings object the unit and its handles hold
(:class:`~fsdp_wrap.handle.config.UnitSettings`): the arguments accepted in
torch's types too (:func:`coerce_arguments`), the process groups
(:func:`init_process_groups`), how the collectives move their bytes
(:func:`init_wire`), and the rest with the strategy clamped to what the world
size allows and the compute device found (:func:`resolve_settings`).
Everything raises before any collective, except the creation of hybrid
groups and of ``quantize_collectives``' sub-groups.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.runtime.capability as capability
from fsdp_wrap.api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    coerce_dataclass,
    coerce_enum,
)
from fsdp_wrap.comm.quant.config import QuantSpec
from fsdp_wrap.comm.quant.wire import Wire, build_wire, ineffective
from fsdp_wrap.handle.config import UnitSettings
from fsdp_wrap.runtime.agreement import in_auto_wrap
from fsdp_wrap.runtime.construct import unit_tensors
from fsdp_wrap.runtime.state import is_unit

__all__ = [
    "ProcessGroupState",
    "clamp_strategy",
    "coerce_arguments",
    "init_process_groups",
    "init_wire",
    "resolve_process_group",
    "resolve_settings",
]


def _rank_tag() -> str:
    """`` [rank N]`` to follow torch's sentence (empty before init_process_group)."""
    return f" [rank {dist.get_rank()}]" if dist.is_initialized() else ""


def coerce_arguments(
    sharding_strategy: Any, backward_prefetch: Any, cpu_offload: Any, mixed_precision: Any,
) -> tuple[ShardingStrategy, BackwardPrefetch | None, CPUOffload | None, MixedPrecision | None]:
    """The enum and config arguments in fsdp_wrap's types (torch's own
    members and configs are accepted by name); the strategy defaults to
    ``FULL_SHARD``."""
    strategy = coerce_enum(sharding_strategy, ShardingStrategy, "sharding_strategy")
    return (
        strategy or ShardingStrategy.FULL_SHARD,
        coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch"),
        coerce_dataclass(cpu_offload, CPUOffload, "cpu_offload"),
        coerce_dataclass(mixed_precision, MixedPrecision, "mixed_precision"),
    )


class ProcessGroupState(NamedTuple):
    group: ProcessGroup  # the shard group (all ranks for non-hybrid strategies)
    rank: int
    world_size: int
    replicate_group: ProcessGroup | None  # hybrid strategies only
    replicate_size: int


def resolve_process_group(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy, auto_wrap: bool
) -> ProcessGroupState:
    """The shard group and, for hybrid strategies, the replicate group.

    Hybrid groups come from a ``(shard, replicate)`` tuple, a 2-D mesh
    ``(replicate, shard)``, or, with an auto-wrap policy, are built here: one
    shard group per node (``LOCAL_WORLD_SIZE`` ranks as torchrun sets it,
    else CUDA devices per node, else every rank) and one replicate group per
    local rank.
    """
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. "
            "Please just pass only one of them."
        )
    hybrid = strategy in HYBRID_STRATEGIES
    replicate: ProcessGroup | None = None
    if hybrid:
        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise ValueError(f"Expected device_mesh to have ndim=2 but got {device_mesh.ndim}")
            group, replicate = device_mesh.get_group(1), device_mesh.get_group(0)
        elif process_group is None:
            if not auto_wrap:
                raise ValueError(
                    f"Manual wrapping with {strategy} requires explicit specification of process "
                    "group or device_mesh."
                )
            group, replicate = _default_hybrid_groups()
        elif isinstance(process_group, tuple) and len(process_group) == 2:
            group, replicate = process_group
        else:
            raise ValueError(
                "Expected process_group to be passed in as either None or "
                f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}"
            )
    else:
        if isinstance(process_group, tuple):
            raise ValueError(
                "A (shard, replicate) process-group tuple is only valid with HYBRID_SHARD or "
                f"_HYBRID_SHARD_ZERO2, but sharding_strategy is {strategy}"
            )
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise ValueError(
                    f"Expected device_mesh to have ndim=1 for {strategy} but got "
                    f"{device_mesh.ndim}"
                )
            group = device_mesh.get_group(0)
        elif process_group is not None:
            group = process_group
        else:
            group = _default_group()
    replicate_size = dist.get_world_size(replicate) if replicate is not None else 1
    return ProcessGroupState(
        group, dist.get_rank(group), dist.get_world_size(group), replicate, replicate_size
    )


def _default_group() -> ProcessGroup:
    if not dist.is_initialized():
        raise ValueError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )
    return dist.distributed_c10d._get_default_group()


def _default_hybrid_groups() -> tuple[ProcessGroup, ProcessGroup]:
    world = dist.get_world_size(_default_group())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (
        torch.cuda.device_count() if torch.cuda.is_available() else world
    )
    if local <= 0 or world % local:
        raise ValueError(
            f"cannot build hybrid-sharding groups{_rank_tag()}: world size {world} is not a "
            f"multiple of the ranks per node ({local}); pass (shard_group, replicate_group) or a "
            "2-D device_mesh"
        )
    rank = dist.get_rank()
    shard_groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(world // local)]
    replicate_groups = [dist.new_group(list(range(i, world, local))) for i in range(local)]
    return shard_groups[rank // local], replicate_groups[rank % local]


def clamp_strategy(strategy: ShardingStrategy, world_size: int) -> ShardingStrategy:
    if world_size == 1 and strategy is not ShardingStrategy.NO_SHARD:
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
            stacklevel=3,
        )
        return ShardingStrategy.NO_SHARD
    if strategy is ShardingStrategy.NO_SHARD:
        warnings.warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
            "`DistributedDataParallel` instead.",
            FutureWarning,
            stacklevel=3,
        )
    return strategy


def resolve_device(
    module: nn.Module,
    device_id: int | torch.device | None,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
) -> torch.device:
    """The compute device: ``device_id``, else the parameters' device (CPU works)."""
    tensors = unit_tensors(module, stop, ignored)
    devices = {t.device for _, t in tensors if t.device.type != "meta"}
    device = capability.check_device_id(device_id)
    if device is not None:
        return device
    non_cpu = {d for d in devices if d.type != "cpu"}
    if len(non_cpu) > 1:
        raise RuntimeError(
            f"FSDP only supports single device modules but got params on {non_cpu}{_rank_tag()}"
        )
    if non_cpu and "cpu" in {d.type for d in devices}:
        raise RuntimeError(
            "To support a module with both CPU and GPU params, please pass in "
            f"device_id argument.{_rank_tag()}"
        )
    return next(iter(non_cpu)) if non_cpu else torch.device("cpu")


def init_process_groups(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy,
    auto_wrap: bool, device: torch.device | None = None,
) -> tuple[ProcessGroupState, Any]:
    """The unit's groups, and what the children made by auto-wrapping get as
    ``process_group`` (a hybrid unit's children share its groups).
    ``device``: the compute device, which the groups' backends must carry.
    """
    pg_state = resolve_process_group(process_group, device_mesh, strategy, auto_wrap)
    if device is not None:
        arg = "device_mesh" if device_mesh is not None else "process_group"
        capability.check_group_device([pg_state.group, pg_state.replicate_group], device, arg)
        capability.check_mesh_device(device_mesh, device)
    if pg_state.replicate_group is not None and device_mesh is None:
        process_group = (pg_state.group, pg_state.replicate_group)
    return pg_state, process_group


def init_wire(quant: QuantSpec | None, pg_state: ProcessGroupState,
              strategy: ShardingStrategy, module: nn.Module) -> Wire:
    """How the unit's collectives move their bytes (``quantize_collectives``):
    checked here, before the handle is built and before any collective of
    the unit (it may create sub-groups for a group spanning nodes)."""
    label = f"[rank {C.global_rank()}] FSDP unit of {type(module).__name__}: "
    replicas = pg_state.replicate_group if pg_state.replicate_size > 1 else None
    kinds = dict(hybrid=strategy in HYBRID_STRATEGIES,
                 gathers=strategy is not ShardingStrategy.NO_SHARD)
    wire = build_wire(quant, pg_state.group, replicas, label=label, **kinds)
    if not in_auto_wrap():  # (once per tree: the children share the root's groups)
        for why in ineffective(quant, wire, pg_state.group, replicas, **kinds):
            warnings.warn(f"{label}quantize_collectives (or $FSDP_WRAP_QUANTIZE_COLLECTIVES) "
                          f"{quant}: {why}", stacklevel=3)
    return wire


def resolve_settings(
    module: nn.Module, pg_state: ProcessGroupState, device_mesh: Any,
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

    def stop(m: nn.Module) -> bool:  # (the unit's own modules only)
        return is_unit(m) or m in ignored_modules

    return UnitSettings(
        device=resolve_device(module, device_id, stop, ignored_params),
        strategy=clamp_strategy(strategy, pg_state.world_size),
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
