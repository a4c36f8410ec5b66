"""``summon_full_params``: full original parameters, on demand, for a while.

Each unit is gathered in full precision; its original parameters are
registered with their full shapes (on CPU with ``offload_to_cpu``); on exit
changes are written back to the local shards (``writeback``) and every unit
is freed.  With ``rank0_only`` the other ranks take part in the gathers but
free at once and see their sharded state inside the context.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import torch

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.runtime.state import TrainingState, UnitState
from fsdp_wrap.runtime.tree import lazy_init

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle


def check_options(
    states: Sequence[UnitState], writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> None:
    """torch's rules for invalid option combinations (same order and text),
    checked on every unit before any collective."""
    for st in states:
        uop = st.settings.use_orig_params
        if with_grads and (offload_to_cpu or not uop):
            raise NotImplementedError(
                f"with_grads={with_grads}, use_orig_params={uop}, offload_to_cpu={offload_to_cpu} "
                "is not supported yet"
            )
        if offload_to_cpu and st._handles and not st._handles[0].uses_sharded_strategy:
            raise NotImplementedError("offload_to_cpu=True and NO_SHARD is not supported yet")
        if writeback and rank0_only:
            raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "offload_to_cpu=True and rank0_only=False may result in the unsharded parameters "
            "being redundantly copied to CPU memory for GPUs sharing the same CPU memory, which "
            "risks CPU OOM. We recommend using offload_to_cpu=True with rank0_only=True.",
            stacklevel=4,
        )
    for st in states:
        lazy_init(st)
        if st.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError(
                "Cannot manually unshard parameters when already unsharding parameters"
            )
        if st.training_state is not TrainingState.IDLE:
            raise AssertionError("Cannot manually unshard parameters during forward/backward")


@contextlib.contextmanager
def summon(
    states: Sequence[UnitState],
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Generator[None, None, None]:
    check_options(states, writeback, rank0_only, offload_to_cpu, with_grads)
    for st in states:
        for h in st._handles:
            if h.use_orig_params:
                # zero_grad(set_to_none=True) on every original parameter
                # drops the flat gradient (as torch does here)
                h.grads.sync_flat_grad_from_orig()
            h.pre_unshard()  # write-back checks before any collective
    entered: list[tuple[UnitState, FlatParamHandle | None, torch.Tensor | None, bool,
                        torch.Tensor | None]] = []
    try:
        for st in states:
            st.training_state = TrainingState.SUMMON_FULL_PARAMS
            if not st._handles:
                entered.append((st, None, None, False, None))
            for h in st._handles:
                entered.append((st, h, *_summon_handle(h, st.rank, rank0_only,
                                                       offload_to_cpu, with_grads)))
        yield
    finally:
        for st, handle, cpu_copy, shown, full_grad in reversed(entered):
            if handle is not None and shown:
                if writeback:
                    if cpu_copy is not None:
                        handle.write_back_from(cpu_copy)
                    else:
                        handle.write_back_unsharded()
                    if full_grad is not None:
                        _write_back_grad(handle, full_grad)
                handle.reshard(free=True)
                if with_grads:
                    _show_sharded_grads(handle)
            st.training_state = TrainingState.IDLE


def _summon_handle(handle: FlatParamHandle, rank: int, rank0_only: bool, offload_to_cpu: bool,
                   with_grads: bool) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """Gather one flat parameter and show its original parameters at full
    size; returns its CPU copy (``offload_to_cpu``), whether it is shown, and
    the full gradient shown (``with_grads``; written back at the exit)."""
    full_grad = _gather_full_grad(handle) if with_grads else None
    handle.finish_unshard(full_precision=True)
    cpu_copy: torch.Tensor | None = None
    shown = not (rank0_only and rank != 0)
    if not shown:
        handle.reshard(free=True)
    elif offload_to_cpu:
        cpu_copy = handle.flat_param.detach().to("cpu", copy=True)
        handle.use_unsharded_views(as_params=True, source=cpu_copy)
    else:
        handle.use_unsharded_views(as_params=True)
    if with_grads and shown:
        _show_full_grads(handle, full_grad)
    return cpu_copy, shown, full_grad if shown else None


# ------------------------------------------------------------ with_grads


def _gather_full_grad(handle: FlatParamHandle) -> torch.Tensor | None:
    """The mean gradient of the whole flat parameter (a collective), or
    ``None`` when no rank has one (torch then shows no gradients).

    Ranks without a gradient contribute zeros so every rank takes part.
    """
    grad = handle.flat_param.grad
    if not handle.uses_sharded_strategy:
        return None if grad is None else grad.detach().to(handle.device)
    missing = torch.tensor([int(grad is None)], device=handle.device)
    C.all_reduce(missing, handle.process_group)
    if int(missing.item()) == handle.world_size:
        return None
    local = (
        torch.zeros(handle.shard_numel, dtype=handle.orig_dtype, device=handle.device)
        if grad is None or handle.grads.has_unreduced_grad
        else grad.detach().to(handle.device)
    )
    full = local.new_empty(handle.padded_numel)
    C.all_gather_into(full, local, handle.process_group)
    return full[: handle.unpadded_numel]


def _show_full_grads(handle: FlatParamHandle, full_grad: torch.Tensor | None) -> None:
    """Original params' ``.grad`` become full-shape views of ``full_grad`` (or None);
    frozen parameters too (zeros), as torch shows them."""
    if full_grad is None:
        for info in handle.infos:
            info.param.grad = None
    else:
        handle.grads.set_unsharded_grad_views(full_grad, frozen_too=True)


def _write_back_grad(handle: FlatParamHandle, full_grad: torch.Tensor) -> None:
    """``writeback=True``: this rank's part of the shown (maybe changed) full
    gradient goes into its sharded gradient, as torch writes it back (only where
    that gradient exists; NO_SHARD shows the gradient itself)."""
    grad = handle.flat_param.grad
    if grad is None or not handle.uses_sharded_strategy or handle.grads.has_unreduced_grad:
        return
    start = handle.shard_offset
    piece = full_grad[start : min(start + handle.shard_numel, full_grad.numel())]
    grad[: piece.numel()].copy_(piece.to(grad.dtype))


def _show_sharded_grads(handle: FlatParamHandle) -> None:
    """Undo :func:`_show_full_grads`."""
    if handle.grads.has_unreduced_grad and handle.flat_param.grad is not None:
        handle.grads.set_unsharded_grad_views(handle.flat_param.grad)
    else:
        handle.grads.set_grad_views()
