"""The model index the optimizer-state functions share: which FSDP unit and
original parameter each optimizer parameter is, by identity, with clean FQNs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.state_dict.model as SD
from fsdp_wrap.api import StateDictType
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState, state_of
from fsdp_wrap.runtime.tree import initialised_units
from fsdp_wrap.state_dict.two_d import is_two_d

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle


@dataclass
class _Unit:
    """One flat parameter's handle, its FSDP unit and the clean FQNs of its
    original parameters (a unit split into several flat parameters has one
    entry per flat parameter)."""

    state: UnitState
    handle: FlatParamHandle
    fqns: list[str]


@dataclass
class _Index:
    """Which model parameter each optimizer parameter is, by identity."""

    units: list[_Unit] = field(default_factory=list)
    # id(param) -> (unit index or -1, info index or -1 for a flat parameter, FQNs)
    where: dict[int, tuple[int, int, list[str]]] = field(default_factory=dict)

    def fqns_of(self, param: torch.Tensor) -> list[str]:
        entry = self.where.get(id(param))
        if entry is None:
            raise ValueError(
                "The optimizer holds a parameter that is not in the model "
                f"(shape {tuple(param.shape)}); pass the model the optimizer was built for"
            )
        return entry[2]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _index(model: nn.Module) -> _Index:
    if not initialised_units(model):  # (a root may be gone: torch needs none)
        raise ValueError(f"{type(model).__name__} contains no FullyShardedDataParallel unit")
    index = _Index()
    for name, mod in model.named_modules():
        unit = state_of(mod)
        if unit is None:
            continue
        base = clean_fqn(name + ".").rstrip(".")
        for h in unit._handles:  # (one entry per flat parameter: a unit may hold several)
            fqns = [_join(base, clean_fqn(i.fqn)) for i in h.infos]
            u = len(index.units)
            index.units.append(_Unit(unit, h, fqns))
            index.where[id(h.flat_param)] = (u, -1, fqns)
            for k, info in enumerate(h.infos):
                index.where[id(info.param)] = (u, k, [fqns[k]])
    for name, p in model.named_parameters():
        index.where.setdefault(id(p), (-1, -1, [clean_fqn(name)]))
    return index


def _optim_params(optim: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    return [list(g["params"]) for g in optim.param_groups]


def _piece(h: FlatParamHandle, k: int) -> tuple[int, int] | None:
    """Elements ``[lo, hi)`` of original parameter ``k`` held in this rank's shard."""
    if not h.uses_sharded_strategy:
        return 0, h.infos[k].numel
    sl = h.param_shard_slice(k)
    if sl is None:
        return None
    start = h.shard_offset + sl[0] - h.infos[k].offset
    return start, start + sl[1] - sl[0]


def _settings(model: nn.Module) -> tuple[StateDictType, Any]:
    settings = SD.get_state_dict_type(model)
    return settings.state_dict_type, settings.optim_state_dict_config



def _rank0_group(root: UnitState, group: Any) -> Any:
    """The group whose rank 0 ``rank0_only`` means, and that broadcasts on load.

    As torch: the ``group`` argument, by default the default group.  Under
    hybrid sharding that is every replica (only global rank 0 keeps a
    rank0-only optimizer state dict); otherwise fsdp_wrap uses the model's
    own group, which is the default group unless the model was wrapped on a
    subgroup (where torch's default would involve ranks outside the model).
    """
    if group is not None:
        return group
    if root.settings.inter_node_pg is not None or is_two_d(root):  # (2-D: as torch, rank 0)
        return dist.group.WORLD
    return root.process_group

