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

from ._runtime import TrainingState

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP


def check_options(
    states: Sequence[FSDP], writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> None:
    """torch's rules for invalid option combinations (same order and text),
    checked on every unit before any collective."""
    for st in states:
        uop = st._use_orig_params
        if with_grads and (offload_to_cpu or not uop):
            raise NotImplementedError(
                f"with_grads={with_grads}, use_orig_params={uop}, offload_to_cpu={offload_to_cpu} "
                "is not supported yet"
            )
        if offload_to_cpu and st._handle is not None and not st._handle.uses_sharded_strategy:
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
        st._lazy_init()
        if st.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise AssertionError(
                "Cannot manually unshard parameters when already unsharding parameters"
            )
        if st.training_state is not TrainingState.IDLE:
            raise AssertionError("Cannot manually unshard parameters during forward/backward")


@contextlib.contextmanager
def summon(
    states: Sequence[FSDP],
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Generator[None, None, None]:
    check_options(states, writeback, rank0_only, offload_to_cpu, with_grads)
    for st in states:
        if st._handle is not None:
            st._handle.pre_unshard()  # write-back checks before any collective
    entered: list[tuple[FSDP, torch.Tensor | None, bool]] = []
    try:
        for st in states:
            st.training_state = TrainingState.SUMMON_FULL_PARAMS
            handle = st._handle
            if handle is None:
                entered.append((st, None, False))
                continue
            full_grad = handle.gather_full_grad() if with_grads else None
            handle.finish_unshard(full_precision=True)
            cpu_copy: torch.Tensor | None = None
            shown = not (rank0_only and st.rank != 0)
            if not shown:
                handle.reshard(free=True)
            elif offload_to_cpu:
                cpu_copy = handle.flat_param.detach().to("cpu", copy=True)
                handle.use_unsharded_views(as_params=True, source=cpu_copy)
            else:
                handle.use_unsharded_views(as_params=True)
            if full_grad is not None and shown:
                handle.show_full_grads(full_grad)
            entered.append((st, cpu_copy, shown))
        yield
    finally:
        for st, cpu_copy, shown in reversed(entered):
            handle = st._handle
            if handle is not None and shown:
                if writeback:
                    if cpu_copy is not None:
                        handle.write_back_from(cpu_copy)
                    else:
                        handle.write_back_unsharded()
                handle.reshard(free=True)
                if with_grads:
                    handle.show_sharded_grads()
            st.training_state = TrainingState.IDLE
