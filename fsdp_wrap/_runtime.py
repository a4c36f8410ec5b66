"""Forward and backward hooks: when each unit is gathered, freed and reduced.

The hooks call their unit's :class:`FlatParamHandle`; they never touch its
tensors.  The schedule per strategy (what holds after each hook):

================  =================  ======================  =====================
strategy          after forward      after unit's backward   end of backward
================  =================  ======================  =====================
FULL_SHARD        freed (root kept)  freed, grad reduced     every unit freed
SHARD_GRAD_OP     kept unsharded     freed, grad reduced     every unit freed
NO_SHARD          copy freed (*)     grad all-reduced        -
================  =================  ======================  =====================

(*) NO_SHARD is never gathered; with mixed precision or offload it computes on
a cast/moved copy, which is freed after each unit's forward and made again in
backward (torch does the same).

Under ``no_sync`` gradients are not reduced and SHARD_GRAD_OP units stay
unsharded.  A forward run without grad (evaluation) frees every unit, the root
included, since no backward will come to free them.
"""

from __future__ import annotations

import dataclasses
import functools
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.autograd import Variable

from . import _collectives as C
from ._compat import in_backward
from ._gather_batch import gather_ahead
from ._writeback import check_unchanged_since_forward
from .api import BackwardPrefetch

if TYPE_CHECKING:
    from ._flat_param import FlatParamHandle
    from .fully_sharded_data_parallel import FullyShardedDataParallel as FSDP


class TrainingState(Enum):
    """What an FSDP instance is doing (same members and values as torch's)."""

    IDLE = auto()
    FORWARD_BACKWARD = auto()
    SUMMON_FULL_PARAMS = auto()


class ExecOrder:
    """Unit order the prefetches follow; owned by the root.

    Forward prefetch uses the pre-forward order of the first iteration;
    backward prefetch uses this iteration's post-forward order reversed.
    """

    def __init__(self) -> None:
        self.forward_order: list[FlatParamHandle] = []
        self.forward_index: dict[FlatParamHandle, int] = {}
        self.forward_frozen = False
        self.post_forward_order: list[FlatParamHandle] = []
        self.post_forward_index: dict[FlatParamHandle, int] = {}

    def record_pre_forward(self, handle: FlatParamHandle) -> None:
        if not self.forward_frozen and handle not in self.forward_index:
            self.forward_index[handle] = len(self.forward_order)
            self.forward_order.append(handle)

    def record_post_forward(self, handle: FlatParamHandle) -> None:
        if handle not in self.post_forward_index:
            self.post_forward_index[handle] = len(self.post_forward_order)
            self.post_forward_order.append(handle)

    def next_in_forward(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        i = self.forward_index.get(handle)
        if not self.forward_frozen or i is None or i + 1 >= len(self.forward_order):
            return None
        return self.forward_order[i + 1]

    def next_in_backward(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        i = self.post_forward_index.get(handle)
        if i is None or i == 0:
            return None
        return self.post_forward_order[i - 1]

    def next_iteration(self) -> None:
        if self.forward_order:
            self.forward_frozen = True
        self.post_forward_order.clear()
        self.post_forward_index.clear()


# ----------------------------------------------------------------- forward


def root_pre_forward(state: FSDP, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Lazy-init the tree; at the root, finish any forward that saw no backward.

    Postcondition: every unit is sharded or holds a valid unsharded copy, and
    the inputs are on the compute device.
    """
    state._lazy_init()
    if not state._is_root:
        return args, kwargs
    for handle in state._all_handles:
        if handle.use_orig_params:
            # Replaced parameters/gradients are taken up (or refused) before
            # any collective of this forward.
            handle.pre_unshard()
            handle.sync_flat_grad_from_orig()
    if state._forward_pending_backward:
        # The previous forward was never followed by a backward (e.g. an
        # evaluation forward with grad enabled).  Free what it kept: the shards
        # may change (optimizer step) before the next gather.
        finalize_units(state, free_all=True)
    if state.compute_device.type != "cpu":
        args, kwargs = _to_device((args, kwargs), state.compute_device)
    return args, kwargs


def pre_forward(state: FSDP, handle: FlatParamHandle | None) -> None:
    """Gather this unit's parameters and expose them as unsharded views."""
    state.training_state = TrainingState.FORWARD_BACKWARD
    if handle is None:
        return
    root = state._root
    root._exec_order.record_pre_forward(handle)
    # No batching in a forward without grad (see fsdp_wrap._gather_batch), nor
    # in a checkpointed forward recomputed in backward: the forward order's
    # next units are then the ones whose backward is already done.
    batch_bytes = (root._all_gather_batch_bytes
                   if torch.is_grad_enabled() and not in_backward() else 0)
    gather_ahead(handle, batch_bytes, root._exec_order.next_in_forward)
    handle.finish_unshard(full_precision=False)
    if state.forward_prefetch:
        nxt = root._exec_order.next_in_forward(handle)
        if nxt is not None:
            gather_ahead(nxt, batch_bytes, root._exec_order.next_in_forward)
            nxt.start_unshard(full_precision=False)
    handle.use_unsharded_views(track_graph=True)


def post_forward(state: FSDP, handle: FlatParamHandle | None, output: Any) -> Any:
    """Reshard as the strategy says and hook the outputs for backward."""
    grad_enabled = torch.is_grad_enabled()
    if handle is not None:
        state._root._exec_order.record_post_forward(handle)
        if not grad_enabled or handle.frees_copy_after_forward:
            handle.reshard(free=True)
        elif handle.reshard_after_forward and not state._is_root:
            handle.reshard(free=True)
    if grad_enabled:
        state._root._forward_pending_backward = True
        output = _register_pre_backward_hooks(state, handle, output)
    state.training_state = TrainingState.IDLE
    return output


def _register_pre_backward_hooks(state: FSDP, handle: FlatParamHandle | None, output: Any) -> Any:
    hook = functools.partial(_pre_backward_hook, state, handle)

    def register(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            t.register_hook(hook)
        return t

    return _apply_to_tensors(register, output)


# ---------------------------------------------------------------- backward


def _pre_backward_hook(
    state: FSDP, handle: FlatParamHandle | None, grad: torch.Tensor
) -> torch.Tensor | None:
    """Runs when the gradient of one of the unit's outputs is ready.

    Idempotent within a backward: only the first output to arrive acts.
    Postcondition: the unit is unsharded with fresh views (activation
    checkpointing recomputes through them), the next unit's gather is in
    flight under BACKWARD_PRE, and any old sharded gradient is parked.
    """
    _queue_final_callback(state._root)
    if state._ran_pre_backward:
        return None
    state._ran_pre_backward = True
    state.training_state = TrainingState.FORWARD_BACKWARD
    if handle is not None:
        if (handle.use_orig_params and handle.is_unsharded and handle.uses_sharded_strategy
                and not handle.reshard_after_forward):
            # Kept unsharded since forward: the views must be the forward's.
            check_unchanged_since_forward(handle, handle.compute_views)
        root = state._root
        gather_ahead(handle, root._all_gather_batch_bytes,
                     functools.partial(_next_backward_pending, root))
        handle.finish_unshard(full_precision=False)
        # Hooks run with grad disabled; reentrant activation checkpointing
        # recomputes the forward through these views and needs them tracked.
        with torch.enable_grad():
            handle.use_unsharded_views()
        if state.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            _prefetch_backward(state, handle)
        handle.prepare_gradient_for_backward()
    return None


def make_post_backward_hook(state: FSDP, handle: FlatParamHandle) -> Callable[[torch.Tensor], None]:
    def post_backward(flat_param: torch.Tensor) -> None:
        """Runs after autograd accumulated this unit's unsharded gradient.

        Postcondition: the unit is resharded (freed unless SHARD_GRAD_OP under
        ``no_sync``), and ``flat_param.grad`` is the mean sharded gradient, or
        the local unsharded one under ``no_sync``.
        """
        _queue_final_callback(state._root)
        sync = state._sync_gradients
        handle.reshard(free=handle.uses_sharded_strategy and (sync or handle.reshard_after_forward))
        if state.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_backward(state, handle)
        state._root._grad_buckets.reduce(handle, sync)

    return post_backward


def make_early_free_hook(state: FSDP, handle: FlatParamHandle) -> Callable[[], None]:
    def free_early() -> None:
        """All of this unit's parameter gradients are computed: its gathered
        parameters are no longer needed (unless SHARD_GRAD_OP keeps them under
        ``no_sync``)."""
        if handle.uses_sharded_strategy and (state._sync_gradients or handle.reshard_after_forward):
            handle.free_unsharded_storage()

    return free_early


def _next_backward_pending(root: FSDP, handle: FlatParamHandle) -> FlatParamHandle | None:
    """The unit whose backward comes after ``handle``'s, unless it already began."""
    nxt = root._exec_order.next_in_backward(handle)
    if nxt is None or root._state_of[nxt]._ran_pre_backward:
        return None
    return nxt


def _prefetch_backward(state: FSDP, handle: FlatParamHandle) -> None:
    """Start gathering the unit whose backward comes next, if it has not begun."""
    root = state._root
    nxt = _next_backward_pending(root, handle)
    if nxt is not None:
        gather_ahead(nxt, root._all_gather_batch_bytes,
                     functools.partial(_next_backward_pending, root))
        nxt.start_unshard(full_precision=False)


def _queue_final_callback(root: FSDP) -> None:
    if not root._final_callback_queued:
        root._final_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_final_callback, root))


def _final_callback(root: FSDP) -> None:
    """End of backward: every unit resharded, every state IDLE."""
    finalize_units(root, free_all=False)


def finalize_units(root: FSDP, free_all: bool) -> None:
    """Reduce what the gradient buckets hold, reshard every unit and return
    every state to IDLE.

    SHARD_GRAD_OP units stay gathered under ``no_sync`` (the next micro-batch
    reuses them) unless ``free_all``.  A gradient parked by a pre-backward hook
    whose unit then got no gradient is put back.
    """
    # First: until a bucket is reduced its units' flat_param.grad is None,
    # which restore_parked_grad below would take for "no gradient this step".
    root._grad_buckets.finish()
    for state in root._all_fsdp_states:
        handle = state._handle
        if handle is not None:
            keep = not free_all and not state._sync_gradients and not handle.reshard_after_forward
            if handle.is_unsharded or handle.holds_unsharded_storage:
                handle.reshard(free=not keep)
            handle.restore_parked_grad()
            if not free_all:
                # End of a backward: every graph of the iteration is done.  A
                # forward still awaiting its backward (several forwards before
                # one backward) keeps its count, so nothing is freed early.
                handle.forget_graphs()
        state._ran_pre_backward = False
        state.training_state = TrainingState.IDLE
    root._final_callback_queued = False
    root._forward_pending_backward = False
    root._exec_order.next_iteration()


# ----------------------------------------------------------------- helpers


def _apply_to_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _apply_to_tensors(fn, getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return type(obj)((k, _apply_to_tensors(fn, v)) for k, v in obj.items()) if type(
            obj
        ) is dict else _map_mapping(fn, obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_apply_to_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_apply_to_tensors(fn, v) for v in obj)
    return obj


def _map_mapping(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    for k in list(obj.keys()):
        obj[k] = _apply_to_tensors(fn, obj[k])
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in ``obj`` to ``dtype``."""
    return _apply_to_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


def _to_device(obj: Any, device: torch.device) -> Any:
    return _apply_to_tensors(lambda t: t.to(device, non_blocking=True), obj)


def all_gather_unit_signatures(state: FSDP) -> None:
    """Fail fast, on every rank, if ranks built different units.

    One ``all_gather_object`` at lazy init; a mismatch would otherwise show up
    later as a hang or a silently wrong all-gather.
    """
    mine = [s._unit_signature() for s in state._all_fsdp_states]
    everyone = C.all_gather_objects(mine, state.process_group)
    for r, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        theirs_list: list[Any] = theirs  # type: ignore[assignment]
        for i in range(max(len(mine), len(theirs_list))):
            a = mine[i] if i < len(mine) else None
            b = theirs_list[i] if i < len(theirs_list) else None
            if a != b:
                raise RuntimeError(
                    f"[rank {state.rank}] FSDP units differ between rank {state.rank} and rank "
                    f"{r} at unit #{i}: rank {state.rank} has {a}, rank {r} has {b}. Every rank "
                    "must wrap the same model the same way (same auto_wrap_policy, sizes, "
                    "dtypes and sharding strategy); otherwise collectives would hang."
                )
