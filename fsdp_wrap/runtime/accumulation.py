"""FSDP2's gradient-accumulation controls, on every fsdp_wrap unit.

``FullyShardedDataParallel`` inherits :class:`AccumulationAPI`; the hooks
(:mod:`fsdp_wrap.runtime.hooks`) read the flags it sets, and each handle's
gradient part (:class:`fsdp_wrap.handle.grads.FlatGrads`) keeps the sharded
partial sums.  What each one does, and how it meets FSDP1's own knobs
(``no_sync``, the strategy's resharding), is in :doc:`/options`
("Gradient accumulation").
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch.distributed as dist

from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.state import TrainingState, UnitState, is_unit

__all__ = ["AccumulationAPI", "warn_if_partial", "warn_step_with_partial"]


def _units(state: UnitState, recurse: bool) -> list[UnitState]:
    return [m for m in state.modules() if is_unit(m)] if recurse else [state]  # type: ignore[misc]


def _check(state: UnitState, name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is a bool and no unit is in forward/backward.

    Then reductions left in flight by ``set_is_last_backward(False)`` are
    finished: they were issued under the flags about to change (a partial
    sum's part must not land as a gradient).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} should be a bool, got {type(value)} [rank {global_rank()}]")
    for st in _units(state, True):
        if st.training_state is TrainingState.FORWARD_BACKWARD:
            raise ValueError(
                f"[rank {global_rank()}] set_{name}() was called during forward/backward; "
                "call it between iterations (before the forward whose backward it is for)")
    if state._is_root is not None and not state._root._grad_buckets.idle:
        state._root._grad_buckets.finish()


class AccumulationAPI:
    """``set_requires_gradient_sync``, ``set_requires_all_reduce``,
    ``set_is_last_backward`` and ``set_reshard_after_backward`` (FSDP2's names
    and meanings)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Whether backward reduces the gradients of this unit (and, with
        ``recurse``, every unit under it): ``False`` is ``no_sync()`` without the
        block, per unit (each rank keeps its local unsharded gradient and the
        next synced backward reduces it).  Sets the replicas' all-reduce
        (:meth:`set_requires_all_reduce`) to the same value, as FSDP2 does.
        Inside a ``no_sync()`` block nothing is reduced whatever this says; the
        block's exit restores the values set before it."""
        me = cast(UnitState, self)
        _check(me, "requires_gradient_sync", requires_gradient_sync)
        for st in _units(me, recurse):
            st._sync_gradients = requires_gradient_sync
            for h in st._handles:
                h.grads.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *,
                                recurse: bool = True) -> None:
        """Hybrid strategies: whether backward all-reduces the gradient shard
        over the replicate group.  ``False``: each backward still
        reduce-scatters within the shard group, and the shard (float32) is
        added to a sharded partial sum; the first backward after this is set
        back to ``True`` adds its own and all-reduces the sum once.  Gradient
        accumulation at the memory of the sharded gradient and with one
        replicas' all-reduce per optimizer step.  ``.grad`` is not updated
        until then.  No effect on units without a replicate group (as in
        FSDP2)."""
        me = cast(UnitState, self)
        _check(me, "requires_all_reduce", requires_all_reduce)
        handles = [h for st in _units(me, recurse) for h in st._handles]
        for h in handles:
            h.grads.requires_all_reduce = requires_all_reduce
        if not requires_all_reduce:
            _warn_if_no_replicas(handles)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step
        (default ``True``).  ``False``: its end does not wait for the
        reduce-scatters whose results only feed sharded partial sums
        (:meth:`set_requires_all_reduce`); they finish while the next forward
        starts.  Every gradient that reaches ``.grad`` is complete when
        ``backward()`` returns either way.  Applies to the whole tree."""
        me = cast(UnitState, self)
        _check(me, "is_last_backward", is_last_backward)
        states = me._root._all_fsdp_states if me._is_root is not None else []
        for st in set(_units(me, True)) | set(states):
            st._is_last_backward = is_last_backward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Whether a sharded unit frees its gathered parameters after its
        backward.  ``False`` keeps them, so the next forward gathers nothing
        (FULL_SHARD frees them after that forward again; SHARD_GRAD_OP keeps
        them through it); ``True`` frees them even where FSDP1 would keep them
        (SHARD_GRAD_OP under ``no_sync``).  Unset (the default), FSDP1's rule
        holds.  A kept copy is gathered again if the shard changed since
        (an optimizer step, a load)."""
        me = cast(UnitState, self)
        _check(me, "reshard_after_backward", reshard_after_backward)
        for st in _units(me, recurse):
            st._reshard_after_backward = reshard_after_backward


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
        stacklevel=3,
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
