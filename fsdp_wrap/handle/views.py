"""The views part of a :class:`~fsdp_wrap.handle.flat_param.FlatParamHandle`.

Owned by the handle (``handle.views``): how the original parameters are
exposed to the modules around a unit's compute (views of the unsharded flat
parameter, with autograd history; kept from one forward to the next where
NO_SHARD allows), how they go back to their between-steps form (the original
``Parameter`` objects viewing the local shard, or the flat parameter
registered), and the forward graphs whose parameter gradients are still to
come (the early free).  *When* the handle gathers and frees lives in the
handle; this part says what the modules see.  Its fixed inputs (the unit's
modules and parameters, the layout) are given at construction, the changing
ones (the flat parameter's data, whether the unsharded data is a copy) with
each call.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn as nn

from fsdp_wrap.handle.dtensor import as_dtensor
from fsdp_wrap.handle.flat_tensor import FLAT_PARAM_NAME, same_storage
from fsdp_wrap.handle.layout import FlatLayout, ParamInfo, SharedParamInfo


class ParamViews:
    """Original-parameter views of one flat parameter."""

    def __init__(
        self,
        module: nn.Module,
        infos: list[ParamInfo],
        shared: list[SharedParamInfo],
        layout: FlatLayout,
        shard_slices: list[tuple[int, int] | None],
        *,
        use_orig_params: bool,
        sharded: bool,
        flat_name: str = FLAT_PARAM_NAME,
    ) -> None:
        self.flat_name = flat_name  # registered under this name on ``module``
        self.module = module  # the unit's wrapped module (holds the flat parameter)
        self.infos, self.shared = infos, shared
        self._segments = list(layout.segments)
        # Per original parameter: its piece of the split, and the shape to view
        # it as (``None`` for 1-D parameters: the piece already has that shape,
        # and a view more per step and parameter is host time on every step).
        self._pieces = [(seg, info.shape if len(info.shape) != 1 else None)
                        for info, seg in zip(infos, layout.info_segment)]
        self._shard_slices = shard_slices
        # DTensor parameters (handle/dtensor.py): index -> spec, only those.
        self._specs = {i: info.spec for i, info in enumerate(infos) if info.spec is not None}
        self.use_orig_params = use_orig_params
        self.uses_sharded_strategy = sharded
        # Swapping views calls a module's own __setattr__/__delattr__ override,
        # as torch does, unless FSDP_USE_UNSAFE_SETATTR=1.
        self._safe_setattr = os.environ.get("FSDP_USE_UNSAFE_SETATTR", "") != "1"
        # Whether every module holding a parameter takes plain dict writes (no
        # class overrides __setattr__/__delattr__): then the per-step view swaps
        # skip the per-module check.
        self._plain_modules = not self._safe_setattr or not any(
            _overrides_setattr(m) for m in [i.module for i in infos] + [sh.module for sh in shared]
        )
        # The forward's views of the original parameters (checked before backward).
        self.compute_views: list[torch.Tensor] = []
        self._views_have_history = False
        # NO_SHARD: the views of one forward, kept for the next (see _reusable_views).
        self._kept_views: tuple[tuple[object, ...], list[torch.Tensor]] | None = None
        # use_orig_params=False: the originals are registered (summon, state dicts).
        self.params_registered = False
        # Forward graphs whose parameter-view gradients are still to come, and
        # what to do once the last arrives (set by the runtime).
        self._open_graphs = 0
        self.on_view_grads_ready: Callable[[], None] | None = None
        # Whether this thread runs a backward nested in the unit's own (set by
        # the runtime with on_view_grads_ready; see _view_grads_ready).
        self.in_nested_backward: Callable[[], bool] | None = None
        self._stale_views: list[torch.Tensor] = []
        self.shown: list[nn.Parameter] = []  # what register_params registered last
        # use_orig_params=True: where use_sharded_views last put each original
        # parameter (see _registered_as_before).
        self._registered: tuple[int, torch.dtype, list[tuple[Any, ...]]] | None = None

    def release_originals(self, device: torch.device) -> None:
        """At construction, once the flat parameter holds the data: the original
        parameters keep no storage (and no gradient), and without
        ``use_orig_params`` they leave their modules (the flat parameter
        takes their place)."""
        for info in self.infos:
            info.param.data = torch.empty(0, dtype=info.param.dtype, device=device)
            info.param.grad = None
        if not self.use_orig_params:
            for info in self.infos:
                info.module._parameters.pop(info.name, None)
            for shared in self.shared:
                shared.module._parameters.pop(shared.name, None)

    def install_stale(self, flat: torch.Tensor) -> None:
        """``module.weight`` resolves from construction on, as in torch.

        With ``use_orig_params=False`` the original names are plain tensor
        views into the unsharded flat parameter; between unshards they point at
        freed storage (shape only), so ``repr(module)`` and attribute checks
        work before the first forward.
        """
        self._stale_views = self._outward(self._split(flat.detach()))
        self._install_views(self._stale_views)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The original parameters' views of ``flat``."""
        return self._views_of(flat.split_with_sizes(self._segments))

    def _views_of(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The original parameters' views of a split's pieces (a view more only
        for parameters of more than one dimension)."""
        return [pieces[seg] if shape is None else pieces[seg].view(shape)
                for seg, shape in self._pieces]

    def _outward(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The views as the modules see them: DTensor parameters as DTensors again."""
        for i, spec in self._specs.items():
            views[i] = as_dtensor(views[i], spec)
        return views

    def _install_views(self, tensors: Sequence[torch.Tensor]) -> None:
        for info, view in zip(self.infos, tensors):
            info.module.__dict__[info.name] = view
        for shared in self.shared:
            shared.module.__dict__[shared.name] = tensors[shared.index]

    def forget_kept(self) -> None:
        """Drop kept views (they view data that is being replaced)."""
        self._kept_views = None

    def use_unsharded_views(
        self,
        flat_param: nn.Parameter,
        needs_copy: bool,
        as_params: bool = False,
        source: torch.Tensor | None = None,
        track_graph: bool = False,
    ) -> None:
        """Expose each original parameter as a view into the unsharded data.

        For compute (``as_params=False``) the views are made from
        ``flat_param`` under the caller's grad mode, so autograd routes their
        gradients into ``flat_param.grad``.  Frozen parameters get detached
        views so no gradient is computed for them.  For state dicts and
        ``summon_full_params`` (``as_params=True``) the original ``Parameter``
        objects are registered again, with their full shapes, in place of the
        flat parameter; ``reshard`` undoes that.
        """
        if as_params:
            flat = flat_param.detach() if source is None else source
            self.register_params(self._split(flat), flat_param)
            return
        orig = self.use_orig_params
        tensors = self._reusable_views(flat_param, needs_copy)
        if tensors is None:
            pieces = flat_param.split_with_sizes(self._segments)
            if track_graph:
                self._track_graph(pieces[0].grad_fn)
            tensors = self._views_of(pieces)
            if self._specs:
                tensors = self._outward(tensors)
            if orig:
                for i, info in enumerate(self.infos):
                    if not info.param.requires_grad:
                        # (without, views follow flat_param's requires_grad)
                        tensors[i] = tensors[i].detach()
            self._keep_views(tensors, flat_param, needs_copy)
        self._install_compute_views(tensors)
        self._views_have_history = torch.is_grad_enabled()

    def _install_compute_views(self, tensors: list[torch.Tensor]) -> None:
        orig, plain = self.use_orig_params, self._plain_modules
        for info, view in zip(self.infos, tensors):
            if not plain:
                self._set_tensor(info.module, info.name, view)
            elif orig:  # (the writes _set_tensor makes, inlined: this runs every step)
                info.module.__dict__.pop(info.name, None)
                info.module._parameters[info.name] = view  # type: ignore[assignment]
            else:
                info.module.__dict__[info.name] = view
        self.compute_views = tensors
        for shared in self.shared:
            self._set_tensor(shared.module, shared.name, tensors[shared.index])

    def _view_key(self, flat: nn.Parameter, needs_copy: bool) -> tuple[object, ...] | None:
        """What kept views depend on, or ``None`` where views are never kept:
        only where the unsharded data is the flat parameter itself (NO_SHARD
        with no cast or move), and only views with autograd history."""
        if needs_copy or not torch.is_grad_enabled():  # (always true when sharded)
            return None
        frozen = tuple(not i.param.requires_grad for i in self.infos) if self.use_orig_params else ()
        # (_version: autograd refuses split views whose base was written in place
        # since, e.g. by an optimizer stepping on the flat parameter itself)
        return (flat.data_ptr(), flat.dtype, flat.requires_grad, flat._version, frozen)

    def _reusable_views(self, flat: nn.Parameter, needs_copy: bool) -> list[torch.Tensor] | None:
        """The views kept from an earlier forward, if still exactly right.

        NO_SHARD's unsharded data never moves, so one set of views (the split
        and view nodes they carry save no tensors: autograd may run them in
        any number of backwards) serves every forward until the flat
        parameter's data, dtype, ``requires_grad`` or version (an in-place
        write) change or, with ``use_orig_params``, which parameters are
        frozen.  With ``use_orig_params`` the optimizer steps on the original
        parameters (their own version counters), so the views last; without,
        it writes the flat parameter and every forward makes new ones.  Views
        someone hooked (``register_hook``, ``retain_grad``) are never reused,
        so per-step hooks do not pile up.
        """
        kept = self._kept_views
        if kept is None or kept[0] != self._view_key(flat, needs_copy):
            return None
        for view in kept[1]:
            # A hook or retain_grad() put on a view during a step would carry
            # over to the next one: such views are not reused.
            if view._backward_hooks or view.retains_grad:
                self._kept_views = None
                return None
        return kept[1]

    def _keep_views(self, tensors: list[torch.Tensor], flat: nn.Parameter, needs_copy: bool) -> None:
        key = self._view_key(flat, needs_copy)
        if key is not None:  # (views of a no-grad forward leave the kept ones alone)
            self._kept_views = (key, tensors)

    def forward_views_reusable(self, flat_param: nn.Parameter, needs_copy: bool,
                               unsharded: bool) -> bool:
        """Whether backward may keep the forward's views instead of making new
        ones (putting them back where the modules no longer hold them).

        Only for views made with autograd history (a recomputation inside
        backward then routes its gradients through them), and only where they
        view the data backward computes on: the flat parameter itself
        (NO_SHARD), which every module must still hold, or gathered, cast or
        moved data, which is freed after forward and made again in the same
        storage (autograd's saved views see it again) and which views nobody
        hooked are then put back into.  On the sharded strategies the early
        free watches these views' split node: a reentrant checkpoint's
        recomputation running through them runs that node in its own nested
        backward, which :meth:`_view_grads_ready` ignores.
        """
        views = self.compute_views
        if not self._views_have_history or not views or not unsharded:
            return False
        if needs_copy:
            if not same_storage(views[0], flat_param):
                return False  # (e.g. the full-precision copy of an eval-mode backward)
            trains, orig = flat_param.requires_grad, self.use_orig_params
            for info, view in zip(self.infos, views):
                if (view._backward_hooks or view.retains_grad or view.requires_grad
                        != (trains and (not orig or info.param.requires_grad))):
                    return False  # (hooked, or frozen / unfrozen since forward)
            self._install_compute_views(views)
            return True
        orig = self.use_orig_params
        for info, view in zip(self.infos, self.compute_views):
            held = info.module._parameters if orig else info.module.__dict__
            if held.get(info.name) is not view:
                return False
        for shared in self.shared:
            held = shared.module._parameters if orig else shared.module.__dict__
            if held.get(shared.name) is not self.compute_views[shared.index]:
                return False
        return True

    def _track_graph(self, split_node: Any) -> None:
        """Watch the node that splits ``flat_param`` into this forward's views.

        Autograd runs it once every view's gradient is ready, i.e. after the
        last backward op that used the unsharded parameters.  From then on the
        gathered storage is dead, although the post-backward hook (after the
        gradient concat and AccumulateGrad) is still to come: freeing it here
        lowers the backward peak by one unit.
        """
        if split_node is None or self.on_view_grads_ready is None:
            return
        self._open_graphs += 1
        # Weakly: the node is held from C++ (by the views' own grad_fns, which
        # this object keeps in compute_views), where the garbage collector
        # cannot see a cycle back to this object, its handle and its unit.
        this = weakref.ref(self)

        def ready(grad_outputs: Any) -> None:
            views = this()
            if views is not None:
                views._view_grads_ready(grad_outputs)

        split_node.register_prehook(ready)

    def _view_grads_ready(self, grad_outputs: Any) -> None:
        if self.in_nested_backward is not None and self.in_nested_backward():
            # A reentrant checkpoint inside the unit recomputed through the
            # forward's views: its backward runs their split node too, but the
            # outer backward (or the next checkpoint) still needs the data.
            return
        self._open_graphs -= 1
        if self._open_graphs == 0 and self.on_view_grads_ready is not None:
            self.on_view_grads_ready()

    def forget_graphs(self) -> None:
        """Graphs of this iteration are done (or were dropped without backward)."""
        self._open_graphs = 0

    def _set_tensor(self, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        # Then plain dict writes: cheaper than nn.Module.__setattr__ every step.
        self._call_setattr_override(module, name, tensor)
        if self.use_orig_params:
            module.__dict__.pop(name, None)
            module._parameters[name] = tensor  # type: ignore[assignment]
        else:
            module.__dict__[name] = tensor

    def _set_param(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        self._call_setattr_override(module, name, param)
        module.__dict__.pop(name, None)
        module._parameters[name] = param

    def _call_setattr_override(self, module: nn.Module, name: str, value: torch.Tensor) -> None:
        """Let a module class that overrides ``__setattr__``/``__delattr__`` see
        the swap, as torch's default does (delattr, then setattr); the caller
        then puts ``value`` where this handle keeps it.  Modules without an
        override take only the plain dict writes (same result, no cost)."""
        if not self._safe_setattr or not _overrides_setattr(module):
            return
        if hasattr(module, name):
            delattr(module, name)
        setattr(module, name, value)

    def use_sharded_views(self, flat_param: nn.Parameter, local_shard: torch.Tensor) -> None:
        """Return the module to its between-steps form.

        ``use_orig_params=True``: the original parameters are registered and
        are views of the local shard (1-D pieces; full shapes under NO_SHARD).
        ``use_orig_params=False``: the flat parameter is registered; the
        original names keep their last unsharded views (stale, as in torch).
        """
        if not self.use_orig_params:
            if self.params_registered:
                for info in self.infos:
                    info.module._parameters.pop(info.name, None)
                    info.param.data = info.param.data.new_empty(0)
                for shared in self.shared:
                    shared.module._parameters.pop(shared.name, None)
                self.module._parameters[self.flat_name] = flat_param
                self._install_views(self._stale_views)
                self.params_registered = False
            return
        self.params_registered = False
        shard = local_shard
        base, itemsize = shard.data_ptr(), shard.element_size()
        plain = self._plain_modules
        if plain and self._registered_as_before(base, shard.dtype):
            return
        for info, sl in zip(self.infos, self._shard_slices):
            param = info.param
            if not self.uses_sharded_strategy:
                lo, hi, shape = info.offset, info.offset + info.numel, info.shape
            elif sl is not None:
                lo, hi = sl
                shape = torch.Size((hi - lo,))
            else:
                lo, hi, shape = 0, 0, torch.Size((0,))
            # Most steps the parameter still views exactly this piece: no new view.
            if (param.data_ptr() != base + lo * itemsize or param.shape != shape
                    or param.dtype != shard.dtype or not param.is_contiguous()):
                param.data = shard[lo:hi].view(shape)
            if plain:  # (_set_param's writes, inlined: this runs every step)
                info.module.__dict__.pop(info.name, None)
                info.module._parameters[info.name] = param
            else:
                self._set_param(info.module, info.name, param)
        for shared in self.shared:
            self._set_param(shared.module, shared.name, self.infos[shared.index].param)
        if plain:
            self._registered = (base, shard.dtype, [
                (info.module._parameters, info.name, info.param, info.param.data_ptr(),
                 info.param.shape) for info in self.infos])

    def _registered_as_before(self, base: int, dtype: torch.dtype) -> bool:
        """Register the original parameters again where each still views the
        same piece of the same shard as when :meth:`use_sharded_views` last
        placed them (the common case: the swap back after every forward and
        backward), with fewer checks per parameter than the full path;
        ``False`` (nothing written) where anything moved.

        A parameter whose data was replaced since (``param.data = ...``) has
        another address or shape, and ``info.param`` is another object once
        the write-back took up a replaced Parameter.  Checks and writes go
        together: where a later parameter moved, the caller's full path
        registers every one of them again, those already written included.
        """
        last = self._registered
        if last is None or last[0] != base or last[1] != dtype or self.shared:
            return False
        for info, (params, name, param, ptr, shape) in zip(self.infos, last[2]):
            if (info.param is not param or param.data_ptr() != ptr or param.shape != shape
                    or param.dtype != dtype or not param.is_contiguous()):
                self._registered = None
                return False  # (the full path then registers every parameter again)
            params[name] = param
        return True

    def register_params(self, tensors: Sequence[torch.Tensor], flat_param: nn.Parameter) -> None:
        """Register the original parameters with ``tensors`` as their data.

        Undone by :meth:`use_sharded_views`.  With ``use_orig_params=False``
        they take the flat parameter's ``requires_grad`` (frozen after
        wrapping or not), as torch's fresh Parameters do.
        """
        shown: list[nn.Parameter] = []
        for i, (info, t) in enumerate(zip(self.infos, tensors)):
            spec = self._specs.get(i)
            if spec is not None:
                # A DTensor cannot be a Parameter's ``.data``: a new Parameter
                # (torch registers one too); ``info.param`` stays the local one.
                trains = info.param.requires_grad if self.use_orig_params else \
                    flat_param.requires_grad
                param = nn.Parameter(as_dtensor(t, spec), requires_grad=trains)
            else:
                param = info.param
                param.data = t
                if not self.use_orig_params:
                    param.requires_grad_(flat_param.requires_grad)
            self._set_param(info.module, info.name, param)
            shown.append(param)
        for shared in self.shared:
            self._set_param(shared.module, shared.name, shown[shared.index])
        self.module._parameters.pop(self.flat_name, None)
        self.params_registered = True
        self.shown = shown

    def show_dtensor_grads(self) -> None:
        """With the originals registered (:meth:`register_params`), the DTensor
        ones' ``.grad``: their local parameters' gradients, as DTensors (views)."""
        for i, spec in self._specs.items():
            grad = self.infos[i].param.grad
            self.shown[i].grad = None if grad is None else as_dtensor(grad, spec)


def _overrides_setattr(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__setattr__ is not nn.Module.__setattr__ or cls.__delattr__ is not nn.Module.__delattr__
