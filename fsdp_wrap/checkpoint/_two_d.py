"""Full checkpoints of 2-D models (DTensor parameters, :mod:`fsdp_wrap.handle.dtensor`).

A full checkpoint holds every parameter whole, gathered over both mesh
dimensions, as plain tensors (the unwrapped model's safetensors).  A flat
parameter holding DTensor parameters keeps only this rank's TP-local
elements, which are not a contiguous range of the whole tensor (a column
shard of a row-major weight), so such a flat parameter does not take the
windowed point-to-point path: every rank gathers it over its data-parallel
group, each TP group gathers each parameter whole, and rank 0 writes it
(one unit plus one whole parameter per rank at a time).  Loading reads a
DTensor parameter whole and keeps this rank's part of its local tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.handle.dtensor import full_global, local_value
from fsdp_wrap.handle.full_copies import gather_full_flat, param_views

__all__ = ["has_dtensors", "load_param", "refuse_optim", "stream_handle"]


def has_dtensors(h: Any) -> bool:
    return any(info.spec is not None for info in h.infos)


def stream_handle(h: Any, chosen: list[int], names: Callable[[int], list[str]],
                  write: Callable[[str, torch.Tensor], None] | None) -> None:
    """Write the original parameters ``chosen`` of ``h`` whole (``write`` on the
    writing rank, ``None`` elsewhere).  A collective over the handle's group
    and every TP group: every rank calls it, for the same handles in order."""
    full = gather_full_flat(h, to_rank0_only=False)
    if full is None:  # (never without to_rank0_only)
        return
    views = param_views(h, full)
    del full
    for i in chosen:
        spec = h.infos[i].spec
        whole = full_global(views[i], spec) if spec is not None else views[i]
        if write is not None:
            for name in names(i):
                write(name, whole.reshape(-1))


def load_param(h: Any, i: int, whole: torch.Tensor) -> None:
    """Copy this rank's part of parameter ``i``'s ``whole`` (read from a file)
    into the handle's local shard; no collective."""
    info = h.infos[i]
    h.load_param(i, local_value(whole, info.spec) if info.spec is not None else whole)


def refuse_optim(root: Any, optim: Any, what: str) -> None:
    """Optimizer state (``optim`` not ``None``) in full checkpoints of 2-D models
    is not written or read yet: refused before any collective, with the way
    that works."""
    if optim is None:
        return
    for st in root._all_fsdp_states:
        for h in st._handles:
            tp = [info.fqn for info in h.infos if info.spec is not None]
            if tp:
                raise NotImplementedError(
                    f"[rank {global_rank()}] {what} with an optimizer does not handle DTensor "
                    f"(tensor-parallel) parameters yet ('{tp[0]}' of unit "
                    f"'{h.unit_fqn or '<root>'}' holds some). Save the model alone here, and the "
                    "optimizer with SHARDED_STATE_DICT through torch.distributed.checkpoint "
                    "(docs/two_d.rst)"
                )
