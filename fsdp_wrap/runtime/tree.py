"""Queries and set-up over a tree of FSDP units: which modules are units, the
root, and the lazy initialisation that links every unit to its root.

Everything here takes :class:`~fsdp_wrap.runtime.state.UnitState` objects; the
façade's ``fsdp_modules``, ``check_is_root`` and ``_lazy_init`` delegate here.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.runtime.construct as construct
import fsdp_wrap.runtime.guards as guards
import fsdp_wrap.runtime.step_trace as step_trace
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.exec_order import ForwardOrderCheck
from fsdp_wrap.runtime.explicit.controls import check_schedules, schedule_signature
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState, state_of

__all__ = ["initialised_units", "lazy_init", "units_under", "unit_signature", "unit_names"]


def units_under(module: nn.Module, root_only: bool = False) -> list[UnitState]:
    """The state of every unit in ``module``'s tree (pre-order), ``module`` included.

    ``root_only`` keeps the roots, after lazy-initialising each tree.
    """
    found = [st for st in map(state_of, module.modules()) if st is not None]
    if root_only:
        for st in found:
            lazy_init(st)
        found = [st for st in found if st._is_root]
    return found


def initialised_units(module: nn.Module) -> list[UnitState]:
    """Every unit in ``module``'s tree (pre-order), each lazily initialised.

    Unlike ``units_under(module, root_only=True)`` this keeps units whose root
    is no longer in ``module`` (a wrapper dropped, as Lightning's ``test``
    after ``fit`` does, or a unit moved under another module): they stay
    non-roots of the tree they were initialised in, as in torch's FSDP1,
    whose state-dict and optimizer-state functions need units, not a root.
    """
    found = units_under(module)
    for m in found:
        lazy_init(m)
    return found


def lazy_init(state: UnitState) -> None:
    """Make the first unit reached the root of its tree.

    Runs once per tree (at the first forward, state_dict, clip_grad_norm_,
    ...).  Postcondition: every unit knows the root, the root knows every unit
    and handle, and every rank was checked to hold the same units.
    """
    if state._is_root is not None:
        return
    states = units_under(state.module)
    fqn_of = {id(st): clean_fqn(n) for n, st in
              ((n, state_of(m)) for n, m in state.module.named_modules()) if st is not None}
    # Local checks first, so a refused tree stays uninitialised (no root set).
    _check_homogeneous(states, fqn_of)
    _check_optim_in_backward(states, fqn_of)
    state._is_root = True
    for st in states:
        if st is not state:
            st._is_root = False
            st._root = state
            st._all_fsdp_states = []
        for h in st._handles:
            h.unit_fqn = fqn_of.get(id(st), "")
    state._all_fsdp_states = states
    state._all_handles = [h for st in states for h in st._handles]
    state._state_of = {h: st for st in states for h in st._handles}
    for st in states:
        st._optims_in_backward = any(
            hasattr(p, "_in_backward_optimizers") for h in st._handles for p in h.params
        )
    guards.check_tree(state)
    if state.world_size > 1:
        # Compares the flat parameters' dtype and shape too: data replaced on
        # some ranks only is reported on every rank, before any gather.
        all_gather_unit_signatures(state)
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:
            state._exec_order.order_check = ForwardOrderCheck(
                state._all_handles, state.process_group, state.rank, state.world_size
            )
    for h in state._all_handles:
        h.adopt_flat_param_data()
    for st in states:
        st._buffer_orig_dtypes = construct.cast_buffers(st)
    step_trace.attach_if_asked(state.module)  # ($FSDP_WRAP_TRACE: fsdp-wrap trace)


def unit_signature(state: UnitState) -> tuple[Any, ...]:
    """What every rank's unit must agree on for the collectives to line up:
    shapes, dtype and strategy, not names (as torch, ranks may ignore
    different modules when what remains has the same shapes)."""
    if not state._handles:
        return (None,)
    return tuple(
        (
            tuple(tuple(i.shape) for i in h.infos),
            str(h.flat_param.dtype),
            tuple(h.flat_param.shape),
            state.settings.strategy.name,
            state.settings.use_orig_params,
            state.settings.wire.signature(),  # (quantize_collectives: coded on every rank or none)
        )
        for h in state._handles
    )


def unit_names(state: UnitState) -> tuple[str, tuple[str, ...]]:
    """The unit's and its parameters' names, for messages."""
    if not state._handles:
        return ("<no parameters>", ())
    return (state._handles[0].unit_fqn or "<root>",
            tuple(i.fqn for h in state._handles for i in h.infos))


def all_gather_unit_signatures(state: UnitState) -> None:
    """Fail fast, on every rank, if ranks built different units.

    One ``all_gather_object`` at lazy init; a mismatch would otherwise show up
    later as a hang or a silently wrong all-gather.
    """
    mine = [(unit_signature(s), unit_names(s)) for s in state._all_fsdp_states]
    # (plus whether each unit came from the meta device here: runtime.guards)
    meta = [s._built_from_meta for s in state._all_fsdp_states]
    # (and the explicit controls set so far: fsdp_wrap.runtime.explicit.controls)
    everyone = _compare_signatures(mine, meta, state.process_group, schedule_signature(state))
    check_schedules(state, [e[2] for e in everyone], state.process_group)
    for i, st in enumerate(state._all_fsdp_states):
        unit = st._handles[0].unit_fqn or "<root>" if st._handles else "<root>"
        guards.meta_mismatch(st, unit, [m[i] for _, m, _ in everyone])
    replicas = state.settings.inter_node_pg
    if replicas is not None and dist.get_world_size(replicas) > 1:
        # Hybrid strategies: the replicas' all-reduce must line up too (a node
        # launched with another $FSDP_WRAP_QUANTIZE_COLLECTIVES codes it).
        _compare_signatures(mine, meta, replicas)


def _compare_signatures(mine: list[Any], meta: list[bool],
                        group: dist.ProcessGroup, extra: Any = None) -> list[Any]:
    """``RuntimeError`` unless every rank of ``group`` has the signatures
    ``mine``; returns every rank's ``(signatures, meta, extra)``."""
    everyone: list[Any] = C.all_gather_objects((mine, meta, extra), group)
    for r, (theirs, *_) in enumerate(everyone):
        theirs_list: list[Any] = theirs
        if [sig for sig, _ in theirs_list] == [sig for sig, _ in mine]:
            continue
        for i in range(max(len(mine), len(theirs_list))):
            a = mine[i] if i < len(mine) else None
            b = theirs_list[i] if i < len(theirs_list) else None
            if a is None or b is None or a[0] != b[0]:
                me, them = global_rank(), dist.get_global_rank(group, r)
                raise RuntimeError(
                    f"[rank {me}] FSDP units differ between rank {me} and rank "
                    f"{them} at unit #{i}: rank {me} has {_describe_unit(a)}, rank {them} "
                    f"has {_describe_unit(b)}. Every rank must wrap the same model the same "
                    "way (same auto_wrap_policy, sizes, dtypes, sharding strategy and "
                    "quantize_collectives or $FSDP_WRAP_QUANTIZE_COLLECTIVES); "
                    "otherwise collectives would hang."
                )
    return everyone


def _describe_unit(entry: Any) -> str:
    """One rank's unit for the mismatch message: names with shapes, dtype, strategy."""
    if entry is None:
        return "no such unit"
    sigs, (unit, names) = entry
    if sigs[0] is None:
        return f"{unit} (no parameters)"
    shapes = [shape for sig in sigs for shape in sig[0]]
    params = ", ".join(f"{n!r} {shape}" for n, shape in zip(names, shapes))
    flats = ", ".join(f"{sig[2]} {sig[1]}" for sig in sigs)
    wire = sigs[0][5]
    coded = "" if all(w.endswith("exact") for w in wire[:3]) and not wire[3] else \
        f" quantize_collectives {' '.join(w for w in wire if w)}"
    return (
        f"unit {unit!r} [{params}] flat {flats} {sigs[0][3]} "
        f"use_orig_params={sigs[0][4]}{coded}"
    )


# Options every unit of one tree must share (torch's HOMOGENEOUS_ATTR_NAMES):
# torch's attribute name (its message names it), the settings field, the option.
_HOMOGENEOUS = (
    ("_use_orig_params", "use_orig_params", "use_orig_params"),
    ("limit_all_gathers", "limit_all_gathers", "limit_all_gathers"),
    ("_use_full_prec_in_eval", "use_full_prec_in_eval", "FSDP_USE_FULL_PREC_IN_EVAL"),
)


def _check_homogeneous(states: list[UnitState], fqn_of: dict[int, str]) -> None:
    """ValueError, at lazy init before any collective, if units disagree on an option."""
    for attr, field, option in _HOMOGENEOUS:
        values = {getattr(st.settings, field) for st in states}
        if len(values) > 1:
            per_unit = ", ".join(
                f"'{fqn_of.get(id(st), '') or '<root>'}': {getattr(st.settings, field)}"
                for st in states
            )
            raise ValueError(
                f"Expects one homogeneous value for {attr} but got {values} [rank {global_rank()}] "
                f"({option} per FSDP unit: {per_unit}); construct every nested "
                f"FullyShardedDataParallel of this root with the same {option}"
            )


def _check_optim_in_backward(states: list[UnitState], fqn_of: dict[int, str]) -> None:
    """``_apply_optimizer_in_backward`` on flat parameters is refused, as in torch."""
    flat = [
        f"'{fqn_of.get(id(st), '') or '<root>'}'"
        for st in states
        if any(hasattr(h.flat_param, "_in_backward_optimizers") for h in st._handles)
    ]
    if flat:
        raise RuntimeError(
            "FSDP optimizer in backward only supported with "
            f"use_orig_params=True! [rank {global_rank()}] _apply_optimizer_in_backward was given the flat parameters "
            f"of FSDP units {', '.join(flat)}; wrap with use_orig_params=True and pass the "
            "model's parameters, or step a regular optimizer after backward"
        )
