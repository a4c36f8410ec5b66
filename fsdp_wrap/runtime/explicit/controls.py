"""What a unit's explicit controls hold, and the check that every rank holds the same.

A unit that never had an explicit control set holds none (its state's
``_explicit`` is ``None``): the hooks then cost one attribute read.
The first ``set_*`` call gives the unit an :class:`ExplicitControls`.

The prefetch lists change which collectives a rank issues and when: ranks
with different lists would pair one unit's all-gather with another's (a
wrong result) or hang.  So the settings of every unit of a tree are compared
across ranks at lazy initialisation, inside the one ``all_gather_object``
that compares the units already (:func:`schedule_signature`,
:func:`check_schedules`): nothing is added per step.  Settings changed after
the first forward are not compared (as ``no_sync`` and
``set_requires_gradient_sync`` are not): every rank must make the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import UnitState, live_units

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle

__all__ = ["ExplicitControls", "check_schedules", "controls_of", "reshards_after_forward",
           "schedule_signature", "tree_of", "unit_name", "unshards_in_backward",
           "wait_post_optim_event"]


@dataclass
class ExplicitControls:
    """One unit's explicit controls (FSDP2's, set by the methods of
    ``fsdp_wrap.runtime.explicit.api``).

    Empty prefetch lists mean the default schedule, as in FSDP2.
    """

    forward_prefetch: list[UnitState] = field(default_factory=list)
    backward_prefetch: list[UnitState] = field(default_factory=list)
    unshard_in_backward: bool = True
    reshard_after_forward: bool | None = None  # None: FSDP1's rule (root kept)
    gradient_divide_factor: float | None = None  # None: the mean over ranks
    post_optim_event: Any = None  # (held by the root until its next forward)


def controls_of(state: UnitState) -> ExplicitControls:
    """``state``'s controls, made on first use."""
    controls = state._explicit
    if controls is None:
        controls = ExplicitControls()
        state._explicit = controls
    return controls


# ------------------------------------------------- what the hooks ask

def reshards_after_forward(state: UnitState, handle: FlatParamHandle) -> bool:
    """Whether ``handle`` is freed after its unit's forward: FSDP1's rule (the
    strategy's, the root kept), unless ``set_reshard_after_forward`` said
    otherwise for this unit."""
    explicit = state._explicit
    if explicit is not None and explicit.reshard_after_forward is not None:
        return bool(explicit.reshard_after_forward and handle.uses_sharded_strategy)
    return handle.reshard_after_forward and not state._is_root


def unshards_in_backward(state: UnitState) -> bool:
    """Whether the unit is gathered for its backward (``set_unshard_in_backward``)."""
    return state._explicit is None or bool(state._explicit.unshard_in_backward)


def wait_post_optim_event(root: UnitState) -> None:
    """``set_post_optim_event``, at the root's pre-forward: the gathers of this
    forward are issued on the compute stream, which waits for the event first
    (then it is dropped, as FSDP2 drops it).  On the CPU there is no stream:
    the host ran the optimizer step before this forward was called, so
    nothing waits."""
    explicit = root._explicit
    if explicit is None or explicit.post_optim_event is None:
        return
    event, explicit.post_optim_event = explicit.post_optim_event, None
    if root.compute_device.type != "cpu":
        event.wait()


# ------------------------------------------------------------- names

def tree_of(state: UnitState) -> UnitState:
    """The root of ``state``'s tree: known once the tree is initialised, else
    the outermost unit alive in this process that holds it (a unit has no
    parent pointer)."""
    if state._is_root is not None:
        return state._root
    me = state.module
    holders = [u for u in live_units() if any(m is me for m in u.module.modules())]
    return max(holders, key=lambda u: sum(1 for _ in u.module.modules()), default=state)


def unit_name(state: UnitState) -> str:
    """The unit's clean FQN under its root (``<root>`` for the root), for messages."""
    if state._handles and state._is_root is not None:
        return state._handles[0].unit_fqn or "<root>"
    me = state.module
    for name, m in tree_of(state).module.named_modules():
        if m is me:
            return clean_fqn(name) or "<root>"
    return "<root>"


def schedule_signature(root: UnitState) -> tuple[list[Any], str]:
    """Every unit's explicit settings, by unit index in ``root``'s tree (what
    ranks must agree on), and a problem found locally ("" if none): a listed
    unit outside this tree.  Local problems travel with the signature so every
    rank raises together, after the comparison, instead of one rank raising
    while the others wait in it."""
    index = {id(st): i for i, st in enumerate(root._all_fsdp_states)}
    sig: list[Any] = []
    problem = ""
    for i, st in enumerate(root._all_fsdp_states):
        c = st._explicit
        if c is None:
            continue
        lists = []
        for kind, units in (("forward", c.forward_prefetch), ("backward", c.backward_prefetch)):
            outside = [u for u in units if id(u) not in index]
            if outside and not problem:
                problem = (f"set_modules_to_{kind}_prefetch on unit '{unit_name(st)}' lists "
                           f"{len(outside)} FSDP unit(s) of another model (not under this "
                           "root); list units of the same model")
            lists.append([index.get(id(u), -1) for u in units])
        sig.append((i, lists[0], lists[1], c.unshard_in_backward, c.reshard_after_forward,
                    c.gradient_divide_factor))
    return sig, problem


def check_schedules(root: UnitState, everyone: list[tuple[list[Any], str]],
                    group: dist.ProcessGroup) -> None:
    """``ValueError`` on every rank, after the comparison, where a rank found a
    problem in its own settings; ``RuntimeError`` where ranks set different
    explicit controls."""
    for r, (_, problem) in enumerate(everyone):
        if problem:
            raise ValueError(
                f"[rank {global_rank()}] rank {dist.get_global_rank(group, r)}: {problem}")
    mine = everyone[dist.get_rank(group)][0]
    for r, (theirs, _) in enumerate(everyone):
        if theirs == mine:
            continue
        other = dist.get_global_rank(group, r)
        ours, their = dict(_by_unit(mine)), dict(_by_unit(theirs))
        i = next(i for i in sorted(set(ours) | set(their)) if ours.get(i) != their.get(i))
        name = unit_name(root._all_fsdp_states[i])
        raise RuntimeError(
            f"[rank {global_rank()}] FSDP2-style explicit controls differ between rank "
            f"{global_rank()} and rank {other} at unit '{name}': rank {global_rank()} has "
            f"{_describe(root, ours.get(i))}, rank {other} has {_describe(root, their.get(i))}. "
            "Every rank must make the same set_modules_to_forward_prefetch / "
            "set_modules_to_backward_prefetch / set_unshard_in_backward / "
            "set_reshard_after_forward / set_gradient_divide_factor calls; otherwise the "
            "units' all-gathers would pair up wrongly or hang.")


def _by_unit(sig: list[Any]) -> list[tuple[int, Any]]:
    return [(entry[0], entry[1:]) for entry in sig]


def _describe(root: UnitState, entry: Any) -> str:
    if entry is None:
        return "the defaults"
    fwd, bwd, unshard_bwd, raf, factor = entry
    states = root._all_fsdp_states

    def names(idx: list[int]) -> list[str]:
        return [unit_name(states[i]) if 0 <= i < len(states) else "?" for i in idx]

    return (f"forward prefetch {names(fwd)}, backward prefetch {names(bwd)}, "
            f"unshard_in_backward={unshard_bwd}, reshard_after_forward={raf}, "
            f"gradient_divide_factor={factor}")
