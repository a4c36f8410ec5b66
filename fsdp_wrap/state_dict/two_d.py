"""2-D state dicts: units over the data-parallel slice of a mesh whose other
dimension is tensor parallelism (DTensor parameters, :mod:`fsdp_wrap.handle.dtensor`).

torch's FSDP1 switches its state-dict formats to 2-D when the unit's
``device_mesh`` is a slice of a larger mesh (its ``DTensorExtensions``); the
formats here are that one's, value for value:

* FULL: a DTensor parameter's value is a DTensor on its TP mesh with its TP
  placements and global shape, its local tensor gathered over the
  data-parallel group (:func:`full_value`); plain parameters stay plain.
* SHARDED: every value is a DTensor on the *root* mesh: a plain parameter
  ``[Shard(0), Replicate(), ...]``, a DTensor parameter ``[Replicate(), ...,
  Shard(0), tp_placement]`` (:func:`sharded_placements`).  It is made as torch
  makes it, from the value gathered over the data-parallel group, placed
  ``[Replicate(), ..., tp_placement]`` and redistributed (:func:`to_sharded`).
* Loading either (and optimizer state): a value becomes the parameter's local
  tensor gathered over the data-parallel group (:func:`to_full_local`), which
  the FULL paths then cut into this rank's shard.  A plain tensor of the
  global shape is accepted for a DTensor parameter too (torch's FSDP1 refuses
  it), and so is a DTensor of any placements on the root mesh.
* LOCAL is refused with a device mesh, as torch refuses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.handle.dtensor import TPSpec, is_dtensor, local_value, root_mesh

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle
    from fsdp_wrap.runtime.state import UnitState

__all__ = [
    "check_sharded_supported",
    "full_value",
    "is_two_d",
    "sharded_placements",
    "to_full_local",
    "to_sharded",
]


def is_two_d(state: UnitState) -> bool:
    """Whether the unit's mesh is a slice of a larger one (torch's test for 2-D)."""
    mesh = state.settings.device_mesh
    return mesh is not None and root_mesh(mesh) != mesh


def has_dtensor_params(state: UnitState) -> bool:
    return any(i.spec is not None for h in state._handles for i in h.infos)


def check_sharded_supported(state: UnitState, unit: str) -> None:
    """SHARDED values of DTensor parameters need the root mesh the TP mesh
    and FSDP's slice come from: refuse a unit built from a process group."""
    if has_dtensor_params(state) and not is_two_d(state):
        raise ValueError(
            f"[rank {global_rank()}] SHARDED_STATE_DICT of FSDP unit '{unit or '<root>'}', "
            "whose parameters include DTensors, needs the unit built with "
            "device_mesh=mesh['dp'] (the data-parallel slice of the mesh the tensor "
            "parallelism uses) so its values can be DTensors on that mesh; it was built "
            "with a process group or a mesh of its own. Use FULL_STATE_DICT, or wrap with "
            "the device_mesh"
        )


def full_value(value: torch.Tensor, spec: TPSpec | None) -> torch.Tensor:
    """A FULL state-dict value: a DTensor parameter's gathered local tensor as
    its DTensor (no copy, no collective)."""
    if spec is None:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)


def sharded_placements(ndim: int, spec: TPSpec | None) -> list[Any]:
    """torch's SHARDED placements on a root mesh of ``ndim`` dimensions."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = [Replicate() for _ in range(ndim)]
    if spec is None:
        out[0] = Shard(0)
    else:
        out[-2], out[-1] = Shard(0), spec.placements[0]
    return out


def _gathered_placements(ndim: int, spec: TPSpec | None) -> list[Any]:
    """Placements of a value gathered over the data-parallel group."""
    from torch.distributed.tensor import Replicate

    out: list[Any] = [Replicate() for _ in range(ndim)]
    if spec is not None:
        out[-1] = spec.placements[0]
    return out


def to_sharded(full_local: torch.Tensor, spec: TPSpec | None, state: UnitState,
               offload_to_cpu: bool) -> torch.Tensor:
    """A SHARDED value from the local tensor gathered over the data-parallel
    group (a copy; a collective over the root mesh where DTensor must move
    data)."""
    from torch.distributed.tensor import DTensor

    root = root_mesh(state.settings.device_mesh)
    shape = spec.shape if spec is not None else full_local.shape
    stride = spec.stride if spec is not None else full_local.stride()
    value = DTensor.from_local(
        full_local.detach().clone(), root, _gathered_placements(root.ndim, spec),
        run_check=False, shape=shape, stride=stride,
    ).redistribute(root, sharded_placements(root.ndim, spec))
    return value.cpu() if offload_to_cpu else value


def to_full_local(value: Any, spec: TPSpec | None, state: UnitState) -> Any:
    """An incoming value as the parameter's local tensor gathered over the
    data-parallel group (what the FULL paths load); anything else (a scalar, a
    ShardedTensor, a wrong shape) is returned for the caller to judge.

    A collective over the value's mesh when it is a DTensor that must move.
    """
    if not isinstance(value, torch.Tensor):
        return value
    if is_dtensor(value):
        root = root_mesh(state.settings.device_mesh) if state.settings.device_mesh is not None else None
        if root is not None and value.device_mesh == root:  # type: ignore[attr-defined]
            want = _gathered_placements(root.ndim, spec)
            if list(value.placements) != want:  # type: ignore[attr-defined]
                value = value.redistribute(root, want)  # type: ignore[attr-defined]
            return value.to_local()  # type: ignore[attr-defined]
        if spec is None:
            return value.full_tensor()  # type: ignore[attr-defined]
    return local_value(value, spec) if spec is not None else value


def localize_state(h: FlatParamHandle, fqns: Sequence[str], state_in: dict[str, dict[str, Any]],
                   state: UnitState) -> None:
    """Optimizer state being loaded, in place: each positive-dimension value of
    a parameter of ``h`` (clean FQNs ``fqns``) as its gathered local tensor.

    Every rank calls it with the same keys (redistributing is a collective):
    parameters in order, state names sorted.
    """
    for info, fqn in zip(h.infos, fqns):
        st = state_in.get(fqn)
        if not st:
            continue
        for name in sorted(st):
            v = st[name]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                st[name] = to_full_local(v, info.spec, state)


def applies(state: UnitState) -> bool:
    """Whether the unit's state dicts take the 2-D paths here."""
    return is_two_d(state) or has_dtensor_params(state)


def _present_keys(state: UnitState, state_dict: dict[str, Any], wrapped: str
                  ) -> Iterator[tuple[Any, str]]:
    """``(info, key)`` for each of the unit's parameters in order and each name
    it goes by (shared names after the parameter they name), where
    ``state_dict`` holds that key."""
    from fsdp_wrap.runtime.names import clean_fqn

    for h in state._handles:
        for info in h.infos:
            keys = [wrapped + clean_fqn(info.fqn)]
            keys += [wrapped + clean_fqn(s.fqn) for s in h.shared if h.infos[s.index] is info]
            for key in keys:
                if key in state_dict:
                    yield info, key


def incoming_model_values(state: UnitState, state_dict: dict[str, Any], wrapped: str) -> None:
    """A model state dict being loaded (FULL, or SHARDED in 2-D), in place:
    the unit's parameter values as their gathered local tensors, which the
    FULL load then cuts into the shards.  Parameters in order (a collective
    where a DTensor must move)."""
    for info, key in _present_keys(state, state_dict, wrapped):
        state_dict[key] = to_full_local(state_dict[key], info.spec, state)


def outgoing_sharded_values(state: UnitState, state_dict: dict[str, Any], wrapped: str,
                            offload_to_cpu: bool) -> None:
    """SHARDED save in 2-D, in place: the unit's registered (gathered) values
    become torch's root-mesh DTensors.  Parameters in order, shared names
    after the parameter they name."""
    for info, key in _present_keys(state, state_dict, wrapped):
        value = state_dict[key]
        local = value.to_local() if is_dtensor(value) else value
        state_dict[key] = to_sharded(local, info.spec, state, offload_to_cpu)
