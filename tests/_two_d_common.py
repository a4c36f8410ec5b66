"""Shared pieces of the 2-D (FSDP1 + tensor parallelism) tests, run inside pool workers.

On 4 gloo ranks the mesh is ``dp=2 x tp=2`` (``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("dp", "tp"))``): ranks ``0, 1`` and ``2, 3`` are TP groups,
``0, 2`` and ``1, 3`` data-parallel groups.  :class:`TPNet` is made
tensor-parallel with ``ColwiseParallel``/``RowwiseParallel`` on its two MLPs
(some parameters then are DTensors, the others stay plain), and wrapped by
torch's FSDP1 or by fsdp_wrap over ``mesh["dp"]``.  Sizes are odd where TP
allows, so flat parameters need padding over 2 ranks.

:class:`ReplicatedTP` is the reference where torch's FSDP1 cannot run a
configuration on CPU: the same TP model without FSDP, its gradients averaged
over the data-parallel group (what every FSDP strategy must produce).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import fsdp_api, wrap_api

D_IN, D, H, D_OUT = 5, 7, 10, 3

_MESHES: dict[tuple[int, ...], Any] = {}


def mesh_2d() -> Any:
    """The ``(dp=2, tp=2)`` mesh of this worker (made once: each mesh makes groups)."""
    return _mesh((2, 2), ("dp", "tp"))


def mesh_3d(shape: tuple[int, int, int] = (1, 2, 2)) -> Any:
    """A ``(rep, shard, tp)`` mesh for the hybrid strategies with TP."""
    return _mesh(shape, ("rep", "shard", "tp"))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = (*shape, hash(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class TPNet(nn.Module):
    """A plain input layer, two MLP blocks (made TP), a norm and a plain head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Mlp(), Mlp()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(2):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return plan


def tp_model(tp_mesh: Any, seed: int = 0) -> nn.Module:
    """A fresh :class:`TPNet` (same values on every rank), parallelized over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = TPNet()
    parallelize_module(model, tp_mesh, tp_plan())
    return model


def make_input(gen: torch.Generator, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, D_IN, generator=gen)


def data_gen(seed: int = 0) -> torch.Generator:
    """Different data per data-parallel rank, the same within a TP group (TP
    ranks must see the same batch)."""
    dp_rank = dist.get_rank() // 2 if dist.get_world_size() == 4 else dist.get_rank()
    return torch.Generator().manual_seed(1000 + 7919 * dp_rank + seed)


def wrap(impl: str, model: nn.Module, *, nested: bool = False, ac: str | None = None,
         **kw: Any) -> nn.Module:
    """``model`` wrapped by ``impl``'s FSDP (``"torch"`` or ``"ours"``); enum names allowed.

    ``nested``: one unit per MLP block; ``ac``: activation checkpointing of the
    blocks (``"reentrant"`` or ``"non_reentrant"``), applied after wrapping.
    """
    api = fsdp_api(impl)
    if isinstance(kw.get("sharding_strategy"), str):
        kw["sharding_strategy"] = api.ShardingStrategy[kw["sharding_strategy"]]
    if impl == "torch":
        kw.setdefault("device_id", torch.device("cpu"))
    if nested:
        kw["auto_wrap_policy"] = wrap_api(impl).ModuleWrapPolicy({Mlp})
    fsdp = api.FullyShardedDataParallel(model, **kw)
    if ac is not None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        impl_ = CheckpointImpl.REENTRANT if ac == "reentrant" else CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(
            fsdp, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl_),
            check_fn=lambda m: isinstance(m, Mlp))
    return fsdp


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local tensor (plain tensors as they are)."""
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicatedTP:
    """The TP model without FSDP; gradients averaged over the data-parallel group."""

    def __init__(self, model: nn.Module, dp_group: Any) -> None:
        self.module = copy.deepcopy(model)
        self.group = dp_group

    def sync(self) -> None:
        ws = dist.get_world_size(self.group)
        for p in self.module.parameters():
            g = local(p.grad)
            if g is not None:
                dist.all_reduce(g, group=self.group)
                g.div_(ws)

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The gradient norm of the whole model: every element of every
        parameter once (a DTensor's full gradient), in float64."""
        grads = []
        for p in self.module.parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads.append(g.detach().double().reshape(-1))
        flat = torch.cat(grads)
        if math.isinf(norm_type):
            return flat.abs().max()
        return flat.abs().pow(norm_type).sum().pow(1.0 / norm_type)

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        total = self.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total.float() + 1e-6), max=1.0)
        for p in self.module.parameters():
            g = local(p.grad)
            if g is not None:
                g.mul_(coef)
        return total
