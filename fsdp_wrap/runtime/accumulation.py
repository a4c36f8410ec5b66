"""FSDP2's gradient-accumulation controls, on every fsdp_wrap unit.

The façade's methods of the same names call these; the hooks
(:mod:`fsdp_wrap.runtime.hooks`) read the flags they set, and each handle's
gradient part (:class:`fsdp_wrap.handle.grads.FlatGrads`) keeps the sharded
partial sums.  What each one does, and how it meets FSDP1's own knobs
(``no_sync``, the strategy's resharding), is in :doc:`/options`
("Gradient accumulation").
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.state import TrainingState, UnitState, expect_state, state_of

__all__ = [
    "set_is_last_backward",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "warn_if_partial",
    "warn_step_with_partial",
]


def _units(state: UnitState, recurse: bool) -> list[UnitState]:
    if not recurse:
        return [state]
    found = (state_of(m) for m in state.module.modules())
    return [st for st in found if st is not None]


def _check(state: UnitState, name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is a bool and no unit is in forward/backward.

    Then reductions left in flight by ``set_is_last_backward(False)`` are
    finished: they were issued under the flags about to change (a partial
    sum's part must not land as a gradient).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} should be a bool, got {type(value)} [rank {global_rank()}]")
    for st in _units(state, True):
        expect_state(st, (TrainingState.IDLE, TrainingState.SUMMON_FULL_PARAMS),
                     action=f"set_{name}()",
                     fix="call it between iterations (before the forward whose backward it is for)")
    if state._is_root is not None and not state._root._grad_buckets.idle:
        state._root._grad_buckets.finish()


def set_requires_gradient_sync(state: UnitState, value: bool, recurse: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync`` (the façade's method says what it does)."""
    _check(state, "requires_gradient_sync", value)
    for st in _units(state, recurse):
        st._sync_gradients = value
        for h in st._handles:
            h.grads.requires_all_reduce = value


def set_requires_all_reduce(state: UnitState, value: bool, recurse: bool) -> None:
    """FSDP2's ``set_requires_all_reduce``; ``False`` where no unit has
    replicas warns that it changes nothing."""
    _check(state, "requires_all_reduce", value)
    handles = [h for st in _units(state, recurse) for h in st._handles]
    for h in handles:
        h.grads.requires_all_reduce = value
    if not value:
        _warn_if_no_replicas(handles)


def _warn_if_no_replicas(handles: list[Any]) -> None:
    """``set_requires_all_reduce(False)`` changes nothing where no trainable
    flat parameter has replicas (as in FSDP2): say so, with what would help."""
    trainable = [h for h in handles if h.flat_param.requires_grad]
    if not trainable or any(h.replicate_group is not None
                            and dist.get_world_size(h.replicate_group) > 1 for h in trainable):
        return
    warnings.warn(
        f"[rank {global_rank()}] set_requires_all_reduce(False) has no effect here: no FSDP "
        "unit it applies to has replicas (only HYBRID_SHARD and _HYBRID_SHARD_ZERO2 with "
        "more than one replicate rank all-reduce across replicas), so every backward still "
        "reduces the gradients in full. To skip the reduction of a micro-batch, use no_sync() "
        "or set_requires_gradient_sync(False)",
        stacklevel=4,
    )


def warn_step_with_partial(optimizer: object, units: list[UnitState]) -> None:
    """At ``optimizer.step()``: warn if the optimizer's units hold gradients in
    sharded partial sums (``set_requires_all_reduce(False)`` left set at the
    step: they are not in ``.grad``, and they outlive the step and
    ``zero_grad()`` into the next all-reducing backward)."""
    pending = [h for st in units for h in st._handles if h.grads.holds_partial]
    if not pending:
        return
    names = sorted({h.unit_fqn or "<root>" for h in pending})
    warnings.warn(
        f"{type(optimizer).__name__}.step() [rank {global_rank()}] with "
        f"set_requires_all_reduce(False) still in effect: the gradients of {len(pending)} flat "
        f"parameter(s) (units {names[:4]}{'...' if len(names) > 4 else ''}) wait in sharded "
        "partial sums for the replicas' all-reduce, so this step does not see them, and they "
        "survive step() and zero_grad() into the next step's gradients. Call "
        "set_requires_all_reduce(True) before the last micro-batch's backward of each "
        "optimizer step",
        stacklevel=4,
    )


def set_is_last_backward(state: UnitState, value: bool) -> None:
    """FSDP2's ``set_is_last_backward``: for the whole tree."""
    _check(state, "is_last_backward", value)
    states = state._root._all_fsdp_states if state._is_root is not None else []
    for st in {*_units(state, True), *states}:
        st._is_last_backward = value


def set_reshard_after_backward(state: UnitState, value: bool, recurse: bool) -> None:
    """FSDP2's ``set_reshard_after_backward``."""
    _check(state, "reshard_after_backward", value)
    for st in _units(state, recurse):
        st._reshard_after_backward = value


def warn_if_partial(root: UnitState, what: str) -> None:
    """Warn that ``what`` sees gradients some micro-batches are still missing
    from (sharded partial sums waiting for the replicas' all-reduce)."""
    pending = [h for h in root._all_handles if h.grads.holds_partial]
    if pending:
        names = sorted({h.unit_fqn or "<root>" for h in pending})
        warnings.warn(
            f"[rank {global_rank()}] {what} sees gradients without the micro-batches held in "
            f"sharded partial sums of {len(pending)} flat parameter(s) (units {names[:4]}"
            f"{'...' if len(names) > 4 else ''}): set_requires_all_reduce(False) is in effect; "
            "set it back to True before the last micro-batch's backward",
            stacklevel=3,
        )
