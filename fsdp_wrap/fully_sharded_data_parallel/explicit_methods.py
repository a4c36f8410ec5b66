"""FSDP2's explicit controls of the schedule as methods of the façade.

Names, signatures and meanings are FSDP2's (``FSDPModule``); what each
means on an FSDP1 unit is in :doc:`/options` ("FSDP2's explicit controls").
The work is done by :mod:`fsdp_wrap.runtime.explicit.api` on the unit's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.nn as nn

import fsdp_wrap.runtime.explicit.api as _explicit

if TYPE_CHECKING:
    from fsdp_wrap.runtime.state import UnitState

__all__ = ["ExplicitMethods"]


class ExplicitMethods:
    """``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``,
    ``unshard``, ``reshard``, ``set_reshard_after_forward``,
    ``set_unshard_in_backward``, ``set_post_optim_event`` and
    ``set_gradient_divide_factor`` (FSDP2's names and meanings)."""

    _fsdp_state: UnitState

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
        forwards with grad (in a forward without grad a listed unit that then
        does not run would stay gathered)."""
        _explicit.set_prefetch(self._fsdp_state, modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: Sequence[nn.Module]) -> None:
        """The FSDP units whose all-gathers this unit starts in its
        pre-backward, right after gathering its own, in this order.

        It replaces ``backward_prefetch`` for this unit: ``[the unit whose
        backward comes next]`` gives ``BACKWARD_PRE``'s schedule, two or more
        units gather that far ahead.  An empty list restores the default.  A
        listed unit whose backward already began is not gathered again (FSDP2
        would gather it anew and hold it to the end of backward)."""
        _explicit.set_prefetch(self._fsdp_state, modules, "backward")

    def unshard(self, async_op: bool = False) -> _explicit.UnshardHandle | None:
        """All-gather this unit's parameters (not its children's), in the
        compute dtype; FSDP2's ``unshard``.

        ``async_op=True`` starts the all-gathers and returns an
        :class:`~fsdp_wrap.UnshardHandle` at once (asynchronous on CPU too);
        its ``wait()`` waits and registers the unsharded parameters, or the
        unit's next pre-forward does.  ``False`` does both now and returns
        ``None``.  The parameters stay unsharded until :meth:`reshard`, or
        until the unit's forward reshards as its strategy says.  The first
        call on a model not yet run initialises it (a collective)."""
        return _explicit.unshard(self._fsdp_state, async_op)

    def reshard(self) -> None:
        """Free this unit's unsharded parameters (not its children's) and
        show the sharded ones; FSDP2's ``reshard``.  Between forward and
        backward the unit is gathered again for its backward; not during the
        unit's own forward or backward (``ValueError``)."""
        _explicit.reshard(self._fsdp_state)

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """Whether this unit (and, with ``recurse``, every unit under it) frees
        its gathered parameters after forward, overriding the strategy's rule
        and the root's exemption (FSDP2's meaning): ``True`` on the root or a
        ``SHARD_GRAD_OP`` unit gathers it again in backward; ``False`` on a
        ``FULL_SHARD`` unit keeps it until its backward (no backward
        all-gather, more memory).  Freeing after backward is
        :meth:`set_reshard_after_backward`'s.  No effect on ``NO_SHARD``."""
        _explicit.set_reshard_after_forward(self._fsdp_state, reshard_after_forward, recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this unit is all-gathered for its backward (default ``True``).

        ``False`` is for units whose backward reads none of their parameters
        (an embedding: its gradient needs only the indices): the unit is not
        gathered again after its forward freed it, nor prefetched; its
        gradient is still reduced.  A unit whose backward does read them
        then fails in backward.  Not recursive (FSDP2's)."""
        _explicit.set_unshard_in_backward(self._fsdp_state, unshard_in_backward)

    def set_post_optim_event(self, event: Any) -> None:
        """An event recorded after the optimizer step, which the root's next
        forward waits for before its all-gathers, then drops (FSDP2's).

        fsdp_wrap issues its all-gathers on the compute stream, which runs
        after the optimizer step anyway: the event matters where the step ran
        on another stream.  On the CPU nothing waits (there is no stream; the
        host ran the step before calling forward).  Call it on the root (on
        another unit it counts once the first forward made the root known)."""
        _explicit.set_post_optim_event(self._fsdp_state, event)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of the
        number of ranks (not recursive, FSDP2's).  As FSDP1 splits the
        world size, ``factor`` is split into a division before and one after
        the sum (``factor`` equal to the world size changes nothing, bit for
        bit).  Not with a communication hook, which does its own division."""
        _explicit.set_gradient_divide_factor(self._fsdp_state, factor)
