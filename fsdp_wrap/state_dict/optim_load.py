"""Optimizer state dicts, loading: FQN-keyed full or chunked state -> this
rank's id-keyed flat-shard state for its optimizer (the inverse of saving in
``_optim_state_dict``)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.state_dict.chunks as CH
import fsdp_wrap.state_dict.model as SD
import fsdp_wrap.state_dict.sharded_io as _sharded_io
import fsdp_wrap.state_dict.two_d as two_d
from fsdp_wrap.state_dict.optim_index import _Index, _index, _piece, _rank0_group, _Unit

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle


def _check_loadable(
    index: _Index, groups: list[list[torch.Tensor]], osd: dict[str, Any], rank: int
) -> None:
    """Every mismatch between ``osd`` and the model/optimizer in ONE error (no collective)."""
    problems: list[str] = []
    if not isinstance(osd, dict) or "state" not in osd:
        # torch needs "state" only: without "param_groups" the result has none either
        raise ValueError(
            "`optim_state_dict` must have the keys \"state\" to be a valid optimizer state "
            f"dict [rank {rank}], but got "
            f"{'keys ' + str(list(osd)) if isinstance(osd, dict) else type(osd).__name__}; pass "
            "the dict FSDP.optim_state_dict() returned (or torch.load gave back)"
        )
    shape_of: dict[str, torch.Size] = {}
    for unit in index.units:
        for fqn, info in zip(unit.fqns, unit.handle.infos):
            shape_of[fqn] = info.spec.shape if info.spec is not None else info.shape
    known = {f for _, _, fqns in index.where.values() for f in fqns}
    bad_keys = [k for k in osd["state"] if k not in known]
    if bad_keys:
        problems.append(f"unexpected key(s) {bad_keys}")
    for fqn, st in osd["state"].items():
        want = shape_of.get(fqn) if isinstance(fqn, str) else None
        if want is None:
            continue
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and torch.Size(v.size()) != want:
                problems.append(
                    f"'{fqn}' state '{name}' has shape {tuple(v.size())}, the parameter "
                    f"{tuple(want)} (Tensor optimizer state does not have same shape as its "
                    "parameter)"
                )
    problems[:0] = _flat_unit_problems(index, osd["state"])  # torch's sentences first
    if "param_groups" not in osd:
        pass
    elif len(osd["param_groups"]) != len(groups):
        problems.append(
            f"{len(osd['param_groups'])} param group(s) in the state dict, "
            f"{len(groups)} in the optimizer"
        )
    else:
        for gi, (saved, params) in enumerate(zip(osd["param_groups"], groups)):
            names = {f for p in params for f in index.fqns_of(p)}
            # Parameters outside FSDP the state dict does not list (managed by
            # another parallelism, model-parallel style) are left alone, as torch.
            outside = {f for p in params if index.where[id(p)][0] < 0 for f in index.fqns_of(p)}
            listed = set(saved.get("params", []))
            extra, missed = listed - names, names - listed - outside
            if all(isinstance(x, str) for x in listed) and (extra or missed):
                problems.append(
                    f"param group {gi} lists {sorted(extra)} not in the "
                    f"optimizer's group and misses {sorted(missed)}"
                )
    if problems:
        raise ValueError(
            "; ".join(problems)
            + f" [rank {rank}: the optimizer state dict does not match the model and optimizer]"
        )


def _flat_unit_problems(index: _Index, state_in: dict[Any, Any]) -> list[str]:
    """What keeps each flat parameter's (use_orig_params=False) originals from
    sharing one optimizer state: torch's checks, with torch's phrases, and the fix."""
    fix = (
        "; these parameters share one flat parameter (use_orig_params=False), so their "
        "states must agree (the same state names, one value per scalar state, one dtype "
        "per tensor state): save them so, or wrap with use_orig_params=True, which keeps "
        "each parameter's own state"
    )
    problems: list[str] = []
    for unit in index.units:
        if unit.handle.use_orig_params:
            continue
        states = [state_in.get(f) for f in unit.fqns]
        present = [st for st in states if st]
        if not present:
            continue
        if any(set(st) != set(present[0]) for st in present):
            problems.append(
                "Differing optimizer state names for the unflattened parameters: "
                f"{ {f: sorted(st) for f, st in zip(unit.fqns, states) if st} }{fix}"
            )
            continue
        for name in sorted(present[0]):
            values = [st.get(name) if st else None for st in states]
            given = [v for v in values if v is not None]
            if not given:
                continue
            pos = [isinstance(v, torch.Tensor) and v.dim() > 0 for v in given]
            zero = [isinstance(v, torch.Tensor) and v.dim() == 0 for v in given]
            kinds = {torch.Tensor if isinstance(v, torch.Tensor) else type(v) for v in given}
            if len(kinds) != 1 or not (all(pos) or all(zero) or not any(pos + zero)):
                problems.append(
                    f"Differing optimizer state types for state {name}, values "
                    f"{[type(v).__name__ for v in values]}, and unflattened parameter names "
                    f"{unit.fqns}{fix}"
                )
            elif all(pos):
                dtypes = {v.dtype for v in given}
                if len(dtypes) != 1:
                    problems.append(
                        "All unflattened parameters comprising a single flat parameter must "
                        "have positive-dimension tensor state with the same dtype but got "
                        f"dtypes {sorted(map(str, dtypes))} for state {name} and unflattened "
                        f"parameter names {unit.fqns}{fix}"
                    )
            else:
                scalars = {v.item() if isinstance(v, torch.Tensor) else v for v in given}
                dtypes = {v.dtype if isinstance(v, torch.Tensor) else type(v) for v in given}
                if len(given) != len(values) or len(scalars) != 1 or len(dtypes) != 1:
                    got = {
                        f: None if v is None else v.item() if isinstance(v, torch.Tensor) else v
                        for f, v in zip(unit.fqns, values)
                    }
                    problems.append(
                        "All unflattened parameters comprising a single flat parameter must "
                        f"have scalar state with the same value and dtype but got {got} "
                        f"(dtypes {sorted(map(str, dtypes))}) for state {name}{fix}"
                    )
    return problems


def _flatten_optim(
    model: nn.Module,
    groups: list[list[torch.Tensor]],
    osd: dict[str, Any],
    *,
    collective_check: str | None,
) -> dict[str, Any]:
    """Full or chunked FQN-keyed state -> this rank's id-keyed state for ``groups``."""
    index = _index(model)
    root = index.units[0].state
    _check_loadable(index, groups, osd, root.rank)
    if collective_check is not None:
        SD.check_same_call(root.process_group, root.rank, collective_check)
    state_in: dict[str, dict[str, Any]] = osd["state"]
    if any(two_d.applies(x.state) for x in index.units):
        # 2-D: values as gathered local tensors (a copy of the dicts: the caller's stay)
        state_in = {k: dict(v) if isinstance(v, dict) else v for k, v in state_in.items()}
        for x in index.units:
            if two_d.applies(x.state):
                two_d.localize_state(x.handle, x.fqns, state_in, x.state)
    pid_of: dict[int, int] = {}
    for params in groups:
        for p in params:
            pid_of.setdefault(id(p), len(pid_of))
    out: dict[int, dict[str, Any]] = {}
    for unit in index.units:
        h = unit.handle
        shards = _chunked_states_to_shards(unit, state_in)
        full = _unit_full_states(unit, state_in, skip=set(shards))
        if not h.use_orig_params:
            pid = pid_of.get(id(h.flat_param))
            if pid is not None and any(f in state_in for f in unit.fqns):
                flat_st = {**_flat_shard_state(h, unit, full), **shards}
                out[pid] = {n: flat_st[n] for n in sorted(flat_st)}
            continue
        for k, (fqn, info) in enumerate(zip(unit.fqns, h.infos)):
            pid = pid_of.get(id(info.param))
            piece = _piece(h, k)
            if pid is None or fqn not in state_in or piece is None:
                continue
            st: dict[str, Any] = {}
            for name in state_in[fqn]:
                if name in shards:
                    sl = h.param_shard_slice(k)
                    st[name] = shards[name][sl[0] : sl[1]].clone() if sl else shards[name][:0].clone()
                    continue
                v = full[k][name]
                if isinstance(v, torch.Tensor):
                    if v.dim() > 0 and h.uses_sharded_strategy:
                        v = v.reshape(-1)[piece[0] : piece[1]]
                    # Copies, 0-dim ``step`` included: a checkpoint may share one
                    # tensor between parameters (torch saves one ``step`` object per
                    # flat parameter), and the optimizer increments it in place.
                    v = v.clone()
                st[name] = v
            out[pid] = st
    outside = _outside_states(index, state_in)
    for params in groups:  # parameters FSDP does not manage: as they are
        for p in params:
            u, _, fqns = index.where[id(p)]
            if u < 0 and fqns[0] in outside:
                out[pid_of[id(p)]] = outside[fqns[0]]
    if "param_groups" not in osd:  # as torch: none given, none returned
        return {"state": out}
    return {"state": out, "param_groups": _param_groups_to_load(index, groups, osd, pid_of)}


def _param_groups_to_load(
    index: _Index, groups: list[list[torch.Tensor]], osd: dict[str, Any], pid_of: dict[int, int]
) -> list[dict[str, Any]]:
    """The saved groups with "params" as this optimizer's ids.

    As torch: a group listing names gets the sorted ids of the parameters it
    names, so a parameter the checkpoint does not know (one outside FSDP
    managed elsewhere) is left out for the caller to add; a group listing ids
    gets all of this optimizer's group.
    """
    pid_of_name: dict[str, int] = {}
    for params in groups:
        for p in params:
            for fqn in index.fqns_of(p):
                pid_of_name.setdefault(fqn, pid_of[id(p)])
    param_groups = []
    pid = 0
    for saved, params in zip(osd["param_groups"], groups):
        group = {k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
        listed = saved.get("params", [])
        if listed and all(isinstance(x, str) and x in pid_of_name for x in listed):
            group["params"] = sorted({pid_of_name[x] for x in listed})
        else:
            group["params"] = list(range(pid, pid + len(params)))
        pid += len(params)
        param_groups.append(group)
    return param_groups


def _outside_states(index: _Index, state_in: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The saved states of parameters FSDP does not manage in this model, as
    plain tensors.  One saved while FSDP managed it is chunked: its chunks are
    gathered (every rank takes part, whatever its optimizer holds, in name
    order), so the optimizer can step it (torch would pass the chunks on)."""
    outside = {f for u, _, fqns in index.where.values() if u < 0 for f in fqns}
    out = {
        fqn: {n: v.clone() if isinstance(v, torch.Tensor) and not CH.is_chunked(v) else v
              for n, v in st.items()}
        for fqn, st in state_in.items() if fqn in outside
    }
    chunked = [(f, n) for f in sorted(out) for n in sorted(out[f]) if CH.is_chunked(out[f][n])]
    if chunked:
        layout = CH.chunk_layout(index.units[0].state, False)
        items = [(f"{f}.{n}", out[f][n]) for f, n in chunked]
        for (f, n), t in zip(chunked, CH.gather_chunks(items, layout)):
            out[f][n] = t
    return out


def _chunked_states_to_shards(unit: _Unit, state_in: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """State name -> this rank's flat shard of it, for every state whose values in this
    unit are all dim-0 chunks: the pieces are exchanged (one all-to-all per state), never
    gathered.  Every rank decides the same names from the same keys."""
    h = unit.handle
    if not h.uses_sharded_strategy:
        return {}
    per_name: dict[str, dict[int, Any]] = {}
    for k, fqn in enumerate(unit.fqns):
        for name, v in state_in.get(fqn, {}).items():
            per_name.setdefault(name, {})[k] = v
    layout = CH.chunk_layout(unit.state, False)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(per_name):
        vals = per_name[name]
        if not all(CH.is_chunked(v) for v in vals.values()):
            continue
        chunks = {
            k: CH.local_chunk(f"{unit.fqns[k]}.{name}", v, layout)[1] for k, v in vals.items()
        }
        dtype = next(iter(vals.values())).dtype
        shard = torch.zeros(h.shard_numel, dtype=dtype, device=h.device)
        _sharded_io.shard_from_chunks(h, chunks, shard)
        out[name] = shard
    return out


def _unit_full_states(
    unit: _Unit, state_in: dict[str, dict[str, Any]], skip: set[str] | frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """Per original parameter: state name -> full tensor (gathering chunked values),
    leaving out the names in ``skip``."""
    full: list[dict[str, Any]] = [
        {n: v for n, v in state_in.get(fqn, {}).items() if n not in skip} for fqn in unit.fqns
    ]
    chunked = [
        (k, name)
        for k in range(len(full))
        for name in sorted(full[k])
        if CH.is_chunked(full[k][name])
    ]
    if chunked:
        layout = CH.chunk_layout(unit.state, False)
        items = [(f"{unit.fqns[k]}.{name}", full[k][name]) for k, name in chunked]
        for (k, name), t in zip(chunked, CH.gather_chunks(items, layout)):
            full[k][name] = t
    for st in full:
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                st[name] = v.to(unit.handle.device)
    return full


def _flat_shard_state(h: FlatParamHandle, unit: _Unit, full: list[dict[str, Any]]) -> dict[str, Any]:
    """This rank's flat-shard state (padded like the flat parameter's shard)."""
    st: dict[str, Any] = {}
    names = sorted({n for f in full for n in f})
    for name in names:
        tensors = [f.get(name) for f in full]
        first = next((t for t in tensors if t is not None), None)
        if first is None:  # e.g. ``momentum_buffer: None`` for every original, as torch
            st[name] = None
            continue
        if not (isinstance(first, torch.Tensor) and first.dim() > 0):
            st[name] = first.clone() if isinstance(first, torch.Tensor) else copy.deepcopy(first)
            continue
        flat = torch.zeros(h.padded_numel, dtype=first.dtype, device=h.device)
        for info, t in zip(h.infos, tensors):
            if t is not None:
                flat[info.offset : info.offset + info.numel].copy_(t.reshape(-1))
        st[name] = flat[h.shard_offset : h.shard_offset + h.shard_numel].clone()
    return st


def _broadcast_osd(osd: dict[str, Any] | None, model: nn.Module, group: Any = None) -> dict[str, Any]:
    """Rank 0's optimizer state dict on every rank (structure, then tensor by tensor)."""
    index = _index(model)
    root = index.units[0].state
    pg = _rank0_group(root, group)
    src = dist.get_global_rank(pg, 0)
    me = dist.get_rank(pg)
    tensors: list[torch.Tensor] = []

    def strip(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return ("__fsdp_wrap_tensor__", tuple(v.shape), v.dtype)
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()}
        return v

    skeleton = [strip(osd) if me == 0 else None]
    dist.broadcast_object_list(skeleton, src=src, group=pg)
    device = SD._group_device(pg)

    def fill(v: Any) -> Any:
        if isinstance(v, tuple) and len(v) == 3 and v[0] == "__fsdp_wrap_tensor__":
            t = tensors.pop(0).to(device) if me == 0 else torch.empty(v[1], dtype=v[2], device=device)
            dist.broadcast(t, src=src, group=pg)
            return t
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        return v

    result = fill(skeleton[0])
    if not isinstance(result, dict):
        raise ValueError("rank 0 passed no optimizer state dict to broadcast")
    return result
