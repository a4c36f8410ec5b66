"""FSDP2's gradient-accumulation controls as methods of the façade.

What each one does, and how it meets FSDP1's own knobs (``no_sync``, the
strategy's resharding), is in :doc:`/options` ("Gradient accumulation"); the
work is done by :mod:`fsdp_wrap.runtime.accumulation` on the unit's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import fsdp_wrap.runtime.accumulation as _acc

if TYPE_CHECKING:
    from fsdp_wrap.runtime.state import UnitState

__all__ = ["AccumulationMethods"]


class AccumulationMethods:
    """``set_requires_gradient_sync``, ``set_requires_all_reduce``,
    ``set_is_last_backward`` and ``set_reshard_after_backward`` (FSDP2's names
    and meanings)."""

    _fsdp_state: UnitState

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Whether backward reduces the gradients of this unit (and, with
        ``recurse``, every unit under it): ``False`` is ``no_sync()`` without the
        block, per unit (each rank keeps its local unsharded gradient and the
        next synced backward reduces it).  Sets the replicas' all-reduce
        (:meth:`set_requires_all_reduce`) to the same value, as FSDP2 does.
        Inside a ``no_sync()`` block nothing is reduced whatever this says; the
        block's exit restores the values set before it."""
        _acc.set_requires_gradient_sync(self._fsdp_state, requires_gradient_sync, recurse)

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
        _acc.set_requires_all_reduce(self._fsdp_state, requires_all_reduce, recurse)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step
        (default ``True``).  ``False``: its end does not wait for the
        reduce-scatters whose results only feed sharded partial sums
        (:meth:`set_requires_all_reduce`); they finish while the next forward
        starts.  Every gradient that reaches ``.grad`` is complete when
        ``backward()`` returns either way.  Applies to the whole tree."""
        _acc.set_is_last_backward(self._fsdp_state, is_last_backward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Whether a sharded unit frees its gathered parameters after its
        backward.  ``False`` keeps them, so the next forward gathers nothing
        (FULL_SHARD frees them after that forward again; SHARD_GRAD_OP keeps
        them through it); ``True`` frees them even where FSDP1 would keep them
        (SHARD_GRAD_OP under ``no_sync``).  Unset (the default), FSDP1's rule
        holds.  A kept copy is gathered again if the shard changed since
        (an optimizer step, a load)."""
        _acc.set_reshard_after_backward(self._fsdp_state, reshard_after_backward, recurse)
