"""``summon_full_params``: full original parameters, on demand, for a while.

Each unit is gathered in full precision; its original parameters are
registered with their full shapes (on CPU with ``offload_to_cpu``; on a CPU
compute device a copy of the gathered data, see :func:`_copies_out`); on exit
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

from fsdp_wrap.handle.flat_tensor import HandleTrainingState
from fsdp_wrap.runtime.state import TrainingState, UnitState, enter, expect_state
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
            expect_state(st, TrainingState.IDLE, action="summon_full_params()",
                         error=AssertionError, sentence="Cannot manually unshard parameters "
                         "when already unsharding parameters",
                         fix="leave the outer summon_full_params() first")
        expect_state(st, TrainingState.IDLE, action="summon_full_params()",
                     error=AssertionError,
                     sentence="Cannot manually unshard parameters during forward/backward",
                     fix="call it outside forward and backward")


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
            h.expect_phase((HandleTrainingState.IDLE,), "entering summon_full_params()")
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
            enter(st, TrainingState.SUMMON_FULL_PARAMS)
            entered.append((st, None, None, False, None))  # (puts the unit back to IDLE)
            for h in st._handles:
                h.enter(HandleTrainingState.SUMMON_FULL_PARAMS)
                entered.append((st, h, None, False, None))  # (resharded even if this fails)
                entered[-1] = (st, h, *_summon_handle(h, st.rank, rank0_only,
                                                      offload_to_cpu, with_grads))
        yield
    finally:
        for st, handle, cpu_copy, shown, full_grad in reversed(entered):
            if handle is None:
                enter(st, TrainingState.IDLE)
                continue
            if shown and writeback:
                if cpu_copy is not None:
                    handle.write_back_from(cpu_copy)
                else:
                    handle.write_back_unsharded()
                if full_grad is not None:
                    handle.grads.write_back_full(full_grad)
            handle.reshard(free=True)  # (idempotent: a rank not shown freed already)
            if with_grads and shown:
                handle.grads.show_sharded()
            handle.enter(HandleTrainingState.IDLE)


def _copies_out(handle: FlatParamHandle, with_grads: bool) -> bool:
    """Whether a summon on a CPU compute device shows a copy of the gathered
    data rather than the gathered data itself.

    The gathered storage is freed (resized to nothing) at the context's exit.
    On a GPU, code that keeps what it read inside the context moves it to the
    CPU first (``p.detach().cpu()``, verl's and PEFT's weight syncs), which
    copies; on a CPU that ``.cpu()`` is the parameter itself, and reading it
    after the exit reads freed memory (torch's FSDP1: a segmentation fault).
    Showing a copy, which the exit only lets go of, keeps such reads valid.
    Not for NO_SHARD (the views are the shard: nothing is freed) nor
    ``with_grads`` (the gradients are shown beside the gathered data).
    """
    return handle.device.type == "cpu" and handle.uses_sharded_strategy and not with_grads


def _summon_handle(handle: FlatParamHandle, rank: int, rank0_only: bool, offload_to_cpu: bool,
                   with_grads: bool) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """Gather one flat parameter and show its original parameters at full
    size; returns its CPU copy (``offload_to_cpu``), whether it is shown, and
    the full gradient shown (``with_grads``; written back at the exit)."""
    full_grad = handle.grads.gather_full() if with_grads else None
    handle.finish_unshard(full_precision=True)
    cpu_copy: torch.Tensor | None = None
    shown = not (rank0_only and rank != 0)
    if not shown:
        handle.reshard(free=True)
    elif offload_to_cpu or _copies_out(handle, with_grads):
        cpu_copy = handle.flat_param.detach().to("cpu", copy=True)
        handle.use_unsharded_views(as_params=True, source=cpu_copy)
        if handle.device.type == "cpu":
            # The copy stands in for the gathered data, freed now (as torch's
            # offload frees the device's): one full copy held, not two.
            handle.flat_param.data = cpu_copy
            handle.free_unsharded_storage(full_precision=True)
    else:
        handle.use_unsharded_views(as_params=True)
    if with_grads and shown:
        handle.grads.show_full(full_grad)
        handle.views.show_dtensor_grads()  # (DTensor parameters: registered apart)
    return cpu_copy, shown, full_grad if shown else None
