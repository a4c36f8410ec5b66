"""FSDP2's explicit controls as methods of every fsdp_wrap unit.

``FullyShardedDataParallel`` inherits :class:`ExplicitAPI`; the hooks
(:mod:`fsdp_wrap.runtime.hooks`) read what it sets on each unit
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
from typing import Any, cast

import torch.nn as nn

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.runtime.tree as tree
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.explicit.controls import controls_of, tree_of, unit_name
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import TrainingState, UnitState, is_unit

__all__ = ["ExplicitAPI", "UnshardHandle", "register_fsdp_forward_method"]


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


class ExplicitAPI:
    """FSDP2's ``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``,
    ``unshard``, ``reshard``, ``set_reshard_after_forward``,
    ``set_unshard_in_backward``, ``set_post_optim_event`` and
    ``set_gradient_divide_factor`` on an FSDP1 unit."""

    # ------------------------------------------------------------ prefetching

    def set_modules_to_forward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """The FSDP units whose all-gathers this unit starts in its forward,
        right after gathering its own, in this order.

        It replaces the default for this unit (``forward_prefetch``'s next
        unit, or the next batch of small units): ``[the next unit]`` gives
        ``forward_prefetch=True``'s schedule, two or more units gather that
        far ahead (more memory held, more communication behind compute).  An
        empty list restores the default.  A listed unit already gathered is
        not gathered again.  Gathers are asynchronous where the unit's are
        (accelerators, or ``limit_all_gathers=False`` on CPU).  Only in
        forwards with grad (a forward without grad frees nothing it did not
        run)."""
        self._set_prefetch(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """The FSDP units whose all-gathers this unit starts in its
        pre-backward, right after gathering its own, in this order.

        It replaces ``backward_prefetch`` for this unit: ``[the unit whose
        backward comes next]`` gives ``BACKWARD_PRE``'s schedule, two or more
        units gather that far ahead.  An empty list restores the default.  A
        listed unit whose backward already began is not gathered again (FSDP2
        would gather it anew and hold it to the end of backward)."""
        self._set_prefetch(modules, "backward")

    def _set_prefetch(self, modules: Sequence[nn.Module], kind: str) -> None:
        me = cast(UnitState, self)
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

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters (not its children's), in the
        compute dtype; FSDP2's ``unshard``.

        ``async_op=True`` starts the all-gathers and returns an
        :class:`UnshardHandle` at once (asynchronous on CPU too); its
        ``wait()`` waits and registers the unsharded parameters, or the
        unit's next pre-forward does.  ``False`` does both now and returns
        ``None``.  The parameters stay unsharded until :meth:`reshard`, or
        until the unit's forward reshards as its strategy says.  The first
        call on a model not yet run initialises it (a collective)."""
        me = cast(UnitState, self)
        if me.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise ValueError(_phase_error(me, "unshard", "inside summon_full_params"))
        _initialised(me)
        for h in me._handles:
            h.start_unshard(full_precision=h.computes_in_full_precision,
                            async_op=True if async_op else None)
        handle = UnshardHandle(me)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters (not its children's) and
        show the sharded ones; FSDP2's ``reshard``.  Between forward and
        backward the unit is gathered again for its backward."""
        me = cast(UnitState, self)
        if me.training_state is not TrainingState.IDLE:
            raise ValueError(_phase_error(me, "reshard", "during its forward or backward"
                                          if me.training_state is TrainingState.FORWARD_BACKWARD
                                          else "inside summon_full_params"))
        for h in me._handles:
            h.reshard(free=True)

    # --------------------------------------------------------- the schedule

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """Whether this unit (and, with ``recurse``, every unit under it) frees
        its gathered parameters after forward, overriding the strategy's rule
        and the root's exemption (FSDP2's meaning): ``True`` on the root or a
        ``SHARD_GRAD_OP`` unit gathers it again in backward; ``False`` on a
        ``FULL_SHARD`` unit keeps it until its backward (no backward
        all-gather, more memory).  Freeing after backward is
        ``set_reshard_after_backward``'s.  No effect on ``NO_SHARD``."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)} "
                f"[rank {global_rank()}]")
        me = cast(UnitState, self)
        _check_between_iterations(me, "set_reshard_after_forward")
        for st in _units(me, recurse):
            controls_of(st).reshard_after_forward = reshard_after_forward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this unit is all-gathered for its backward (default ``True``).

        ``False`` is for units whose backward reads none of their parameters
        (an embedding: its gradient needs only the indices): the unit is not
        gathered again after its forward freed it, nor prefetched; its
        gradient is still reduced.  A unit whose backward does read them
        then fails in backward.  Not recursive (FSDP2's)."""
        if not isinstance(unshard_in_backward, bool):
            raise ValueError(
                f"unshard_in_backward should be a bool, got {type(unshard_in_backward)} "
                f"[rank {global_rank()}]")
        me = cast(UnitState, self)
        _check_between_iterations(me, "set_unshard_in_backward")
        controls_of(me).unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: Any) -> None:
        """An event recorded after the optimizer step, which the root's next
        forward waits for before its all-gathers, then drops (FSDP2's).

        fsdp_wrap issues its all-gathers on the compute stream, which runs
        after the optimizer step anyway: the event matters where the step ran
        on another stream.  On the CPU nothing waits (there is no stream; the
        host ran the step before calling forward).  Call it on the root (on
        another unit it counts once the first forward made the root known)."""
        if not callable(getattr(event, "wait", None)):
            raise TypeError(
                f"set_post_optim_event expects a torch.Event recorded after the optimizer step "
                f"but got {type(event).__name__} [rank {global_rank()}]")
        me = cast(UnitState, self)
        controls_of(me._root).post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of the
        number of ranks (not recursive, FSDP2's).  As FSDP1 splits the
        world size, ``factor`` is split into a division before and one after
        the sum (``factor`` equal to the world size changes nothing, bit for
        bit).  Not with a communication hook, which does its own division."""
        me = cast(UnitState, self)
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
    if not is_unit(module):
        return
    if not hasattr(module, method_name):
        raise ValueError(
            f"{type(module)} does not have a method {method_name} [rank {global_rank()}]: "
            f"the FSDP unit '{unit_name(cast(UnitState, module))}' and the module it wraps "
            f"have no attribute {method_name!r}; give the name of a method of the wrapped module")
    method = getattr(module, method_name)
    run = cast(Any, module)._forward_with

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        return run(method, args, kwargs)

    object.__setattr__(module, method_name, as_forward)


# ------------------------------------------------------------------ checks


def _units(state: UnitState, recurse: bool) -> list[UnitState]:
    return [m for m in state.modules() if is_unit(m)] if recurse else [state]  # type: ignore[misc]


def _phase_error(state: UnitState, what: str, when: str) -> str:
    return (f"[rank {global_rank()}] {what}() was called on unit '{unit_name(state)}' {when} "
            f"(its state is {state.training_state}); call it before the unit's forward or "
            "after its backward")


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
        if not is_unit(m):
            raise ValueError(
                f"Expects FSDPModule but got {type(m)}: {_module_name(me, m)} "
                f"[rank {global_rank()}] {what} on unit '{unit_name(me)}' expects FSDP units "
                "(FullyShardedDataParallel instances); pass the unit that wraps this module "
                "(e.g. model.layers[3] after auto-wrapping), or wrap it")
        unit = cast(UnitState, m)
        if tree_of(unit) is not tree_of(me):
            raise ValueError(
                f"[rank {global_rank()}] {what} on unit '{unit_name(me)}' got unit "
                f"'{unit_name(unit)}' of another model (another root); list units of the "
                "same model")
        units.append(unit)
    return units


def _module_name(me: UnitState, module: object) -> str:
    """Where ``module`` sits under ``me``'s root (for messages), else its class."""
    for name, m in tree_of(me).named_modules():
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


def _initialised(state: UnitState) -> None:
    """Lazy-initialise the tree ``state`` belongs to (from its outermost unit:
    a unit alone would make itself a root)."""
    if state._is_root is None:
        tree.lazy_init(tree_of(state))
