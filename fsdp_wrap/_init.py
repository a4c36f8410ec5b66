"""Construction-time helpers: argument resolution and checks, before any collective.

Every check that can fail on bad user input runs here, on each rank, before
the first collective of the constructor, so a mistake is an error and never a
hang.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from . import _collectives as C
from ._flat_param import walk_unit_modules
from .api import CPUOffload, MixedPrecision, ShardingStrategy

HYBRID_STRATEGIES = frozenset({ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2})


class ProcessGroupState(NamedTuple):
    group: ProcessGroup
    rank: int
    world_size: int


def _rank_tag() -> str:
    return f"[rank {dist.get_rank()}] " if dist.is_initialized() else ""


def resolve_ignored(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[Any] | None,
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (whole subtrees) and ignored parameters."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. "
            "Please just pass ignored_states."
        )
    roots: list[nn.Module] = []
    params: set[nn.Parameter] = set()
    if ignored_states is not None:
        states = list(ignored_states)
        if states and all(isinstance(s, nn.Parameter) for s in states):
            params.update(states)
        elif states and all(isinstance(s, nn.Module) for s in states):
            roots = states
        elif states:
            raise ValueError(
                "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
                f"types {[type(s) for s in states]}"
            )
    elif ignored_modules is not None:
        try:
            roots = list(ignored_modules)
        except TypeError:
            raise TypeError(
                "`ignored_modules` should be an iterable of `torch.nn.Module`s but got "
                f"{type(ignored_modules)}"
            ) from None
        bad = [type(m) for m in roots if not isinstance(m, nn.Module)]
        if bad:
            raise ValueError(f"ignored_modules expects nn.Module list elements but got types {bad}")
    if any(isinstance(m, FSDP) for m in roots):
        raise ValueError("`ignored_modules` should not include FSDP modules")
    if module in roots:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will "
            "result in all parameters being ignored and is not well-supported",
            stacklevel=3,
        )
    mods: set[nn.Module] = set()
    for root in roots:
        for m in root.modules():
            if not isinstance(m, FSDP):
                mods.add(m)
    for m in mods:
        params.update(m.parameters(recurse=False))
    return mods, params


def resolve_process_group(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy
) -> ProcessGroupState:
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. "
            "Please just pass only one of them."
        )
    if strategy in HYBRID_STRATEGIES:
        raise NotImplementedError(
            f"sharding_strategy={strategy} (hybrid sharding) is not implemented in this release "
            "of fsdp_wrap yet; use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD"
        )
    if isinstance(process_group, tuple):
        raise ValueError(
            "A (shard, replicate) process-group tuple is only valid with HYBRID_SHARD or "
            f"_HYBRID_SHARD_ZERO2, but sharding_strategy is {strategy}"
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"Expected device_mesh to have ndim=1 for {strategy} but got {device_mesh.ndim}"
            )
        group = device_mesh.get_group(0)
    elif process_group is not None:
        group = process_group
    else:
        if not dist.is_initialized():
            raise ValueError(
                "Default process group has not been initialized, please make sure to call "
                "init_process_group."
            )
        group = dist.distributed_c10d._get_default_group()
    return ProcessGroupState(group, dist.get_rank(group), dist.get_world_size(group))


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


def check_unimplemented(
    cpu_offload: CPUOffload | None, mixed_precision: MixedPrecision | None, strategy: Any
) -> None:
    """Options a later release implements are refused by name, never ignored."""
    if cpu_offload is not None and cpu_offload.offload_params:
        raise NotImplementedError(
            "cpu_offload=CPUOffload(offload_params=True) is not implemented in this release of "
            "fsdp_wrap yet"
        )
    if mixed_precision is not None and any(
        dt is not None
        for dt in (
            mixed_precision.param_dtype,
            mixed_precision.reduce_dtype,
            mixed_precision.buffer_dtype,
        )
    ):
        raise NotImplementedError(
            "mixed_precision with param_dtype/reduce_dtype/buffer_dtype is not implemented in "
            "this release of fsdp_wrap yet"
        )


def _unit_tensors(
    module: nn.Module, stop: Callable[[nn.Module], bool], ignored: set[nn.Parameter]
) -> list[tuple[str, torch.Tensor]]:
    """This unit's managed parameters and buffers, by FQN."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_fqn, mod in walk_unit_modules(module, stop):
        for kind in (mod._parameters, mod._buffers):
            for name, t in kind.items():
                if t is None or id(t) in seen or t in ignored:
                    continue
                seen.add(id(t))
                out.append((f"{mod_fqn}.{name}" if mod_fqn else name, t))
    return out


def resolve_device(
    module: nn.Module,
    device_id: int | torch.device | None,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
) -> torch.device:
    """The compute device: ``device_id``, else the parameters' device (CPU works)."""
    tensors = _unit_tensors(module, stop, ignored)
    devices = {t.device for _, t in tensors if t.device.type != "meta"}
    if device_id is not None:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(
            device_id
        )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    non_cpu = {d for d in devices if d.type != "cpu"}
    if len(non_cpu) > 1:
        raise RuntimeError(
            f"{_rank_tag()}FSDP only supports single device modules but got params on {non_cpu}"
        )
    if non_cpu and "cpu" in {d.type for d in devices}:
        raise RuntimeError(
            f"{_rank_tag()}To support a module with both CPU and GPU params, please pass in "
            "device_id argument."
        )
    return next(iter(non_cpu)) if non_cpu else torch.device("cpu")


def materialize_or_reject_meta(
    module: nn.Module,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
    param_init_fn: Callable[[nn.Module], None] | None,
    rank: int,
) -> None:
    meta = [fqn for fqn, t in _unit_tensors(module, stop, ignored) if t.is_meta]
    if meta:
        raise NotImplementedError(
            f"[rank {rank}] meta-device initialisation (param_init_fn / reset_parameters) is "
            f"not implemented in this release of fsdp_wrap yet; meta tensors: {meta[:5]}"
        )


def move_to_device(
    module: nn.Module,
    device: torch.device,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
) -> None:
    """Move this unit's managed parameters and buffers; keep Parameter identity."""
    for _, mod in walk_unit_modules(module, stop):
        for p in mod._parameters.values():
            if p is not None and p not in ignored and p.device != device:
                p.data = p.data.to(device)
        for name, b in mod._buffers.items():
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)


def sync_module_states(
    module: nn.Module,
    stop: Callable[[nn.Module], bool],
    ignored: set[nn.Parameter],
    group: ProcessGroup,
) -> None:
    """Broadcast rank 0's parameters and buffers (one collective per tensor)."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for _, t in _unit_tensors(module, stop, ignored):
            C.broadcast(t.data if isinstance(t, nn.Parameter) else t, src, group)


def check_no_cross_unit_sharing(
    module: nn.Module, params: list[tuple[str, nn.Module, str, nn.Parameter]], rank: int
) -> None:
    """A parameter owned by a nested unit cannot also belong to this unit."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    owned: dict[nn.Parameter, str] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, FSDP) and sub._handle is not None:
            for info in sub._handle.infos:
                owned[info.param] = f"{name}.{info.fqn}"
    for fqn, *_, p in params:
        if p in owned:
            raise ValueError(
                f"[rank {rank}] parameter '{fqn}' is shared with '{owned[p]}', which a nested FSDP "
                "unit already owns. Tied parameters must live in one FSDP unit: wrap their common "
                "parent instead (e.g. exclude one of the two modules from the wrap policy)."
            )
