"""``clip_grad_norm_``: the true global gradient norm over every shard, and the clip.

The local norms are computed in fp32, ``norm ** p`` is summed over the
unit's group (max for ``inf``) and every gradient is scaled in place by
``min(1, max_norm / (total + 1e-6))``, as torch's FSDP1 does.  Gradients of
parameters no unit manages (ignored ones) are counted once, on every rank,
as torch counts them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.runtime.accumulation import warn_if_partial
from fsdp_wrap.runtime.grad_norm_two_d import clip_two_d, scale_to_norm, tp_group_of
from fsdp_wrap.runtime.state import TrainingState, UnitState, expect_state
from fsdp_wrap.runtime.tree import lazy_init

__all__ = ["clip_grad_norm"]


def clip_grad_norm(state: UnitState, max_norm: float | int,
                   norm_type: float | int = 2.0) -> torch.Tensor:
    """Clip the gradients of ``state``'s tree (its root's); return the total norm
    in the gradients' dtype.  One all-reduce of one scalar (none when no unit
    is sharded).  Called by the façade's ``clip_grad_norm_`` under
    ``torch.no_grad()``."""
    lazy_init(state)
    if not state._is_root:
        raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP instance")
    expect_state(state, TrainingState.IDLE, action="clip_grad_norm_()",
                 fix="call it after backward and before the optimizer step")
    warn_if_partial(state, "clip_grad_norm_()")
    max_norm, norm_type = float(max_norm), float(norm_type)
    tp_group = tp_group_of(state)  # (DTensor parameters: TP shards counted once)
    if tp_group is not None:
        return clip_two_d(state, max_norm, norm_type, tp_group)
    sharded: list[torch.Tensor] = []
    nonsharded: list[torch.Tensor] = []
    managed: set[nn.Parameter] = set()
    for h in state._all_handles:
        (sharded if h.uses_sharded_strategy else nonsharded).extend(h.grads.for_norm())
        managed.update(h.params if h.use_orig_params else [h.flat_param])
    every = list(state.module.parameters())
    for p in every:
        if p not in managed and p.grad is not None:
            managed.add(p)
            nonsharded.append(p.grad)
    all_grads = sharded + nonsharded
    if all(not h.uses_sharded_strategy for h in state._all_handles):
        return torch.nn.utils.clip_grad_norm_(
            [p for p in every if p.grad is not None], max_norm, norm_type
        )
    device = state.compute_device
    local_sharded = _grad_norm(sharded, norm_type, device)
    local_non = _grad_norm(nonsharded, norm_type, device) if nonsharded else None
    if math.isinf(norm_type):
        total = local_sharded if local_non is None else torch.maximum(local_sharded, local_non)
        C.all_reduce(total, state.process_group, dist.ReduceOp.MAX)
    else:
        total = local_sharded**norm_type
        C.all_reduce(total, state.process_group)
        if local_non is not None:
            total += local_non**norm_type
        total = total ** (1.0 / norm_type)
    # (5: scale_to_norm, this, the façade, torch's no_grad wrapper, the caller)
    return scale_to_norm(state.rank, all_grads, max_norm, total, stacklevel=5)


def _grad_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.tensor(0.0, device=device)
    norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type, dtype=torch.float32).to(device)
