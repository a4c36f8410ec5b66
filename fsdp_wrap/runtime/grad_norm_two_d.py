"""``clip_grad_norm_`` of a 2-D tree: every gradient element counted once.

With DTensor parameters (:mod:`fsdp_wrap.handle.dtensor`) the elements of a
TP-sharded parameter are spread over the TP group as well as over the unit's
group, while plain and TP-replicated parameters are the same on every TP
rank.  The TP-sharded part is summed over the TP group too, so the norm is the
whole model's and the same on every rank.  (torch's FSDP1 sums over the
data-parallel group only: each TP rank gets the norm of its own shard and the
TP ranks clip by different factors; docs/two_d.rst.)  Without DTensor
parameters :mod:`fsdp_wrap.runtime.grad_norm` computes it, as torch does.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
from fsdp_wrap.handle.dtensor import is_dtensor

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle
    from fsdp_wrap.runtime.state import UnitState

__all__ = ["clip_two_d", "tp_group_of"]


def _unmanaged_grads(root: UnitState) -> list[torch.Tensor]:
    """Gradients of parameters no flat parameter holds (ignored modules), once each."""
    managed: set[nn.Parameter] = set()
    for h in root._all_handles:
        managed.update(h.params if h.use_orig_params else [h.flat_param])
    out: list[torch.Tensor] = []
    for p in root.module.parameters():
        if p not in managed and p.grad is not None:
            managed.add(p)
            out.append(p.grad)
    return out


def clip_two_d(root: UnitState, max_norm: float, norm_type: float, tp_group: Any) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (total + 1e-6))``; return
    ``total``, the whole model's norm (a collective over the unit's group and
    the TP group)."""
    # [data-parallel sharded?][TP sharded?]
    parts: dict[tuple[bool, bool], list[torch.Tensor]] = {
        (a, b): [] for a in (True, False) for b in (True, False)}
    for h in root._all_handles:
        tp_sharded, tp_same = grads_by_tp(h)
        parts[(h.uses_sharded_strategy, True)] += tp_sharded
        parts[(h.uses_sharded_strategy, False)] += tp_same
    for g in _unmanaged_grads(root):
        shard = is_dtensor(g) and any(p.is_shard() for p in g.placements)  # type: ignore[attr-defined]
        parts[(False, shard)].append(g.to_local() if is_dtensor(g) else g)  # type: ignore[attr-defined]
    device = root.compute_device
    norms = {key: _grad_norm(grads, norm_type, device) for key, grads in parts.items()}
    if math.isinf(norm_type):
        total = torch.stack(list(norms.values())).max()
        C.all_reduce(total, root.process_group, dist.ReduceOp.MAX)
        C.all_reduce(total, tp_group, dist.ReduceOp.MAX)
    else:
        # Sum the TP-sharded parts over the TP group, then the data-parallel
        # sharded parts over the unit's group; what is the same on every rank
        # of a group is added once.
        tp_parts = torch.stack([norms[(True, True)], norms[(False, True)]]) ** norm_type
        C.all_reduce(tp_parts, tp_group)
        dp_part = tp_parts[0] + norms[(True, False)] ** norm_type
        C.all_reduce(dp_part, root.process_group)
        total = (dp_part + tp_parts[1] + norms[(False, False)] ** norm_type) ** (1.0 / norm_type)
    # (6: scale_to_norm, this, clip_grad_norm, the façade, torch's no_grad wrapper, the caller)
    return scale_to_norm(root.rank, [g for grads in parts.values() for g in grads], max_norm,
                         total, stacklevel=6)


def grads_by_tp(handle: FlatParamHandle) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The handle's gradients for a norm, split into the pieces of TP-sharded
    parameters (each TP rank holds other elements) and the rest (the same on
    every TP rank): ``clip_grad_norm_`` sums the first over the TP group too.

    ``use_orig_params=True``: the original parameters' gradients; otherwise
    each parameter's piece of the flat gradient (alignment padding left out).
    """
    sharded: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    if handle.use_orig_params:
        for info in handle.infos:
            if info.param.grad is not None:
                (sharded if info.spec is not None and info.spec.sharded else rest).append(
                    info.param.grad)
        return sharded, rest
    grad = handle.flat_param.grad
    if grad is None:
        return sharded, rest
    for i, info in enumerate(handle.infos):
        if handle.uses_sharded_strategy:
            piece = handle.param_shard_slice(i)
        else:
            piece = (info.offset, info.offset + info.numel)
        if piece is not None:
            part = grad[piece[0] : piece[1]]
            (sharded if info.spec is not None and info.spec.sharded else rest).append(part)
    return sharded, rest


def scale_to_norm(rank: int, all_grads: list[torch.Tensor], max_norm: float,
                  total: torch.Tensor, stacklevel: int) -> torch.Tensor:
    """Scale ``all_grads`` by ``max_norm / total`` (at most 1); the total norm
    in the gradients' promoted dtype, as torch returns it (with torch's warning
    where this rank has no gradient).  ``stacklevel`` points the warning at the
    caller of ``FullyShardedDataParallel.clip_grad_norm_``."""
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in all_grads:
        g.mul_(clip_coef.to(g.device, g.dtype))
    if not all_grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {rank} with no gradients -- "
            "returning the total norm in the default dtype torch.float32",
            stacklevel=stacklevel,
        )
        return total
    dtype = all_grads[0].dtype
    for g in all_grads[1:]:
        dtype = torch.promote_types(dtype, g.dtype)
    return total.to(dtype)


def tp_group_of(root: UnitState) -> Any:
    """The TP mesh's group of the tree's DTensor parameters (``None`` without any)."""
    found: list[tuple[Any, str]] = []
    for h in root._all_handles:
        for info in h.infos:
            if info.spec is not None:
                if found and info.spec.mesh.get_group() != found[0][0].get_group():
                    raise ValueError(
                        f"[rank {C.global_rank()}] clip_grad_norm_() needs one tensor-parallel "
                        f"mesh, but '{found[0][1]}' and '{info.fqn}' are DTensors on different "
                        f"meshes ({found[0][0]} vs {info.spec.mesh})"
                    )
                found.append((info.spec.mesh, info.fqn))
    return found[0][0].get_group() if found else None


def _grad_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.tensor(0.0, device=device)
    norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type, dtype=torch.float32).to(device)
