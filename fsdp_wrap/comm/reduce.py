"""Gradient reduction of one flat parameter: cast, divide, collective, divide.

Functions of tensors, a :class:`ReduceSpec` and process groups; they know
nothing of modules or handles.  The handle decides *whether* and *when* to
reduce (``no_sync``, parked gradients); this module says *how*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed import ProcessGroup

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.comm.quant.wire import EXACT, Wire


@dataclass(frozen=True)
class ReduceSpec:
    """What one unit's gradient reduction needs to know."""

    sharded: bool  # reduce-scatter (sharded strategies) or all-reduce (NO_SHARD)
    padded_numel: int  # reduce-scatter input size (world-size multiple)
    shard_numel: int  # reduce-scatter output size
    world_size: int
    divide: C.DivideFactors
    reduce_dtype: torch.dtype
    group: ProcessGroup
    replicate_group: ProcessGroup | None  # hybrid strategies: then all-reduced here
    wire: Wire = EXACT  # how the collectives move their bytes (fsdp_wrap.comm.quant.wire)


def pad_to(grad: torch.Tensor, numel: int) -> torch.Tensor:
    """``grad`` right-padded with zeros to ``numel`` elements (itself if already that size)."""
    if grad.numel() == numel:
        return grad
    padded = grad.new_zeros(numel)
    padded[: grad.numel()].copy_(grad)
    return padded


def reduce_default(grad: torch.Tensor, spec: ReduceSpec, replicas: bool = True) -> torch.Tensor:
    """The mean over ranks: this rank's shard of it (sharded) or all of it (NO_SHARD).

    Divided by ``pre`` before and ``post`` after the sum (torch's split, which
    keeps low-precision sums away from overflow); reduced in ``reduce_dtype``
    (float32 after decoding, where ``spec.wire`` codes the gradients).
    ``replicas=False``: a hybrid strategy's replicate group is left out (sharded
    accumulation adds these up and sums them over the replicas later, with
    :func:`sum_over_replicas`).
    """
    pre, post = spec.divide
    if grad.dtype != spec.reduce_dtype:
        grad = grad.to(spec.reduce_dtype)
    if spec.sharded:
        padded = pad_to(grad, spec.padded_numel)
        if pre > 1:
            padded.div_(pre)
        reduced = grad.new_empty(spec.shard_numel, dtype=spec.wire.sum_dtype(grad.dtype))
        # ``padded`` is the gradient taken off the flat parameter (or a padded
        # or cast copy of it): nothing reads it after this reduction.
        spec.wire.reduce_scatter(reduced, padded, spec.group, input_is_scratch=True)
    else:
        reduced = grad
        if pre > 1:
            reduced.div_(pre)
        if spec.world_size > 1:
            reduced = spec.wire.all_reduce(reduced, spec.group)
    if replicas and spec.replicate_group is not None:
        reduced = spec.wire.all_reduce_replicas(reduced, spec.replicate_group)
    if post > 1:
        reduced.div_(post)
    return reduced


def sum_over_replicas(shard: torch.Tensor, spec: ReduceSpec) -> torch.Tensor:
    """The sum of ``shard`` over a hybrid strategy's replicate group, in the
    dtype the replicas' all-reduce moves (``reduce_dtype``; float32 where it is
    coded); ``shard`` itself where it can be reduced in place."""
    if spec.replicate_group is None:
        return shard
    if spec.wire.replicas is None:
        dtype = spec.wire.sum_dtype(spec.reduce_dtype)
        if shard.dtype != dtype:
            shard = shard.to(dtype)
    return spec.wire.all_reduce_replicas(shard, spec.replicate_group)


def reduce_with_hook(
    grad: torch.Tensor, spec: ReduceSpec, hook_state: object, hook: Callable[..., Any]
) -> torch.Tensor:
    """A user communication hook in place of :func:`reduce_default` (torch's calling
    convention: ``hook(state, grad)`` for NO_SHARD, ``hook(state, padded, output)``
    for the sharded strategies)."""
    if not is_low_precision_hook(hook) and grad.dtype != spec.reduce_dtype:
        grad = grad.to(spec.reduce_dtype)
    if not spec.sharded:
        hook(hook_state, grad)
        return grad
    padded = pad_to(grad, spec.padded_numel)
    reduced = padded.new_empty(spec.shard_numel)
    hook(hook_state, padded, reduced)
    return reduced


def is_low_precision_hook(hook: Callable[..., Any]) -> bool:
    """torch's fp16/bf16 compress hooks cast the gradient themselves."""
    return getattr(hook, "__name__", "") in {"fp16_compress_hook", "bf16_compress_hook"} and (
        getattr(hook, "__module__", "") == "torch.distributed.algorithms._comm_hooks.default_hooks"
    )
