"""Full weights out of a sharded model, one unit at a time.

:func:`iter_full_weights` yields ``(name, tensor)`` for every key of the FULL
state dict (the unwrapped model's names, tied aliases included), in unit
order: a unit is gathered, each of its original parameters is copied out and
yielded, and the gathered buffer is dropped before the next unit is gathered.
So a consumer that sends or writes each tensor and lets it go never makes a
rank hold more than its shards plus one unit plus one parameter; a FULL state
dict, or ``summon_full_params`` over the whole model, holds the whole model.
Typical uses: pushing weights to an inference engine (RL weight sync),
evaluation in another process, export.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_wrap.checkpoint.full import _fsdp_cls, _names, _units, _unmanaged_tensors
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.handle.dtensor import full_global
from fsdp_wrap.handle.full_copies import gather_full_flat, param_views
from fsdp_wrap.runtime.state import TrainingState, expect_state

if TYPE_CHECKING:
    from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

__all__ = ["iter_full_weights"]

_CPU = torch.device("cpu")


def iter_full_weights(
    model: nn.Module,
    *,
    rank0_only: bool = False,
    dtype: torch.dtype | None = None,
    offload_to_cpu: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the full weights of the fsdp_wrap root ``model`` as ``(name, tensor)``.

    The names and values are those of the FULL state dict, bit for bit: clean
    FQNs of the unwrapped model, parameters in their original (full) precision
    whatever the mixed precision, buffers in their original dtype, every name
    of a tied group (the same tensor object under each), parameters FSDP does
    not manage included.  Each tensor is a fresh copy the consumer owns.

    At most one unit is unsharded at a time: a unit is gathered when the
    iteration reaches it and dropped before the next is gathered.
    ``rank0_only``: only rank 0 receives and yields (the others send their
    shards and yield nothing, never holding a unit).  ``dtype``: floating-point
    tensors are yielded in this dtype (integer and bool buffers unchanged), each
    copy made straight in it.  ``offload_to_cpu``: tensors are yielded on CPU.

    A collective: every rank of the model must run the iteration to its end
    (``rank0_only``: the other ranks too, e.g. ``for _ in iter_full_weights(m,
    rank0_only=True): pass``).  Breaking off on some ranks only leaves the
    others waiting in a gather.  Call it outside forward/backward and outside
    ``summon_full_params``.
    """
    cls = _fsdp_cls()
    if not isinstance(model, cls):
        raise TypeError(
            f"[rank {global_rank()}] iter_full_weights expects the root fsdp_wrap "
            f"FullyShardedDataParallel module but got {type(model).__name__}"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"[rank {global_rank()}] iter_full_weights: dtype must be a floating-point "
            f"torch.dtype (or None for the original dtypes) but got {dtype!r}"
        )
    root: FSDP = model
    if root._is_root is False:
        raise ValueError(f"[rank {global_rank()}] iter_full_weights expects the root FSDP "
                         "module, not a nested unit")
    for _, st in _units(root):
        expect_state(st._fsdp_state, TrainingState.IDLE, action="iter_full_weights()",
                     error=RuntimeError,
                     fix="iterate outside forward/backward and outside summon_full_params")
    return _stream(root, rank0_only, dtype, offload_to_cpu)


def _out(t: torch.Tensor, dtype: torch.dtype | None, to_cpu: bool) -> torch.Tensor:
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.detach().to(device=_CPU if to_cpu else t.device, dtype=target, copy=True)


def _gather_plan(h: object, rank0_only: bool) -> tuple[bool, bool]:
    """``(take part in this unit's gather, to the group's rank 0 only)``."""
    if not rank0_only:
        return True, False
    members = dist.get_process_group_ranks(h.process_group)  # type: ignore[attr-defined]
    if 0 not in members:
        return False, False  # another replica (hybrid sharding): rank 0 gathers elsewhere
    return True, members.index(0) == 0


def _stream(
    root: FSDP, rank0_only: bool, dtype: torch.dtype | None, to_cpu: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    root._lazy_init()
    mine = not rank0_only or dist.get_rank() == 0
    for unit_name, st in _units(root):
        for h in st._handles:  # one per flat parameter (a split unit has several)
            # DTensor parameters (2-D): every rank gathers over its data-parallel
            # group, then each TP group gathers the whole parameter.
            tp = any(info.spec is not None for info in h.infos)
            take_part, only0 = (True, False) if tp else _gather_plan(h, rank0_only)
            full = gather_full_flat(h, to_rank0_only=only0) if take_part else None
            views = param_views(h, full) if full is not None and (mine or tp) else []
            del full  # (the views hold the gathered unit from here on)
            for i in range(len(views)):
                spec = h.infos[i].spec
                whole = full_global(views[i], spec) if spec is not None else views[i]
                if not mine:
                    continue
                value = _out(whole, dtype, to_cpu)
                del whole
                if i == len(views) - 1:
                    views = []  # the unit's gathered copy goes before its last copy is handed out
                for name in _names(h, unit_name, i):
                    yield name, value
                del value
        if mine:
            for key, t, orig in _unmanaged_tensors(unit_name, st):
                yield key, _out(t.detach().to(orig), dtype, to_cpu)
