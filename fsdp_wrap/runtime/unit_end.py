"""When a unit's backward is over where no parameter hook can tell: its
forward inputs' gradients.

A unit's post-backward hook fires when its flat parameter's gradient is
accumulated.  Two cases have no such moment: a frozen flat parameter (no
gradient at all), and a unit whose gradient reaches it only through reentrant
activation checkpoints' backwards (one part per checkpoint, none saying it is
the last).  Both are told by the gradients of the unit's forward inputs: the
runtime's hooks (:mod:`fsdp_wrap.runtime.hooks`) note the inputs at each
forward (:func:`note_inputs`) and, for the second case, watch them
(:func:`watch_unit_end`).  :func:`frees_after_backward` is FSDP1's rule for
what a unit frees when its backward is done, which both follow.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch

from fsdp_wrap.runtime.state import UnitState
from fsdp_wrap.runtime.tensors import grad_tensors

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle

__all__ = ["frees_after_backward", "note_inputs", "watch_unit_end"]


def frees_after_backward(state: UnitState, handle: FlatParamHandle) -> bool:
    """Whether ``handle`` frees its gathered parameters once its backward is done.

    FSDP1's rule: a sharded unit does, except SHARD_GRAD_OP-like units under
    ``no_sync`` (the next micro-batch reuses them).
    ``set_reshard_after_backward`` overrides it either way.
    """
    if not handle.uses_sharded_strategy:
        return False
    if state._reshard_after_backward is not None:
        return state._reshard_after_backward
    return state._sync_gradients or handle.reshard_after_forward


def note_inputs(state: UnitState, inputs: Any) -> None:
    """The forward's inputs that require grad, kept weakly: their gradients
    mark the end of the unit's backward where no parameter hook can (frozen
    flat parameters, :func:`_register_frozen_free`; gradients that arrive
    from reentrant checkpoints' backwards only, :func:`watch_unit_end`)."""
    tensors = grad_tensors(inputs, [])
    # (weakly: an input nothing else keeps is not kept alive for this)
    state._grad_inputs = [weakref.ref(t) for t in tensors]
    if tensors:
        for h in state._handles:
            if not h.flat_param.requires_grad:
                _register_frozen_free(state, tensors)
                break


def _register_frozen_free(state: UnitState, tensors: list[torch.Tensor]) -> None:
    """A unit with frozen flat parameters frees them once the gradients of its
    forward's inputs are computed: its backward no longer needs them (torch's
    reshard-only hook).  Inputs without grad: the end-of-backward callback
    frees them.  Several forwards before one backward: the last one frees."""
    state._frozen_open_graphs += 1

    def free_frozen(state: UnitState) -> None:
        state._frozen_open_graphs -= 1
        if state._frozen_open_graphs > 0:
            return
        for h in state._handles:
            if not h.flat_param.requires_grad and (h.is_unsharded or h.holds_unsharded_storage):
                h.reshard(free=frees_after_backward(state, h))

    _once_inputs_done(state, tensors, free_frozen)


def _once_inputs_done(state: UnitState, tensors: list[torch.Tensor],
                      fn: Callable[[UnitState], None]) -> None:
    """Call ``fn(state)`` once, when the gradients of ``tensors`` (the unit's
    forward inputs) are computed in this backward; the hook then removes
    itself.  The unit is held weakly: the hook is held from C++ by the
    inputs' graph, where a cycle back to the unit is out of the collector's
    sight."""
    registered: list[Any] = []
    state_ref = weakref.ref(state)

    def done(grads: Any) -> None:
        for r in registered:
            r.remove()
        unit = state_ref()
        if unit is not None:
            fn(unit)

    registered.append(torch.autograd.graph.register_multi_grad_hook(tensors, done))


def watch_unit_end(state: UnitState, reduce_pending: Callable[[UnitState], None]) -> None:
    """The unit's gradient reaches it only through reentrant activation
    checkpoints' backwards (one per checkpoint), and nothing says which is the
    last: reduce once the gradients of the unit's inputs are computed, when
    every checkpoint inside it has run (else at the end of backward)."""
    inputs = [t for t in (r() for r in state._grad_inputs) if t is not None]
    if inputs:  # (else the end of backward reduces what is pending)
        _once_inputs_done(state, inputs, reduce_pending)
