"""The steps of :func:`fsdp_wrap.planning.plan` before and after the planning itself.

Turning the constructor's keyword arguments into the values the plan uses
(torch's enums and configs accepted, as the constructor does), checking the
run's shape (device, optimizer kind, world size and shard group), and the
settings row a :class:`~fsdp_wrap.planning._report.Plan` reports.
"""

from __future__ import annotations

from typing import Any

from fsdp_wrap.api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    coerce_dataclass,
    coerce_enum,
)
from fsdp_wrap.planning._memory import NCCL, OPTIMIZERS, Backend, gloo


def coerce_options(
    sharding_strategy: Any, backward_prefetch: Any, cpu_offload: Any, mixed_precision: Any
) -> tuple[ShardingStrategy, BackwardPrefetch | None, CPUOffload, MixedPrecision]:
    """The constructor's settings as fsdp_wrap's types, with the constructor's defaults.

    ``None`` means ``FULL_SHARD``, no offload and no mixed precision;
    ``backward_prefetch`` stays ``None`` when it is.
    """
    strategy = coerce_enum(sharding_strategy, ShardingStrategy, "sharding_strategy")
    strategy = strategy or ShardingStrategy.FULL_SHARD
    prefetch = coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch")
    offload = coerce_dataclass(cpu_offload, CPUOffload, "cpu_offload") or CPUOffload()
    mp = coerce_dataclass(mixed_precision, MixedPrecision, "mixed_precision") or MixedPrecision()
    return strategy, prefetch, offload, mp


def checked_backend(device: str, limit_all_gathers: bool, optimizer: str,
                    shard_size: int) -> Backend:
    """The collectives' memory model for ``device`` and a shard group of
    ``shard_size`` ranks (from :func:`shard_group`, which checks the world
    size), after checking the run's other arguments.

    Raises:
        ValueError: for a device other than ``"cuda"``/``"cpu"`` or an unknown
            optimizer kind.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    backend = NCCL if device == "cuda" else gloo(limit_all_gathers, shard_size)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    return backend


def shard_group(
    strategy: ShardingStrategy, world_size: int, shard_group_size: int | None
) -> int:
    """The ranks one parameter is sharded over.

    Hybrid strategies shard over ``shard_group_size`` (default
    ``min(8, world_size)``), the others over every rank.

    Raises:
        ValueError: for a world size below 1, a ``shard_group_size`` given to a
            non-hybrid strategy (unless it is the world size), or one that does
            not divide the world size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if strategy in HYBRID_STRATEGIES:
        shard = shard_group_size or min(8, world_size)
    else:
        if shard_group_size not in (None, world_size):
            raise ValueError(
                f"shard_group_size={shard_group_size} only applies to hybrid strategies; "
                f"{strategy.name} shards over all {world_size} ranks"
            )
        shard = world_size
    if shard < 1 or world_size % shard:
        raise ValueError(
            f"world_size {world_size} is not a multiple of the shard group size {shard}"
        )
    return shard


def settings_row(
    strategy: ShardingStrategy,
    use_orig_params: bool,
    offload: CPUOffload,
    mp: MixedPrecision,
    backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool,
    limit_all_gathers: bool,
    device: str,
    bucket_cap_mb: float,
    all_gather_batch_mb: float = 0.0,
) -> dict[str, Any]:
    """The settings a plan reports, by name (enums and dtypes as plain strings)."""
    return {
        "sharding_strategy": strategy.name,
        "use_orig_params": use_orig_params,
        "offload_params": offload.offload_params,
        "param_dtype": _dtype_name(mp.param_dtype),
        "reduce_dtype": _dtype_name(mp.reduce_dtype or mp.param_dtype),
        "backward_prefetch": backward_prefetch.name if backward_prefetch else None,
        "forward_prefetch": forward_prefetch,
        "limit_all_gathers": limit_all_gathers,
        "device": device,
        "bucket_cap_mb": bucket_cap_mb,
        "all_gather_batch_mb": all_gather_batch_mb,
    }


def _dtype_name(dtype: Any) -> str:
    return "param" if dtype is None else str(dtype).replace("torch.", "")
