"""FSDP2's explicit controls, on a unit's state.

The façade's methods of the same names
(:mod:`fsdp_wrap.fully_sharded_data_parallel.explicit_methods`) call these;
the hooks (:mod:`fsdp_wrap.runtime.hooks`) read what they set on each unit
(:class:`~fsdp_wrap.runtime.explicit.controls.ExplicitControls`).  Names,
signatures and meanings are FSDP2's
(``torch/distributed/fsdp/_fully_shard/_fully_shard.py``, ``FSDPModule``);
what each means in FSDP1's schedule, and where it differs from FSDP2, is in
:doc:`/options` ("FSDP2's explicit controls").

Misuse is refused before any collective: a module that is not an FSDP unit
(``ValueError``, torch's sentence), a unit of another model, a prefetch list
that leads back to the unit (a cycle), a setting changed during forward or
backward, ``reshard()`` of a unit whose forward or backward is running.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.runtime.tree as tree
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.explicit.controls import controls_of, tree_of, unit_name
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import TrainingState, UnitState, expect_state, state_of

__all__ = ["UnshardHandle", "register_fsdp_forward_method", "reshard", "set_gradient_divide_factor",
           "set_post_optim_event", "set_prefetch", "set_reshard_after_forward",
           "set_unshard_in_backward", "unshard"]


class UnshardHandle:
    """What ``unit.unshard(async_op=True)`` returns (FSDP2's ``UnshardHandle``).

    :meth:`wait` waits for the all-gathers and registers the unsharded
    parameters on the module; without it, the unit's next pre-forward waits.
    """

    def __init__(self, unit: UnitState | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        """Wait for the unit's all-gathers; its original parameters are then
        views of the unsharded data (idempotent: a second call does nothing)."""
        unit, self._unit = self._unit, None
        if unit is None:
            return
        for h in unit._handles:
            if h.is_unsharded:
                continue  # (its pre-forward waited already)
            h.finish_unshard(full_precision=h.computes_in_full_precision)
            h.use_unsharded_views(track_graph=True)


# ------------------------------------------------------------ prefetching


def set_prefetch(me: UnitState, modules: Sequence[nn.Module], kind: str) -> None:
    """``set_modules_to_{kind}_prefetch`` (``kind``: "forward" or "backward")."""
    what = f"set_modules_to_{kind}_prefetch"
    _check_between_iterations(me, what)
    units = _check_units(me, modules, what)
    controls = controls_of(me)
    before = getattr(controls, f"{kind}_prefetch")
    setattr(controls, f"{kind}_prefetch", units)
    cycle = _cycle_through(me, kind)
    if cycle:
        setattr(controls, f"{kind}_prefetch", before)
        path = " -> ".join(f"'{unit_name(u)}'" for u in cycle)
        raise ValueError(
            f"[rank {global_rank()}] {what} on unit '{unit_name(me)}' would make a cycle "
            f"of {kind} prefetches: {path}. A unit prefetches units whose {kind} comes "
            "after its own; list those only")


# ------------------------------------------------------ unshard / reshard


def unshard(me: UnitState, async_op: bool) -> UnshardHandle | None:
    """FSDP2's ``unshard`` (the façade's method says what it does)."""
    expect_state(me, (TrainingState.IDLE, TrainingState.FORWARD_BACKWARD), action="unshard()",
                 fix="call it outside summon_full_params")
    if me._is_root is None:
        tree.lazy_init(tree_of(me))  # (from its root: a unit alone would make itself one)
    for h in me._handles:
        h.start_unshard(full_precision=h.computes_in_full_precision,
                        async_op=True if async_op else None)
    handle = UnshardHandle(me)
    if async_op:
        return handle
    handle.wait()
    return None


def reshard(me: UnitState) -> None:
    """FSDP2's ``reshard``: not during the unit's forward or backward."""
    expect_state(me, TrainingState.IDLE, action="reshard()",
                 fix="call it before the unit's forward or after its backward")
    for h in me._handles:
        h.reshard(free=True)


# --------------------------------------------------------- the schedule


def set_reshard_after_forward(me: UnitState, value: bool, recurse: bool) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"reshard_after_forward should be a bool, got {type(value)} "
                         f"[rank {global_rank()}]")
    _check_between_iterations(me, "set_reshard_after_forward")
    for st in _units(me, recurse):
        controls_of(st).reshard_after_forward = value


def set_unshard_in_backward(me: UnitState, value: bool) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"unshard_in_backward should be a bool, got {type(value)} "
                         f"[rank {global_rank()}]")
    _check_between_iterations(me, "set_unshard_in_backward")
    controls_of(me).unshard_in_backward = value


def set_post_optim_event(me: UnitState, event: Any) -> None:
    if not callable(getattr(event, "wait", None)):
        raise TypeError(
            f"set_post_optim_event expects a torch.Event recorded after the optimizer step "
            f"but got {type(event).__name__} [rank {global_rank()}]")
    controls_of(me._root).post_optim_event = event


def set_gradient_divide_factor(me: UnitState, factor: float) -> None:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
            math.isfinite(factor) and factor > 0):
        raise ValueError(
            f"[rank {global_rank()}] set_gradient_divide_factor on unit '{unit_name(me)}' "
            f"expects a positive finite number but got {factor!r}")
    if me._comm_hook is not None:
        raise ValueError(
            f"[rank {global_rank()}] set_gradient_divide_factor on unit '{unit_name(me)}': "
            "a communication hook is registered and divides the gradients itself; "
            "divide in the hook instead")
    _check_between_iterations(me, "set_gradient_divide_factor")
    controls_of(me).gradient_divide_factor = float(factor)
    for h in me._handles:
        h.set_gradient_divide(C.divide_factors(factor))  # type: ignore[arg-type]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like ``forward`` (FSDP2's
    ``register_fsdp_forward_method``): the unit's parameters are gathered
    before the method and resharded after it as its strategy says, the
    inputs cast as ``mixed_precision`` says.  For methods such as
    ``generate`` that run outside ``forward`` and read the unit's own
    parameters.  A module that is not an FSDP unit is left alone (so one
    script serves with and without FSDP)."""
    state = state_of(module)
    if state is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(
            f"{type(module)} does not have a method {method_name} [rank {global_rank()}]: "
            f"the FSDP unit '{unit_name(state)}' and the module it wraps have no attribute "
            f"{method_name!r}; give the name of a method of the wrapped module")
    method = getattr(module, method_name)
    run = getattr(module, "_forward_with")  # noqa: B009  (the façade's, not nn.Module's)

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        return run(method, args, kwargs)

    object.__setattr__(module, method_name, as_forward)


# ------------------------------------------------------------------ checks


def _units(state: UnitState, recurse: bool) -> list[UnitState]:
    if not recurse:
        return [state]
    found = (state_of(m) for m in state.module.modules())
    return [st for st in found if st is not None]


def _check_between_iterations(state: UnitState, what: str) -> None:
    """``ValueError`` while a unit of ``state``'s tree is in forward or backward."""
    for st in _units(state._root, True):
        if st.training_state is TrainingState.FORWARD_BACKWARD:
            raise ValueError(
                f"[rank {global_rank()}] {what}() was called on unit '{unit_name(state)}' "
                f"during forward/backward (unit '{unit_name(st)}' is running); call it "
                "between iterations, before the forward it is for")
    if state._is_root is not None and not state._root._grad_buckets.idle:
        state._root._grad_buckets.finish()  # (reductions issued under the old settings)


def _check_units(me: UnitState, modules: Sequence[nn.Module], what: str) -> list[UnitState]:
    """The units of ``modules``, or ``ValueError`` (torch's sentence for a
    module that is not one) before anything is set."""
    if isinstance(modules, nn.Module) or not isinstance(modules, Sequence):
        raise ValueError(
            f"[rank {global_rank()}] {what} on unit '{unit_name(me)}' expects a list of FSDP "
            f"units but got {type(modules).__name__}; pass [unit, ...]")
    units: list[UnitState] = []
    for m in modules:
        unit = state_of(m)
        if unit is None:
            raise ValueError(
                f"Expects FSDPModule but got {type(m)}: {_module_name(me, m)} "
                f"[rank {global_rank()}] {what} on unit '{unit_name(me)}' expects FSDP units "
                "(FullyShardedDataParallel instances); pass the unit that wraps this module "
                "(e.g. model.layers[3] after auto-wrapping), or wrap it")
        if tree_of(unit) is not tree_of(me):
            raise ValueError(
                f"[rank {global_rank()}] {what} on unit '{unit_name(me)}' got unit "
                f"'{unit_name(unit)}' of another model (another root); list units of the "
                "same model")
        units.append(unit)
    return units


def _module_name(me: UnitState, module: object) -> str:
    """Where ``module`` sits under ``me``'s root (for messages), else its class."""
    for name, m in tree_of(me).module.named_modules():
        if m is module:
            return f"'{clean_fqn(name)}'"
    return type(module).__name__


def _cycle_through(me: UnitState, kind: str) -> list[UnitState]:
    """A path of ``kind`` prefetch lists from ``me`` back to ``me`` ([] if none)."""
    path: list[UnitState] = [me]
    seen: set[int] = set()

    def walk(unit: UnitState) -> bool:
        controls = unit._explicit
        for nxt in getattr(controls, f"{kind}_prefetch") if controls is not None else []:
            if nxt is me:
                path.append(me)
                return True
            if id(nxt) in seen:
                continue
            seen.add(id(nxt))
            path.append(nxt)
            if walk(nxt):
                return True
            path.pop()
        return False

    return path if walk(me) else []
