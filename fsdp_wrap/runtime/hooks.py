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

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.autograd import Variable

import fsdp_wrap.comm.labels as L
import fsdp_wrap.runtime.construct as _init
import fsdp_wrap.runtime.explicit.controls as explicit_controls
import fsdp_wrap.runtime.guards as guards
import fsdp_wrap.runtime.tree as tree
from fsdp_wrap._compat import in_backward
from fsdp_wrap.api import BackwardPrefetch, ShardingStrategy
from fsdp_wrap.comm.gather_batch import gather_ahead
from fsdp_wrap.handle.flat_tensor import HandleTrainingState
from fsdp_wrap.runtime.state import TrainingState, UnitState, enter
from fsdp_wrap.runtime.tensors import map_tensors, to_device
from fsdp_wrap.runtime.unit_end import frees_after_backward, note_inputs, watch_unit_end

if TYPE_CHECKING:
    from fsdp_wrap.handle.flat_param import FlatParamHandle

# Strategies whose units show the unsharded parameters from forward through
# backward (torch's "no reshard after forward"); the others show sharded views
# in between.
KEEP_VIEWS_AFTER_FORWARD = frozenset({ShardingStrategy.SHARD_GRAD_OP,
                                      ShardingStrategy._HYBRID_SHARD_ZERO2})

def register_handle_hooks(state: UnitState) -> None:
    """The unit's gradient hooks, per trainable flat parameter: reduce when its
    flat gradient is complete and, for sharded strategies, free its unsharded
    data once every view's gradient arrived.  Frozen flat parameters get none:
    they are freed once the unit's input gradients are computed
    (:func:`_register_frozen_free`), else by the end-of-backward callback.

    Called at construction and again before every forward with grad: a flat
    parameter unfrozen since (``requires_grad_(True)`` between iterations,
    progressive unfreezing) gets its hooks then, as torch's FSDP1 registers
    them in each pre-forward.  Idempotent: one hook per flat parameter."""
    for handle in state._handles:
        if not handle.flat_param.requires_grad or handle in state._hooked_handles:
            continue
        state._hooked_handles.add(handle)
        handle.flat_param.register_post_accumulate_grad_hook(
            make_post_backward_hook(state, handle))
        if handle.uses_sharded_strategy:
            # (NO_SHARD's unsharded data is the parameter: nothing to free early)
            handle.views.on_view_grads_ready = make_early_free_hook(state, handle)
            handle.views.in_nested_backward = handle.grads.is_partial


def unit_label(state: UnitState, *_: Any) -> str:
    """The unit's name in profiler labels (``fsdp_wrap.comm.labels``)."""
    return L.names(h.unit_fqn for h in state._handles)


# ----------------------------------------------------------------- forward


def root_pre_forward(state: UnitState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Lazy-init the tree; at the root, finish any forward that saw no backward.

    Postcondition: every unit is sharded or holds a valid unsharded copy, and
    the inputs are on the compute device.
    """
    tree.lazy_init(state)
    guards.check_root_flag(state)
    if not state._is_root or in_backward():
        # In a backward, this forward is activation checkpointing (wrapped
        # around this root unit) recomputing it: the backward in progress owns
        # the gradients and the pending-forward bookkeeping; finishing the
        # "forward without backward" here would put a parked sharded gradient
        # back under the unsharded one about to accumulate.
        if state._is_root and state.compute_device.type != "cpu":
            args, kwargs = to_device((args, kwargs), state.compute_device)
        return args, kwargs
    if L.profiler_enabled():
        with L.span(L.ROOT_PRE_FORWARD):
            return _root_pre_forward(state, args, kwargs)
    return _root_pre_forward(state, args, kwargs)


def _root_pre_forward(state: UnitState, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The root's part of :func:`root_pre_forward`."""
    if not state._replicas_checked:
        guards.check_replicas(state)  # once: replicas must start alike (a collective if any)
    if state._explicit is not None:
        explicit_controls.wait_post_optim_event(state)
    training = torch.is_grad_enabled()
    for handle in state._all_handles:
        if handle.use_orig_params:
            if training:
                handle.check_still_frozen()
            # Replaced parameters/gradients are taken up (or refused) before
            # any collective of this forward.
            # (A flat gradient whose views were all set to None is dropped
            # first, so the write-back check has no gradient to zero.)
            handle.grads.sync_flat_grad_from_orig()
            if handle.pre_unshard_for_forward():  # (a replaced parameter may have left no views)
                handle.grads.sync_flat_grad_from_orig()
    _buffers_for_eval(state)
    if state._forward_pending_backward:
        # The previous forward was never followed by a backward (e.g. an
        # evaluation forward with grad enabled).  Free what it kept: the shards
        # may change (optimizer step) before the next gather.
        finalize_units(state, free_all=True)
    elif not state._grad_buckets.idle:
        state._grad_buckets.finish()  # (left going by set_is_last_backward(False))
    if state.compute_device.type != "cpu":
        args, kwargs = to_device((args, kwargs), state.compute_device)
    return args, kwargs


def _buffers_for_eval(root: UnitState) -> None:
    """``FSDP_USE_FULL_PREC_IN_EVAL=1``: buffers in their original dtypes while the
    model is in ``eval()``, cast back to ``buffer_dtype`` once it trains again
    (torch decides on the root's unit, or on any unit if the root has none)."""
    if not root.settings.use_full_prec_in_eval:
        return  # (the flag is the same on every unit: checked at lazy init)
    handles = root._handles or root._all_handles
    full = any(h.computes_in_full_precision for h in handles)
    if full == root._buffers_in_full_precision:
        return
    for st in root._all_fsdp_states:
        if full:
            _init.restore_buffer_dtypes(st)
        else:
            _init.cast_buffers(st)
    root._buffers_in_full_precision = full


@L.labelled(L.PRE_FORWARD, unit_label)
def pre_forward(state: UnitState, inputs: Any = None) -> None:
    """Gather this unit's parameters (all its flat parameters) and expose them
    as unsharded views; ``inputs`` (the forward's arguments) tell when a
    frozen flat parameter's backward is over."""
    enter(state, TrainingState.FORWARD_BACKWARD)
    handles = state._handles
    if not handles:
        if state._explicit is not None:
            _forward_prefetch_listed(state)
        return
    root = state._root
    if torch.is_grad_enabled():
        register_handle_hooks(state)
    order = root._exec_order
    for handle in handles:
        handle.enter(HandleTrainingState.FORWARD)
        if order.order_check is not None and state.training:
            order.order_check.check(handle)
        order.record_pre_forward(handle)
    # No batching in a forward without grad (see fsdp_wrap.comm.gather_batch), nor
    # in a checkpointed forward recomputed in backward: the forward order's
    # next units are then the ones whose backward is already done.
    batch_bytes = (root._all_gather_batch_bytes
                   if torch.is_grad_enabled() and not in_backward() else 0)
    chain = functools.partial(_next_in_forward, root)
    gather_ahead(handles[0], batch_bytes, chain)
    for handle in handles:
        handle.finish_unshard(full_precision=handle.computes_in_full_precision)
    nxt = (order.next_in_forward(handles[-1])
           if state.settings.forward_prefetch or batch_bytes else None)
    if state._explicit is not None and _forward_prefetch_listed(state):
        pass  # (set_modules_to_forward_prefetch: these, and only these)
    elif nxt is not None and state.settings.forward_prefetch:
        _start_unit_gathers(root._state_of[nxt], batch_bytes, chain)
    elif nxt is not None:
        # The last unit of a batch computes: the next batch is gathered meanwhile
        # (only a batch: a unit alone still waits for its turn, as without
        # forward_prefetch), which holds no more than the batch cap ahead.
        gather_ahead(nxt, batch_bytes, chain, async_op=True)
    for handle in handles:
        handle.use_unsharded_views(track_graph=True)
    if torch.is_grad_enabled():
        note_inputs(state, inputs)


def _forward_prefetch_listed(state: UnitState) -> bool:
    """Start the gathers of the units ``set_modules_to_forward_prefetch`` listed
    for ``state``; whether it listed any (the default is then skipped).  Not
    without grad nor in a recomputation, where nothing would free a listed
    unit that then does not run (as for batches)."""
    units = state._explicit.forward_prefetch
    if units and torch.is_grad_enabled() and not in_backward():
        root = state._root
        chain = functools.partial(_next_in_forward, root)
        for unit in units:
            if unit._handles:
                _start_unit_gathers(unit, root._all_gather_batch_bytes, chain)
    return bool(units)


def _next_in_forward(root: UnitState, handle: FlatParamHandle) -> FlatParamHandle | None:
    """The flat parameter gathered after ``handle``'s: the next of its own unit,
    else the first of the unit after it in the recorded forward order."""
    siblings = root._state_of[handle]._handles
    i = siblings.index(handle)
    if i + 1 < len(siblings):
        return siblings[i + 1]
    return root._exec_order.next_in_forward(handle)


@L.labelled(L.FORWARD_PREFETCH, unit_label)
def _start_unit_gathers(state: UnitState, batch_bytes: int,
                        chain: Callable[[FlatParamHandle], FlatParamHandle | None]) -> None:
    """Start gathering every flat parameter of ``state`` (a prefetch: a batch
    stays in flight while the current unit computes)."""
    gather_ahead(state._handles[0], batch_bytes, chain, async_op=True)
    for h in state._handles:
        h.start_unshard(full_precision=h.computes_in_full_precision)


@L.labelled(L.POST_FORWARD, unit_label)
def post_forward(state: UnitState, output: Any) -> Any:
    """Reshard as the strategy says and hook the outputs for backward."""
    grad_enabled = torch.is_grad_enabled()
    for handle in state._handles:
        handle.enter(HandleTrainingState.IDLE)
        state._root._exec_order.record_post_forward(handle)
        if not grad_enabled or handle.frees_copy_after_forward:
            handle.reshard(free=True)
        elif explicit_controls.reshards_after_forward(state, handle):
            handle.reshard(free=True)
        elif handle.use_orig_params and handle.strategy not in KEEP_VIEWS_AFTER_FORWARD:
            # The root of FULL_SHARD / HYBRID_SHARD and every NO_SHARD unit keep
            # their unsharded data for backward, but show their original
            # parameters sharded, with their sharded gradients, until then, as
            # torch does (its pre-backward shows the unsharded ones again).
            handle.reshard(free=False)
    if grad_enabled:
        state._root._forward_pending_backward = True
        output = _register_pre_backward_hooks(state, output)
    enter(state, TrainingState.IDLE)
    return output


def _register_pre_backward_hooks(state: UnitState, output: Any) -> Any:
    hook = functools.partial(_pre_backward_hook, state)

    def register(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            t.register_hook(hook)
        return t

    return map_tensors(register, output, in_place_mappings=True)


# ---------------------------------------------------------------- backward


@L.labelled(L.PRE_BACKWARD, unit_label)
def _pre_backward_hook(state: UnitState, grad: torch.Tensor) -> torch.Tensor | None:
    """Runs when the gradient of one of the unit's outputs is ready.

    Idempotent within a backward: only the first output to arrive acts.
    Postcondition: the unit is unsharded with views that carry autograd
    history (activation checkpointing recomputes through them: the forward's
    where they still fit, else new ones), the next unit's gather is in
    flight under BACKWARD_PRE, and any old sharded gradient is parked.
    """
    _queue_final_callback(state._root)
    if state._ran_pre_backward:
        return None
    state._ran_pre_backward = True
    enter(state, TrainingState.FORWARD_BACKWARD)
    handles = state._handles
    if not handles:
        if state._explicit is not None:
            _backward_prefetch_listed(state)
        return None
    for handle in handles:
        if (handle.use_orig_params and handle.is_unsharded and handle.uses_sharded_strategy
                and not handle.reshard_after_forward):
            # Kept unsharded since forward: the views must be the forward's.
            handle.check_views_unchanged()
    nested_only = False
    for handle in handles:
        handle.enter(HandleTrainingState.BACKWARD_PRE)
        handle.grads.begin_backward()
        nested_only = nested_only or handle.grads.awaits_nested_parts
    if nested_only:
        watch_unit_end(state, _reduce_pending)
    root = state._root
    explicit = state._explicit
    # (backward order: the unit's flat parameters last to first, then the unit before)
    # (in backward a batch's members copy their parts out each at its own turn
    # where that holds less than all at once: see gather_batch.by_member_pays)
    if explicit_controls.unshards_in_backward(state):
        gather_ahead(handles[-1], root._all_gather_batch_bytes,
                     functools.partial(_next_backward_pending, root), each_at_its_turn=True)
    for handle in handles:
        if not handle.is_unsharded and not explicit_controls.unshards_in_backward(state):
            continue  # (set_unshard_in_backward(False): its backward reads no parameter)
        handle.finish_unshard(full_precision=handle.computes_in_full_precision)
        # Hooks run with grad disabled; reentrant activation checkpointing
        # recomputes the forward through these views and needs them tracked:
        # the forward's where they still fit, else new ones.
        if not handle.forward_views_reusable():
            with torch.enable_grad():
                handle.use_unsharded_views()
    if explicit is not None and _backward_prefetch_listed(state):
        pass  # (set_modules_to_backward_prefetch: these, and only these)
    elif state.settings.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch_backward(state)
    for handle in handles:
        handle.grads.prepare_gradient_for_backward()
    return None


def make_post_backward_hook(state: UnitState, handle: FlatParamHandle) -> Callable[[torch.Tensor], None]:
    """The hook on ``handle``'s flat parameter; it holds the unit and the handle
    weakly.

    The flat parameter's Python object is kept alive from C++ while its views
    (the module's parameters) exist, and Python's garbage collector does not
    look inside a tensor held from C++: a strong reference from its hooks to
    the unit would close a cycle the collector cannot see, and a dropped model
    would keep every unit and its memory for the life of the process.
    """
    state_ref, handle_ref = weakref.ref(state), weakref.ref(handle)

    def post_backward(flat_param: torch.Tensor) -> None:
        """Runs after autograd accumulated this unit's unsharded gradient.

        Postcondition: the unit is resharded (freed unless SHARD_GRAD_OP under
        ``no_sync``), and ``flat_param.grad`` is the mean sharded gradient, or
        the local unsharded one under ``no_sync``.
        """
        state, handle = state_ref(), handle_ref()
        if state is None or handle is None:
            return  # (the model is gone; a gradient computed after that is the caller's)
        handle.enter(HandleTrainingState.BACKWARD_POST)
        if handle.grads.is_partial():
            # A reentrant checkpoint's backward inside the unit's: the rest
            # of the gradient may still come (torch's FSDP1 reshards here, and
            # the outer backward or the next checkpoint's recomputation then
            # reads freed parameters).
            handle.grads.note_nested_part()
            return
        if L.profiler_enabled():
            with L.span(L.POST_BACKWARD, unit_label(state)):
                _reduce_unit(state, handle)
            return
        _reduce_unit(state, handle)

    return post_backward


def _reduce_unit(state: UnitState, handle: FlatParamHandle, prefetch: bool = True) -> None:
    """``handle``'s gradient is complete: reshard, reduce (and, with
    optimizers in backward, step).  ``prefetch=False`` at the end of backward
    (no unit's backward is to come)."""
    handle.grads.reduce_pending = False  # (whoever reduces first: once)
    _queue_final_callback(state._root)
    sync = state._sync_gradients
    handle.reshard(free=frees_after_backward(state, handle))
    if (prefetch and state.settings.backward_prefetch is BackwardPrefetch.BACKWARD_POST
            and (state._explicit is None or not state._explicit.backward_prefetch)):
        _prefetch_backward(state)
    if sync and state._optims_in_backward:
        # The optimizers step right after this unit's own reduction: alone.
        state._root._grad_buckets.reduce(handle.grads, sync, alone=True)
        _step_optimizers_in_backward(handle)
    else:
        state._root._grad_buckets.reduce(handle.grads, sync)


def _reduce_pending(state: UnitState) -> None:
    for handle in state._handles:
        if handle.grads.reduce_pending:
            _reduce_unit(state, handle)


def _step_optimizers_in_backward(handle: FlatParamHandle) -> None:
    """``_apply_optimizer_in_backward`` (``use_orig_params=True``): step each
    original parameter's optimizers on its reduced sharded gradient now, then
    free that gradient, as torch does after the reduce-scatter."""
    for param in handle.params:
        optims = getattr(param, "_in_backward_optimizers", None)
        if param.grad is None or not optims:
            continue  # (no gradient: not in this rank's shard, or unused)
        for optim in optims:
            optim.step()
        for optim in optims:
            optim.zero_grad(set_to_none=True)
    handle.grads.sync_flat_grad_from_orig()  # drops the flat gradient once no view is left


def make_early_free_hook(state: UnitState, handle: FlatParamHandle) -> Callable[[], None]:
    def free_early() -> None:
        """All of this unit's parameter gradients are computed: its gathered
        parameters are no longer needed (unless SHARD_GRAD_OP keeps them under
        ``no_sync``)."""
        if frees_after_backward(state, handle):
            handle.free_unsharded_storage()

    return free_early


def _next_backward_pending(root: UnitState, handle: FlatParamHandle) -> FlatParamHandle | None:
    """The flat parameter whose backward comes after ``handle``'s (the one before
    it in its unit, else the unit before), unless that other unit's backward
    already began."""
    nxt = root._exec_order.next_in_backward(handle)
    if nxt is None:
        return None
    unit = root._state_of[nxt]
    if unit is not root._state_of[handle] and (unit._ran_pre_backward
                                               or not explicit_controls.unshards_in_backward(unit)):
        return None
    return nxt


def _backward_prefetch_listed(state: UnitState) -> bool:
    """Start the gathers of the units ``set_modules_to_backward_prefetch``
    listed for ``state`` (not one whose backward began); whether it listed any."""
    units = state._explicit.backward_prefetch
    for unit in units:
        if unit._handles and not unit._ran_pre_backward and explicit_controls.unshards_in_backward(unit):
            start_backward_gathers(unit)
    return bool(units)


def _prefetch_backward(state: UnitState) -> None:
    """Start gathering the unit whose backward comes next, if it has not begun."""
    root = state._root
    nxt = _next_backward_pending(root, state._handles[0])
    if nxt is not None:
        start_backward_gathers(root._state_of[nxt])


@L.labelled(L.BACKWARD_PREFETCH, unit_label)
def start_backward_gathers(unit: UnitState) -> None:
    """Start gathering every flat parameter of ``unit`` for its backward (a
    prefetch: a batch stays in flight while the current unit's backward computes)."""
    root = unit._root
    gather_ahead(unit._handles[-1], root._all_gather_batch_bytes,
                 functools.partial(_next_backward_pending, root), async_op=True,
                 each_at_its_turn=True)
    for h in unit._handles:
        h.start_unshard(full_precision=h.computes_in_full_precision)


def _queue_final_callback(root: UnitState) -> None:
    if not root._final_callback_queued:
        root._final_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_final_callback, root))


@L.labelled(L.ROOT_POST_BACKWARD)
def _final_callback(root: UnitState) -> None:
    """End of backward: every unit resharded, every state IDLE."""
    finalize_units(root, free_all=False)


def finalize_units(root: UnitState, free_all: bool) -> None:
    """Reduce what the gradient buckets hold, reshard every unit and return
    every state to IDLE.

    SHARD_GRAD_OP units stay gathered under ``no_sync`` (the next micro-batch
    reuses them) unless ``free_all``.  A gradient parked by a pre-backward hook
    whose unit then got no gradient is put back.
    """
    if not free_all:
        # Gradients that came from reentrant checkpoints' backwards only and
        # whose unit's end no input marked: complete now.
        for state in root._all_fsdp_states:
            for handle in state._handles:
                if handle.grads.reduce_pending:
                    _reduce_unit(state, handle, prefetch=False)
    # First: until a bucket is reduced its units' flat_param.grad is None,
    # which restore_parked_grad below would take for "no gradient this step".
    # (Not the last backward: reductions feeding partial sums only may go on.)
    if free_all or root._is_last_backward:
        root._grad_buckets.finish()
    else:
        root._grad_buckets.finish(wait_partial=False)
    if not free_all:
        for handle in root._all_handles:
            handle.grads.flush_partial()  # (all-reduced, though unused this backward)
    for state in root._all_fsdp_states:
        for handle in state._handles:
            keep = not free_all and not frees_after_backward(state, handle)
            if handle.is_unsharded or handle.holds_unsharded_storage:
                handle.reshard(free=not keep)
            handle.grads.restore_parked_grad()
            handle.grads.end_backward()
            handle.enter(HandleTrainingState.IDLE)
            if not free_all:
                # End of a backward: every graph of the iteration is done.  A
                # forward still awaiting its backward (several forwards before
                # one backward) keeps its count, so nothing is freed early.
                handle.views.forget_graphs()
        if not free_all:
            state._frozen_open_graphs = 0
        state._ran_pre_backward = False
        enter(state, TrainingState.IDLE)
    root._final_callback_queued = False
    root._forward_pending_backward = False
    root._exec_order.next_iteration()
    if not free_all and root._exec_order.order_check is not None:
        root._exec_order.order_check.end_of_iteration()
