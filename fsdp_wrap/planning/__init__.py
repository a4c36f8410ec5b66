"""Know before you launch: the units FSDP will build and what each rank will hold.

::

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    with torch.device("meta"):
        model = MyTransformer(config)          # nothing is allocated
    p = fsdp_wrap.plan(model, world_size=64, auto_wrap_policy=ModuleWrapPolicy({Block}),
                       mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    p.memory.peak_device                     # bytes per GPU, activations excluded

The plan runs the library's own wrap pass and flat-parameter layout on a meta
copy of the model, so the units, their padding and their shards are exactly
what ``FullyShardedDataParallel(model, ...)`` would build on ``world_size``
ranks; no process group, GPU or parameter memory is needed.  The memory model
is described in :mod:`fsdp_wrap.planning._memory`; ``docs/plan.rst`` shows how
close it is to what training holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from fsdp_wrap.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_wrap.comm.bucket import resolve_bucket_cap_mb
from fsdp_wrap.comm.gather_batch import resolve_all_gather_batch_mb
from fsdp_wrap.planning._memory import OPTIMIZERS, RankMemory, Schedule, estimate
from fsdp_wrap.planning._options import (
    checked_backend,
    coerce_options,
    settings_row,
    shard_group,
)
from fsdp_wrap.planning._report import Plan, find_warnings
from fsdp_wrap.planning._units import FlatPlan, ParamEntry, UnitPlan, discover_units

__all__ = ["OPTIMIZERS", "FlatPlan", "ParamEntry", "Plan", "RankMemory", "Schedule", "UnitPlan",
           "plan"]


def plan(
    module: nn.Module,
    world_size: int,
    *,
    sharding_strategy: ShardingStrategy | None = None,
    auto_wrap_policy: Any = None,
    cpu_offload: CPUOffload | None = None,
    mixed_precision: MixedPrecision | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    ignored_states: Iterable[Any] | None = None,
    use_orig_params: bool = False,
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
    device: str = "cuda",
    shard_group_size: int | None = None,
    optimizer: str = "adam",
    bucket_cap_mb: float | None = None,
    all_gather_batch_mb: float | None = None,
    verbose: bool = False,
) -> Plan:
    """Plan ``FullyShardedDataParallel(module, ...)`` on ``world_size`` ranks.

    The keyword arguments are the constructor's (same names, defaults and
    accepted types, torch's enums and configs included).  ``module`` is not
    modified and may live on the meta device.

    Args:
        world_size: ranks in the job.
        shard_group_size: with ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``, the
            ranks one parameter is sharded over (a node; default
            ``min(8, world_size)``); other strategies shard over every rank.
        optimizer: ``"adam"``/``"adamw"`` (two states per parameter and a step
            counter), ``"sgd-momentum"`` (one), ``"sgd"`` or ``"none"``.
        bucket_cap_mb: the constructor's gradient bucket cap (default
            ``$FSDP_WRAP_BUCKET_CAP_MB``, else 1; resolved as the constructor
            does): gradients waiting in a bucket and a bucket's buffers in
            flight add to the backward peak (the planner replays the runtime's
            bucket decisions: see "What is counted" in the plan docs).
        all_gather_batch_mb: the constructor's batched all-gather cap (default
            ``$FSDP_WRAP_ALL_GATHER_BATCH_MB``, else the library's default):
            on ``"cpu"`` with ``limit_all_gathers=True`` (synchronous gathers)
            the units a batch gathers ahead of their turn add to the peaks.
        device: what the ranks compute on: ``"cuda"`` (NCCL: no staging
            buffers) or ``"cpu"`` (gloo: its measured staging buffers, and
            ``limit_all_gathers`` decides whether gathers overlap compute).
        verbose: print the plan's table.

    A unit mixing frozen and trainable parameters or dtypes (a PEFT model:
    frozen base, trainable adapters; a 4-bit quantized base) is planned as the
    constructor builds it, one flat parameter per ``(requires_grad, dtype)``
    (``UnitPlan.flats``): frozen ones count no gradient or optimizer state.

    Raises:
        ValueError: for a world size the shard group does not divide, an
            unknown optimizer kind, or a model FSDP could not wrap (the
            constructor's own checks: e.g. scalar or integer parameters, or a
            ``param_dtype`` that would cast packed 4-bit weights).
    """
    strategy, backward_prefetch, offload, mp = coerce_options(
        sharding_strategy, backward_prefetch, cpu_offload, mixed_precision
    )
    shard = shard_group(strategy, world_size, shard_group_size)
    backend = checked_backend(device, limit_all_gathers, optimizer, shard)
    cap_mb = resolve_bucket_cap_mb(bucket_cap_mb)
    cap_bytes = int(cap_mb * 1024 * 1024)
    batch_mb = resolve_all_gather_batch_mb(all_gather_batch_mb)
    # (the runtime batches only synchronous gathers: gloo with limit_all_gathers)
    batch_bytes = 0 if backend.async_gathers else int(batch_mb * 1024 * 1024)
    units, ignored = discover_units(
        module,
        shard_size=shard,
        sharding_strategy=strategy,
        auto_wrap_policy=auto_wrap_policy,
        cpu_offload=offload,
        mixed_precision=mp,
        ignored_modules=ignored_modules,
        ignored_states=ignored_states,
        use_orig_params=use_orig_params,
    )
    ranks = range(shard) if any(u.use_orig_params for u in units) else range(1)
    per_rank = estimate(units, ranks, optimizer=optimizer, backward_prefetch=backward_prefetch,
                        forward_prefetch=forward_prefetch, ignored=ignored, backend=backend,
                        bucket_cap_bytes=cap_bytes, replicate_size=world_size // shard,
                        gather_batch_bytes=batch_bytes)
    result = Plan(
        units=tuple(units),
        world_size=world_size,
        shard_size=shard,
        replicate_size=world_size // shard,
        optimizer=optimizer,
        settings=settings_row(strategy, use_orig_params, offload, mp, backward_prefetch,
                              forward_prefetch, limit_all_gathers, device, cap_mb, batch_mb),
        memory=max(per_rank, key=lambda m: (m.peak_device, m.persistent_cpu)),
        per_rank=per_rank,
        warnings=tuple(find_warnings(units, shard)),
    )
    if verbose:
        print(result)
    return result
