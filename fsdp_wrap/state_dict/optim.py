"""Optimizer state dicts: FSDP1's optimizer-state APIs.

Every public function here is the implementation behind the static method of
the same name on ``FullyShardedDataParallel``.

The checkpoint format is the unwrapped model's: ``"state"`` keyed by clean
parameter FQNs, ``"param_groups"`` listing FQNs.  Values are

* FULL: full tensors in the original shapes (copies; on CPU when
  ``offload_to_cpu``; ``{}`` off rank 0 with ``rank0_only``);
* SHARDED and LOCAL: dim-0 ``torch.chunk`` pieces of those full tensors as
  ShardedTensor (DTensor ``Shard(0)`` with a device mesh), the same layout as
  the SHARDED model state dict, so DCP can reshard them;
* 0-dim tensors (``step``) and non-tensor values as they are.

Saving gathers, per FSDP unit and per state name (``exp_avg``, ...), the
optimizer state of the unit's flat shard: one all-gather of one flat buffer,
then each original parameter's slice.  A parameter that has no state on some
rank (its shard piece is empty, it is frozen, or it was never stepped) is
valid: which parameters carry which states is agreed once per call with one
small object all-gather.  Loading is the inverse; each rank keeps its own
shard of each state (``optim_state_dict_to_load``).
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.comm.collectives as _collectives
import fsdp_wrap.state_dict.chunks as CH
import fsdp_wrap.state_dict.model as SD
import fsdp_wrap.state_dict.sharded_io as _sharded_io
import fsdp_wrap.state_dict.two_d as two_d
from fsdp_wrap.api import (
    FullOptimStateDictConfig,
    StateDictType,
)
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState
from fsdp_wrap.runtime.tree import units_under
from fsdp_wrap.state_dict.optim_index import (
    _Index,
    _index,
    _optim_params,
    _piece,
    _rank0_group,
    _settings,
)
from fsdp_wrap.state_dict.optim_load import _broadcast_osd, _flatten_optim

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle


# ------------------------------------------------------------------- save


def _by_param_id(
    model: nn.Module, groups: list[list[torch.Tensor]], state: dict[Any, Any],
    saved_groups: list[dict[str, Any]],
) -> tuple[dict[int, Any], dict[Any, Any], dict[Any, int]]:
    """The optimizer's ``state`` keyed by parameter id (position across its param
    groups), and the entries that name none of its parameters (user-defined state,
    which torch copies through); and every key (id or name) -> parameter id.

    A ``NamedOptimizer`` (``torch.distributed.optim._NamedOptimizer``) keys its
    state by the model's parameter names instead of ids; both the names
    ``model.named_parameters()`` gives and their clean forms are recognised.
    """
    flat = [p for params in groups for p in params]
    pid_of: dict[int, int] = {}
    for i, p in enumerate(flat):
        pid_of.setdefault(id(p), i)
    pid_of_key: dict[Any, int] = {}
    if any(isinstance(k, str) for k in state) or any(
        isinstance(x, str) for g in saved_groups for x in g.get("params", [])
    ):
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in pid_of:
                pid_of_key.setdefault(name, pid_of[id(p)])
                pid_of_key.setdefault(clean_fqn(name), pid_of[id(p)])
    by_id: dict[int, Any] = {}
    other: dict[Any, Any] = {}
    for key, value in state.items():
        if type(key) is int and 0 <= key < len(flat):
            by_id[key] = value
        elif isinstance(key, str) and key in pid_of_key:
            by_id[pid_of_key[key]] = value
        else:
            other[key] = value
    pid_of_key.update((i, i) for i in range(len(flat)))
    return by_id, other, pid_of_key


def _local_unit_states(
    index: _Index, groups: list[list[torch.Tensor]], state: dict[int, Any]
) -> tuple[list[dict[int, dict[str, Any]]], list[tuple[str, ...]]]:
    """Per unit: info index -> this rank's optimizer state of that parameter;
    and, in this rank's optimizer order, the FQNs of each parameter with state
    (torch's ``_OptimStateKey``: all of a flat parameter's FQNs together).

    A flat parameter's state (use_orig_params=False) is listed under every
    info index; tensors keep their flat-shard shape.
    """
    per_unit: list[dict[int, dict[str, Any]]] = [{} for _ in index.units]
    order: list[tuple[str, ...]] = []
    pid = 0
    for params in groups:
        for p in params:
            u, k, fqns = index.where.get(id(p), (-1, -1, []))
            st = state.get(pid)
            pid += 1
            if st and fqns and tuple(fqns) not in order:
                order.append(tuple(fqns))
            if u < 0 or not st:
                continue
            ks = range(len(index.units[u].handle.infos)) if k < 0 else [k]
            for kk in ks:
                per_unit[u][kk] = st
    return per_unit, order


def _describe(h: FlatParamHandle, k: int, flat: bool, st: dict[str, Any]) -> dict[str, Any]:
    """What a rank tells the others about one parameter's state."""
    out: dict[str, Any] = {}
    piece = None if flat else _piece(h, k)
    want = h.shard_numel if flat else (piece[1] - piece[0] if piece else -1)
    for name, v in st.items():
        if piece is None and not flat and isinstance(v, torch.Tensor) and v.dim() > 0 \
                and v.numel() == 0:
            # No element of the parameter on this rank, yet state for its empty
            # view (an optimizer stepped with zero gradients everywhere, as DCP's
            # state_dict helpers do to create state): nothing to contribute.
            continue
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == want:
            out[name] = ("shard", v.dtype)
        elif isinstance(v, torch.Tensor):
            out[name] = ("value", v.detach().cpu().clone())
        else:
            out[name] = ("value", copy.deepcopy(v))
    return out


def _gather_optim(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: dict[str, Any] | None,
    *,
    full: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    use_dtensor: bool,
    group: Any = None,
) -> dict[str, Any]:
    index = _index(model)
    groups = _optim_params(optim)
    osd = osd if osd is not None else optim.state_dict()
    local_state, unmapped, pid_of_key = _by_param_id(
        model, groups, osd.get("state", {}), osd.get("param_groups", [])
    )
    if not index.units:
        raise ValueError(f"{type(model).__name__} has no FSDP unit with parameters")
    for unit in index.units if not full else []:
        two_d.check_sharded_supported(unit.state, unit.handle.unit_fqn)
    root = index.units[0].state
    SD.check_same_call(root.process_group, root.rank, "optim_state_dict")
    per_unit, order = _local_unit_states(index, groups, local_state)
    flat_unit = [not u.handle.use_orig_params for u in index.units]
    mine = [
        {k: _describe(u.handle, k, flat_unit[i], st) for k, st in per_unit[i].items()}
        for i, u in enumerate(index.units)
    ]
    everyone = _all_gather_objects((mine, order), root)
    orders = [o for _, o in everyone]
    everyone = [m for m, _ in everyone]
    if flat_unit[0]:
        # As torch without use_orig_params: rank 0's optimizer decides which
        # parameters have state and in which order ("state" comes out in that
        # one order on every rank); every rank must hold those states.
        _check_rank0_states_everywhere(orders, root.rank)

    keep = not (rank0_only and dist.get_rank(_rank0_group(root, group)) != 0)
    values: dict[str, dict[str, Any]] = {}  # fqn -> state name -> value
    for i, unit in enumerate(index.units):
        h = unit.handle
        merged: dict[int, dict[str, Any]] = {}
        for rank_desc in everyone:
            for k, names in rank_desc[i].items():
                for name, d in names.items():
                    merged.setdefault(k, {}).setdefault(name, d)
        layout = CH.chunk_layout(unit.state, use_dtensor) if not full else None
        shard_names = sorted({n for st in merged.values() for n, d in st.items() if d[0] == "shard"})
        for name in shard_names:
            holders = [k for k, st in merged.items() if st.get(name, ("",))[0] == "shard"]
            dtype = merged[holders[0]][name][1]
            if not full and h.uses_sharded_strategy and not two_d.is_two_d(unit.state):
                # SHARDED: move only the pieces of this rank's chunks (no all-gather)
                shard = _flat_state_shard(h, per_unit[i], name, dtype, flat_unit[i])
                chunks = _sharded_io.chunks_from_shard(h, shard, holders)
                del shard
                for k in holders:
                    values.setdefault(unit.fqns[k], {})[name] = CH.wrap_chunk(
                        chunks[k], h.infos[k].shape, dtype, layout, offload_to_cpu  # type: ignore[arg-type]
                    )
                continue
            flat_full = _gather_flat_state(h, per_unit[i], name, dtype, flat_unit[i])
            for k in holders:
                info = h.infos[k]
                t = flat_full[info.offset : info.offset + info.numel].view(info.shape)
                if not keep:
                    continue
                if full:
                    value = t.to("cpu", copy=True) if offload_to_cpu else t.clone()
                    value = two_d.full_value(value, info.spec)
                elif two_d.is_two_d(unit.state):  # (torch's 2-D values, a collective)
                    value = two_d.to_sharded(t, info.spec, unit.state, offload_to_cpu)
                else:
                    value = CH.chunk_tensor(t, layout, offload_to_cpu)  # type: ignore[arg-type]
                values.setdefault(unit.fqns[k], {})[name] = value
        for k, st in merged.items():
            for name, d in st.items():
                if d[0] == "value" and keep:
                    v = d[1]
                    if isinstance(v, torch.Tensor) and not offload_to_cpu:
                        v = v.to(h.device)
                    values.setdefault(unit.fqns[k], {})[name] = v
    if not keep:
        return {}
    out = _assemble(index, groups, osd, local_state, values, offload_to_cpu, pid_of_key)
    if flat_unit[0]:
        out["state"] = {
            fqn: out["state"][fqn] for key in orders[0] for fqn in key if fqn in out["state"]
        }
    for key, value in unmapped.items():
        warnings.warn(
            f"[rank {global_rank()}] optimizer state entry {key!r} belongs to no parameter of the "
            "optimizer; copied to the optimizer state dict as it is (a user-defined state, "
            "as torch's FSDP does). If it is a parameter's state, pass the optimizer that "
            "holds that parameter.",
            stacklevel=3,
        )
        out["state"][key] = value
    return out


def _check_rank0_states_everywhere(orders: list[list[tuple[str, ...]]], rank: int) -> None:
    """Every rank holds optimizer state for each parameter that rank 0 does (flat
    parameters, as torch requires); every rank sees the same gathered lists, so
    every rank raises the same error."""
    missing = {
        r: [list(key) for key in orders[0] if key not in theirs]
        for r, theirs in enumerate(orders)
    }
    lines = [f"rank {r} has none for {keys}" for r, keys in missing.items() if keys]
    if lines:
        raise RuntimeError(
            "FSDP currently requires each rank to have at least the optimizer "
            "states needed by rank 0's optimizer but some ranks are missing some of those "
            f"states [rank {rank}]: {'; '.join(lines)}. Give every rank's optimizer the same parameters and "
            "let each get a gradient before the first step (a parameter never stepped has no "
            "state), or wrap with use_orig_params=True, where the states are merged across "
            "ranks."
        )


def _all_gather_objects(obj: Any, root: UnitState) -> list[Any]:
    out: list[Any] = [None] * root.world_size
    dist.all_gather_object(out, obj, group=root.process_group)
    return out


def _gather_flat_state(
    h: FlatParamHandle, states: dict[int, dict[str, Any]], name: str, dtype: torch.dtype,
    flat: bool,
) -> torch.Tensor:
    """The unsharded flat tensor of state ``name`` for handle ``h`` (one all-gather)."""
    shard = _flat_state_shard(h, states, name, dtype, flat)
    if not h.uses_sharded_strategy:
        return shard
    out = torch.empty(h.padded_numel, dtype=dtype, device=h.device)
    _collectives.all_gather_into(out, shard, h.process_group)
    return out


def _flat_state_shard(
    h: FlatParamHandle, states: dict[int, dict[str, Any]], name: str, dtype: torch.dtype,
    flat: bool,
) -> torch.Tensor:
    """This rank's state ``name`` laid out like the flat parameter's (padded) shard."""
    shard = torch.zeros(h.shard_numel, dtype=dtype, device=h.device)
    if flat:
        st = states.get(0)
        if st is not None and name in st:
            shard.copy_(st[name].detach().reshape(-1))
    else:
        for k, st in states.items():
            sl = h.param_shard_slice(k) if h.uses_sharded_strategy else (
                h.infos[k].offset, h.infos[k].offset + h.infos[k].numel
            )
            if sl is not None and name in st:
                shard[sl[0] : sl[1]].copy_(st[name].detach().reshape(-1))
    return shard


def _assemble(
    index: _Index,
    groups: list[list[torch.Tensor]],
    osd: dict[str, Any],
    local_state: dict[int, Any],
    values: dict[str, dict[str, Any]],
    offload_to_cpu: bool,
    pid_of_key: dict[Any, int],
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    flat_params = [p for params in groups for p in params]
    param_groups = []
    pid = 0
    orig_params = bool(index.units) and index.units[0].handle.use_orig_params
    for gi, params in enumerate(groups):
        names: list[str] = []
        for p in params:
            u, _, fqns = index.where.get(id(p), (-1, -1, []))
            if not fqns:
                fqns = index.fqns_of(p)
            names.extend(fqns)
            if u < 0 and pid in local_state:  # not managed by FSDP: as it is
                state[fqns[0]] = {
                    n: (v.detach().to("cpu", copy=True) if offload_to_cpu else v.detach().clone())
                    if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                    for n, v in local_state[pid].items()
                }
            for fqn in fqns:
                if fqn in values:
                    state[fqn] = _ordered_entries(values[fqn], orig_params)
            pid += 1
        if "param_groups" in osd:
            # As torch: the saved group with its "params" (ids, or a
            # NamedOptimizer's names, in its order) replaced by clean FQNs.
            saved = osd["param_groups"][gi]
            listed = saved.get("params", [])
            if all(x in pid_of_key for x in listed) and len(listed) == len(params):
                names = [f for x in listed for f in index.fqns_of(flat_params[pid_of_key[x]])]
            group = {k: names if k == "params" else copy.deepcopy(v) for k, v in saved.items()}
            group.setdefault("params", names)
            param_groups.append(group)
    if orig_params:
        state = _torch_orig_params_order(index, state)
    if "param_groups" not in osd:  # as torch: a state dict without groups stays so
        return {"state": state}
    return {"state": state, "param_groups": param_groups}


def _torch_orig_params_order(index: _Index, state: dict[str, Any]) -> dict[str, Any]:
    """torch's order with use_orig_params (it walks the FQNs sorted): parameters
    outside FSDP first, then each unit's parameters together, units in the order
    of their first FQN, each sorted by FQN."""
    unit_of = {fqn: u for u, _, fqns in index.where.values() for fqn in fqns}
    first: dict[int, int] = {}
    for i, fqn in enumerate(sorted(state)):
        first.setdefault(unit_of.get(fqn, -1), i)

    def rank(fqn: str) -> tuple[bool, int, str]:
        u = unit_of.get(fqn, -1)
        return u >= 0, first[u], fqn

    return {fqn: state[fqn] for fqn in sorted(state, key=rank)}


def _ordered_entries(entries: dict[str, Any], orig_params: bool) -> dict[str, Any]:
    """One parameter's states in torch's order.

    Flat parameters: sorted by name.  use_orig_params: non-tensor values and
    0-dim tensors first (as found), then the sharded states sorted by name.
    """
    if not orig_params:
        return dict(sorted(entries.items()))

    def rank(item: tuple[str, Any]) -> int:
        v = item[1]
        if CH.is_chunked(v) or (isinstance(v, torch.Tensor) and v.dim() > 0):
            return 2
        return 1 if isinstance(v, torch.Tensor) else 0

    items = list(entries.items())
    scalars = [it for it in items if rank(it) < 2]
    scalars.sort(key=rank)
    return dict(scalars + sorted((it for it in items if rank(it) == 2), key=lambda it: it[0]))


# ------------------------------------------------------------ public API


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: Any = None,
) -> dict[str, Any]:
    sd_type, cfg = _settings(model)
    full = sd_type is StateDictType.FULL_STATE_DICT
    units = [m for m in units_under(model) if m._handles]
    return _gather_optim(
        model,
        optim,
        optim_state_dict,
        full=full,
        rank0_only=full and bool(getattr(cfg, "rank0_only", False)),
        offload_to_cpu=cfg.offload_to_cpu,
        use_dtensor=bool(getattr(cfg, "_use_dtensor", False))
        or any(m.settings.device_mesh is not None for m in units),
        group=group,
    )


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: Any = None,
) -> dict[str, Any]:
    sd_type, cfg = _settings(model)
    check: str | None = "optim_state_dict_to_load"
    if sd_type is StateDictType.FULL_STATE_DICT:
        if isinstance(cfg, FullOptimStateDictConfig) and cfg.rank0_only:
            optim_state_dict = _broadcast_osd(optim_state_dict, model, group)
        check = None  # full values on every rank: no collective
    groups = _optim_params(optim)
    result = _flatten_optim(model, groups, optim_state_dict, collective_check=check)
    if is_named_optimizer:
        result = _keyed_by_model_names(model, groups, result)
    if load_directly:
        optim.load_state_dict(result)
    return result


def _keyed_by_model_names(
    model: nn.Module, groups: list[list[torch.Tensor]], osd: dict[str, Any]
) -> dict[str, Any]:
    """An id-keyed state dict re-keyed for a ``NamedOptimizer``: each parameter
    by its name in ``model.named_parameters()`` (the first, for a shared one;
    a flat parameter by its own), as torch's ``is_named_optimizer=True`` gives."""
    name_of: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), name)
    flat = [p for params in groups for p in params]
    missing = [i for i, p in enumerate(flat) if id(p) not in name_of]
    if missing:
        raise ValueError(
            "optim_state_dict_to_load(is_named_optimizer=True) needs every optimizer parameter "
            f"to be a parameter of the model [rank {global_rank()}]: parameter ids {missing} of "
            "the optimizer are not in model.named_parameters(); pass the model the "
            "NamedOptimizer was built from"
        )
    key = [name_of[id(p)] for p in flat]
    out: dict[str, Any] = {"state": {key[i]: v for i, v in osd["state"].items()}}
    if "param_groups" in osd:
        out["param_groups"] = [
            {**g, "params": sorted(key[i] for i in g["params"])} for g in osd["param_groups"]
        ]
    return out


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Any = None,
    rank0_only: bool = True,
    group: Any = None,
) -> dict[str, Any]:
    return _gather_optim(
        model, optim, None, full=True, rank0_only=rank0_only, offload_to_cpu=True,
        use_dtensor=False, group=group,
    )


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
) -> dict[str, Any]:
    return _gather_optim(
        model, optim, None, full=False, rank0_only=False, offload_to_cpu=True, use_dtensor=False
    )


def _groups_from(model: nn.Module, optim_input: Any, optim: torch.optim.Optimizer | None) -> list[list[torch.Tensor]]:
    if optim is not None:
        return _optim_params(optim)
    if optim_input is None:
        return [list(model.parameters())]
    items = list(optim_input)
    if items and isinstance(items[0], dict):
        return [list(g["params"]) for g in items]
    return [items]


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    groups = _groups_from(model, optim_input, optim)
    return _flatten_optim(model, groups, full_optim_state_dict, collective_check=None)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any = None,
) -> dict[str, Any]:
    osd = _broadcast_osd(full_optim_state_dict, model, group)
    return shard_full_optim_state_dict(osd, model, optim_input, optim)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    return _flatten_optim(
        model, _optim_params(optim), sharded_optim_state_dict,
        collective_check="optim_state_dict_to_load",
    )


def _param_names(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    """Each parameter's clean FQN (the first, for shared ones), for plain and FSDP models.

    Parameter ids and names map one to one only without flat parameters of
    several originals: those raise (torch's FSDP1 raises here too).
    """
    if units_under(model):
        where = _index(model).where  # also lists the parameters outside FSDP
    else:
        where = {id(p): (-1, -1, [clean_fqn(n)]) for n, p in model.named_parameters()}
    names = []
    for p in params:
        _, k, fqns = where[id(p)]
        if k < 0 and len(fqns) > 1:
            raise RuntimeError(
                f"rank {global_rank()}: rekey_optim_state_dict "
                f"maps each optimizer parameter id to one name, but the optimizer steps a flat "
                f"parameter holding {len(fqns)} original parameters ({', '.join(fqns[:3])}"
                f"{', ...' if len(fqns) > 3 else ''}). Wrap with use_orig_params=True so the "
                "optimizer steps the original parameters, or keep the state dict keyed by name "
                "(OptimStateKeyType.PARAM_NAME)."
            )
        names.append(fqns[0])
    return names


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: Any,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    key_type = getattr(optim_state_key_type, "name", None)
    if key_type not in ("PARAM_NAME", "PARAM_ID"):
        raise AssertionError(
            "Expected optim_state_key_type to be PARAM_NAME or PARAM_ID, got "
            f"{optim_state_key_type} [rank {global_rank()}]; pass OptimStateKeyType.PARAM_NAME or "
            "OptimStateKeyType.PARAM_ID"
        )
    osd = optim_state_dict
    keys = list(osd["state"])
    names = [type(k) is str for k in keys]
    ids = [type(k) is int for k in keys]
    if (any(names) and not all(names)) or (any(ids) and not all(ids)):
        raise ValueError(
            f"Invalid parameter keys: {osd['state'].keys()} [rank {global_rank()}]; an optimizer "
            "state dict is keyed either all by parameter id (int) or all by name (str): "
            "rekey the parts separately or drop the foreign entries"
        )
    if (key_type == "PARAM_NAME" and all(names)) or (key_type == "PARAM_ID" and all(ids)):
        return osd
    params = [p for g in _groups_from(model, optim_input, optim) for p in g]
    id_to_name = _param_names(model, params)
    new: dict[str, Any] = {"param_groups": copy.deepcopy(osd["param_groups"])}
    if key_type == "PARAM_NAME":
        new["state"] = {id_to_name[k]: v for k, v in osd["state"].items()}
        for g in new["param_groups"]:
            g["params"] = sorted(id_to_name[k] for k in g["params"])
    else:
        name_to_id = {n: i for i, n in enumerate(id_to_name)}
        new["state"] = {name_to_id[k]: v for k, v in osd["state"].items()}
        for g in new["param_groups"]:
            g["params"] = sorted(name_to_id[k] for k in g["params"])
    return new
