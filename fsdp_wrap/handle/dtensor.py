"""DTensor parameters (tensor parallelism) inside flat parameters.

A model made tensor-parallel with ``parallelize_module`` holds some
parameters as DTensors on a TP mesh.  A unit built over the data-parallel
slice of the same root mesh (``device_mesh=mesh["dp"]``) flattens each such
parameter's *local* tensor, exactly as torch's FSDP1 does through its
``DTensorExtensions``: everything the handle computes (layout, shards,
gathers, reductions, optimizer-visible shapes) is about the local tensors, and
a parameter becomes a DTensor again only where the modules or the user see it:

* :func:`localize`, before flattening: each DTensor parameter is replaced by a
  plain ``Parameter`` holding its local tensor, and its :class:`TPSpec`
  (mesh, placements, global shape and stride) is kept;
* :func:`as_dtensor`, when views are made: a view of the unsharded data is
  wrapped back with ``DTensor.from_local`` (differentiable: the gradient of the
  DTensor view arrives as the local view's gradient, redistributed to the
  parameter's placements by DTensor's own backward);
* :func:`local_value`, when a value comes in (state dicts): a DTensor, or a
  plain tensor of the global shape, becomes this rank's local tensor.

Nothing here communicates except where a value must be redistributed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_wrap.handle.config import UnitSettings

__all__ = [
    "TPSpec",
    "as_dtensor",
    "check_orthogonal",
    "full_global",
    "is_dtensor",
    "local_value",
    "local_of",
    "localize",
    "root_mesh",
    "tp_group",
]


@dataclass(frozen=True)
class TPSpec:
    """What turns one flattened local tensor back into its DTensor parameter."""

    mesh: Any  # the TP DeviceMesh (one dimension)
    placements: tuple[Any, ...]
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global stride

    @property
    def sharded(self) -> bool:
        """Whether the ranks of the TP mesh hold different parts (not a replica)."""
        return any(p.is_shard() for p in self.placements)

    def describe(self) -> str:
        return f"DTensor{tuple(self.shape)} {list(self.placements)} on {self.mesh}"


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor's module (no
    value is one before something else imported it)."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(value, cls)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (under ``no_grad``: the tensor itself, not a
    view), a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _tag(rank: int, unit: str) -> str:
    return f"(rank {rank}, FSDP unit '{unit or '<root>'}')"


def localize(
    params: Sequence[tuple[str, nn.Module, str, nn.Parameter]], settings: UnitSettings,
    unit: str, pending_flag: str,
) -> tuple[list[nn.Parameter], list[tuple[str, nn.Module, str, nn.Parameter]],
           list[TPSpec | None]]:
    """The user's Parameter objects, the parameters as the handle flattens them,
    and each one's :class:`TPSpec` (``settings``: the unit's rank and groups).

    A DTensor parameter becomes a plain ``Parameter`` of its local tensor (the
    same storage; the flat parameter copies it), with its ``requires_grad``
    and its ``pending_flag`` attribute (values a checkpoint will fill); plain
    parameters pass through with spec ``None``.  A placement other than
    ``Shard``/``Replicate``, or a mesh of more than one dimension, is refused
    (torch's FSDP1 handles only these: "Only 1D DeviceMeshes currently handled"),
    and so is a TP mesh that shares ranks with FSDP's ``groups``
    (:func:`check_orthogonal`).
    """
    rank = settings.rank
    out: list[tuple[str, nn.Module, str, nn.Parameter]] = []
    specs: list[TPSpec | None] = []
    for fqn, mod, name, p in params:
        if not is_dtensor(p):
            out.append((fqn, mod, name, p))
            specs.append(None)
            continue
        mesh, placements = p.device_mesh, tuple(p.placements)  # type: ignore[attr-defined]
        if mesh.ndim != 1:
            raise ValueError(
                f"Only 1D DeviceMeshes currently handled: parameter '{fqn}' is a DTensor on a "
                f"{mesh.ndim}-D mesh {mesh} {_tag(rank, unit)}. Parallelize the model over "
                "the tensor-parallel slice (parallelize_module(model, mesh['tp'], plan)) and "
                "pass the data-parallel slice to FSDP (device_mesh=mesh['dp'])"
            )
        if not all(pl.is_shard() or pl.is_replicate() for pl in placements):
            raise ValueError(
                f"FSDP flattens DTensor parameters placed Shard or Replicate, but '{fqn}' is "
                f"{list(placements)} {_tag(rank, unit)}; redistribute it first"
            )
        local = p.to_local().detach()  # type: ignore[attr-defined]
        plain = nn.Parameter(local, requires_grad=p.requires_grad)
        if getattr(p, pending_flag, False):
            setattr(plain, pending_flag, True)
        out.append((fqn, mod, name, plain))
        specs.append(TPSpec(mesh, placements, torch.Size(p.shape), tuple(p.stride())))
    check_orthogonal(specs, [fqn for fqn, *_ in params],
                     [settings.process_group, settings.replicate_group], rank, unit)
    return [p for *_, p in params], out, specs


def check_orthogonal(specs: Sequence[TPSpec | None], fqns: Sequence[str], groups: Sequence[Any],
                     rank: int, unit: str) -> None:
    """Refuse DTensor parameters whose TP mesh shares ranks with FSDP's groups.

    FSDP shards (and replicates) over its own ranks; a DTensor parameter must
    be split over *other* ranks (another dimension of the same mesh), so each
    TP group meets each FSDP group in this rank alone.  Passing the whole
    ``dp x tp`` mesh (or its TP slice) as ``device_mesh`` breaks that.
    """
    import torch.distributed as dist

    for spec, fqn in zip(specs, fqns):
        if spec is None:
            continue
        me = dist.get_rank()
        tp_ranks = set(spec.mesh.mesh.flatten().tolist())
        for group in groups:
            if group is None:
                continue
            common = tp_ranks & set(dist.get_process_group_ranks(group))
            if common != {me}:
                raise ValueError(
                    f"DTensor parameter '{fqn}' is split over ranks {sorted(tp_ranks)} (its mesh "
                    f"{spec.mesh}), and FSDP would shard or replicate it over ranks "
                    f"{sorted(dist.get_process_group_ranks(group))} as well "
                    f"{_tag(rank, unit)}. Pass FSDP the data-parallel slice of the mesh "
                    "(device_mesh=mesh['dp'], or mesh['replicate', 'shard'] for a hybrid "
                    "strategy), not a dimension the tensor parallelism uses"
                )


def as_dtensor(local: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """``local`` (a view of unsharded data, of the local shape) as the DTensor
    parameter it stands for; differentiable, and no copy or collective."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )


def full_global(local: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """The whole parameter from its local tensor (already gathered over the
    data-parallel group): an all-gather over the TP group, which every TP rank
    must enter, in the same order."""
    with torch.no_grad():
        return as_dtensor(local, spec).full_tensor()  # type: ignore[attr-defined,no-any-return]


def local_value(value: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """This rank's local tensor of an incoming full value of a DTensor parameter.

    A DTensor is redistributed to the parameter's placements (nothing moves
    when it has them already) on its mesh; a plain tensor of the global shape
    is cut as the placements cut it (every rank holds the whole, no
    collective).  The caller checks the shape of what comes back.
    """
    from torch.distributed.tensor import distribute_tensor

    if is_dtensor(value):
        if value.device_mesh == spec.mesh:  # type: ignore[attr-defined]
            if tuple(value.placements) != spec.placements:  # type: ignore[attr-defined]
                value = value.redistribute(spec.mesh, spec.placements)  # type: ignore[attr-defined]
            return value.to_local()  # type: ignore[attr-defined]
        value = value.full_tensor()  # type: ignore[attr-defined]
    if tuple(value.shape) != tuple(spec.shape):
        return value  # (the caller reports the mismatch with the global shape)
    return distribute_tensor(value.detach(), spec.mesh, spec.placements,
                             src_data_rank=None).to_local()


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it is a root)."""
    if mesh is None:
        return None
    getter = getattr(mesh, "_get_root_mesh", None)
    return getter() if getter is not None else mesh


def tp_group(specs: Sequence[TPSpec | None]) -> Any:
    """The process group of the TP mesh of ``specs`` (``None`` when none is a DTensor)."""
    for spec in specs:
        if spec is not None:
            return spec.mesh.get_group()
    return None

