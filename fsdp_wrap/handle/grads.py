"""The gradient part of a :class:`~fsdp_wrap.handle.flat_param.FlatParamHandle`.

Owned by the handle (``handle.grads``): parking a reduced gradient while a new
one accumulates, taking the local gradient for reduction, installing the
reduced one, and the original parameters' ``.grad`` views.  *How* a gradient
is reduced lives in :mod:`fsdp_wrap.comm.reduce` (one unit) and
:mod:`fsdp_wrap.comm.bucket` (several units in one collective); this part says
what the unit holds before and after.  Its inputs are explicit: the flat
parameter (one object for the handle's life), the layout, and the dtypes and
devices the handle resolved (:meth:`FlatGrads.retype` when they change).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.comm.labels as L
import fsdp_wrap.comm.reduce as R
from fsdp_wrap._compat import backward_will_accumulate, current_backward
from fsdp_wrap.handle.layout import FlatLayout, ParamInfo


class FlatGrads:
    """Gradient bookkeeping of one flat parameter."""

    def __init__(
        self,
        flat_param: torch.nn.Parameter,
        infos: list[ParamInfo],
        layout: FlatLayout,
        shard_slices: list[tuple[int, int] | None],
        reduce_spec: R.ReduceSpec,
        *,
        use_orig_params: bool,
        device: torch.device,
        to_shard_device: Callable[[torch.Tensor], torch.Tensor],
        shard_device: torch.device,
        dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
        keep_low_precision_grads: bool,
        shard_offset: int = 0,
    ) -> None:
        self.flat_param = flat_param
        self.unit_name = ""  # the unit's clean FQN (its handle's ``unit_fqn``; profiler labels)
        self.infos = infos
        self.layout = layout
        self._shard_slices = shard_slices
        self.reduce_spec = reduce_spec
        self.use_orig_params = use_orig_params
        self.uses_sharded_strategy = reduce_spec.sharded
        self.device = device
        self.shard_device = shard_device
        self._to_shard_device = to_shard_device
        self.orig_dtype, self.compute_dtype, self.reduce_dtype = dtypes
        self.keep_low_precision_grads = keep_low_precision_grads
        self._shard_offset = shard_offset  # where the local shard starts in the flat parameter
        # ``(state, hook)`` from register_comm_hook: replaces the reduction.
        self.comm_hook: tuple[object, Callable[..., Any]] | None = None
        # A sharded gradient parked while a new unsharded one accumulates, and
        # whether .grad holds an unreduced (no_sync) gradient.
        self._saved_grad_shard: torch.Tensor | None = None
        self.has_unreduced_grad = False
        # Sharded accumulation (``set_requires_all_reduce(False)``, hybrid
        # strategies): each backward's gradient is reduced over the shard group
        # only and added to ``_partial``, a float32 shard; the replicas'
        # all-reduce waits until it is required again.
        self.requires_all_reduce = True
        self._partial: torch.Tensor | None = None
        # (set_grad_views: the split of a sharded gradient, for its numel)
        self._shard_split_cache: tuple[int, list[int], list[int]] | None = None
        # The backward that began the unit's backward (an id, see is_partial),
        # whether that backward accumulates into flat_param itself, and whether
        # a part arrived from a nested backward it will not follow up
        # (reduce_pending: reduced once the unit's backward is over).
        self._began_in: int | None = None
        self._began_accumulates: bool | None = False  # (None: torch cannot say)
        self.reduce_pending = False

    def retype(self, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
               reduce_spec: R.ReduceSpec) -> None:
        """The handle's (original, compute, reduce) dtypes changed (adopted data)."""
        self.orig_dtype, self.compute_dtype, self.reduce_dtype = dtypes
        self.reduce_spec = reduce_spec

    def prepare_gradient_for_backward(self) -> None:
        """Park an existing reduced gradient so a fresh local one can accumulate.

        The parked gradient is added back after this backward's reduction, so
        accumulation without ``zero_grad`` sums the per-iteration means.  An
        unreduced (``no_sync``) gradient is left in place: autograd adds the new
        local gradient to it and the next synced reduction takes both.  So is a
        NO_SHARD gradient that needs no cast or move (the old mean is reduced
        again with the new gradient, as torch does).
        """
        if self.use_orig_params:
            self.sync_flat_grad_from_orig()
        grad = self.flat_param.grad
        if (
            grad is not None
            and not self.uses_sharded_strategy
            and grad.device == self.device
            and grad.dtype == self.compute_dtype == self.reduce_dtype
        ):
            # NO_SHARD without casts or offload: autograd adds the new gradient
            # to the old one and the reduction takes the sum, torch's order of
            # additions (parking the old gradient and adding it back after the
            # reduction rounds differently, visibly at world size 1).
            return
        if grad is not None and not self.has_unreduced_grad:
            self._saved_grad_shard = grad.detach()
            self.flat_param.grad = None

    def begin_backward(self) -> None:
        """The unit's backward begins (its pre-backward hook, in the backward
        that reaches the unit's outputs): note that backward, and whether it
        will itself accumulate into the flat parameter (it does where the
        forward's parameter views are used outside any reentrant activation
        checkpoint).  Undone by :meth:`end_backward`."""
        if not self.flat_param.requires_grad:
            self._began_in = None
            return
        self._began_in = current_backward()
        self._began_accumulates = backward_will_accumulate(self.flat_param)

    def end_backward(self) -> None:
        self._began_in = None
        self.reduce_pending = False

    @property
    def awaits_nested_parts(self) -> bool:
        """Whether the unit's gradient can only come from nested backwards:
        its backward began in one that does not accumulate into the flat
        parameter (every use of the parameters lies inside reentrant
        activation checkpoints, one or several)."""
        return self._began_in is not None and self._began_accumulates is False

    def is_partial(self) -> bool:
        """Whether this thread runs a backward other than the one that began
        the unit's: a reentrant activation checkpoint inside the unit running
        its recomputation's backward (nested, with an id of its own).  A
        gradient accumulated there is a part only: the outer backward's own
        part, or another checkpoint's, may follow."""
        began = self._began_in
        return began is not None and current_backward() != began

    def note_nested_part(self) -> None:
        """A part of the gradient arrived in a nested backward: if the outer
        backward will not accumulate the rest itself (and reduce it then),
        or torch cannot say, the reduction waits for the unit's backward to
        end (its inputs' gradients, else the end of backward)."""
        if not self._began_accumulates:
            self.reduce_pending = True

    def restore_parked_grad(self) -> None:
        """A parked gradient whose unit got no new gradient goes back."""
        if self._saved_grad_shard is not None and self.flat_param.grad is None:
            _assign_grad(self.flat_param, self._saved_grad_shard)
            self._saved_grad_shard = None
            if self.use_orig_params:
                self.set_grad_views()

    def sync_flat_grad_from_orig(self) -> None:
        """Honour ``zero_grad(set_to_none=True)`` done on the original params.

        Their gradients are views of the flat gradient, which stays alive until
        dropped here; the root calls this before every forward so the memory is
        free for the forward (as torch does).
        """
        if self.has_unreduced_grad or self.flat_param.grad is None:
            return
        if all(info.param.grad is None for info in self.infos):
            self.flat_param.grad = None

    def reduce_gradient(self, sync: bool) -> None:
        """Turn the local unsharded gradient on ``flat_param`` into the mean sharded one.

        Called from the post-backward hook after ``reshard`` when this unit is
        reduced on its own (see :mod:`fsdp_wrap.comm.bucket` for several at once).
        Sharded strategies reduce-scatter over the shard group; NO_SHARD
        all-reduces; hybrid strategies then all-reduce the shard over the
        replicate group.  With ``sync=False`` (``no_sync``) the local gradient
        is kept for later.
        """
        grad = self.take_grad_for_reduction(sync)
        if grad is None:
            return
        if self.comm_hook is not None:
            self.install_reduced_grad(R.reduce_with_hook(grad, self.reduce_spec, *self.comm_hook))
        else:
            self.reduce_taken(grad)

    def reduce_taken(self, grad: torch.Tensor) -> None:
        """Reduce ``grad`` (taken by :meth:`take_grad_for_reduction`) on its own
        and install the result (or, accumulating, add it to the partial sum)."""
        spec = self.reduce_spec
        if self.accumulating:
            self.install_reduced_grad(R.reduce_default(grad, spec, replicas=False),
                                      release_input=True)
        elif self._partial is not None:
            partial = self._take_partial(R.reduce_default(grad, spec, replicas=False))
            self.install_reduced_grad(R.sum_over_replicas(partial, spec), release_input=True)
        else:
            self.install_reduced_grad(R.reduce_default(grad, spec), release_input=True)

    # ------------------------------------------------ sharded accumulation

    @property
    def accumulating(self) -> bool:
        """Whether reductions stop at the shard group and add up in ``_partial``
        (``set_requires_all_reduce(False)`` on a hybrid unit)."""
        return not self.requires_all_reduce and self.reduce_spec.replicate_group is not None

    @property
    def holds_partial(self) -> bool:
        """Whether micro-batches' gradients wait for the replicas' all-reduce."""
        return self._partial is not None

    def _add_partial(self, shard: torch.Tensor) -> None:
        """``_partial += shard`` (the shard group's mean part of one backward).

        In float32 (or the reduce dtype, if wider): the sum of many
        micro-batches in a low ``reduce_dtype`` would round at every addition.
        """
        if self._partial is None:
            dtype = torch.promote_types(shard.dtype, torch.float32)
            self._partial = torch.empty(shard.numel(), dtype=dtype, device=shard.device)
            self._partial.copy_(shard)
        else:
            self._partial.add_(shard)

    def _take_partial(self, shard: torch.Tensor | None) -> torch.Tensor:
        """The partial sum (plus ``shard``, this backward's part), handed over."""
        partial = self._partial
        if partial is None:
            raise RuntimeError("FSDP internal: no partial gradient sum to take")
        self._partial = None
        return partial if shard is None else partial.add_(shard)

    def flush_partial(self) -> None:
        """At the end of a backward that requires the all-reduce: a partial sum
        that got no gradient in it (the unit was unused) is all-reduced and
        installed all the same, so no micro-batch is lost."""
        if self._partial is not None and not self.accumulating:
            label = (L.span(L.POST_BACKWARD_REDUCE, L.names((self.unit_name,)))
                     if L.profiler_enabled() else contextlib.nullcontext())
            with label:
                total = R.sum_over_replicas(self._take_partial(None), self.reduce_spec)
            self.install_reduced_grad(total, release_input=True)

    @property
    def reduction_communicates(self) -> bool:
        """Whether reducing this unit's gradient issues a collective (or calls a
        communication hook): not NO_SHARD-like units alone at world size 1,
        whose reduction is only casts and copies."""
        spec = self.reduce_spec
        return (self.comm_hook is not None or spec.world_size > 1
                or spec.replicate_group is not None)

    @property
    def can_bucket_reduction(self) -> bool:
        """Whether this unit's reduction may share a collective with other units'.

        Not with a communication hook (it is called once per unit, with that
        unit's tensors: torch's protocol), not with hybrid strategies (the
        replicate-group all-reduce follows each unit's reduce-scatter) unless
        accumulating (then only the reduce-scatter runs), not NO_SHARD with
        coded gradients, and not at world size 1 (there is no collective to
        save).
        """
        spec = self.reduce_spec
        if self.comm_hook is not None or spec.world_size <= 1:
            return False
        if spec.replicate_group is not None:
            return self.accumulating  # (the shard group's part alone)
        return spec.sharded or spec.wire.grads is None  # (a coded NO_SHARD sum goes alone)

    def take_grad_for_reduction(self, sync: bool) -> torch.Tensor | None:
        """The local unsharded gradient to reduce now, taken off ``flat_param``.

        ``None`` when there is none, or under ``no_sync`` (``sync=False``),
        where it stays on ``flat_param`` (and the original parameters get
        full-shape views of it) for a later synced backward.  Postcondition of
        a returned gradient: ``flat_param.grad`` is ``None`` until
        :meth:`install_reduced_grad`.
        """
        grad = self.flat_param.grad
        if grad is None:
            return None
        if grad.requires_grad:
            raise RuntimeError("FSDP does not support gradients of gradients")
        if not sync:
            self.has_unreduced_grad = True
            if self.use_orig_params:
                self.set_unsharded_grad_views(grad)
            return None
        self.has_unreduced_grad = False
        self.flat_param.grad = None
        return grad

    def install_reduced_grad(self, reduced: torch.Tensor, release_input: bool = False) -> None:
        """Make ``reduced`` (the mean, this rank's shard or all of it) ``flat_param.grad``;
        accumulating, add it (the shard group's part) to the partial sum instead.

        It is returned to the original dtype (unless
        ``keep_low_precision_grads``) and to CPU when offloading; a gradient
        parked by the pre-backward hook is added to it.  ``release_input``:
        ``reduced`` is fsdp_wrap's own (no user hook kept it), so once cast its
        storage is freed at once (:func:`fsdp_wrap.comm.collectives.release`).
        """
        if self.accumulating:
            # (the shard group's part only: it waits for the replicas' all-reduce)
            self._add_partial(reduced)
            if release_input:
                C.release(reduced)
            return
        # The sharded gradient matches the master parameter's dtype, or stays in
        # the compute dtype with keep_low_precision_grads (as torch leaves it).
        grad_dtype = self.compute_dtype if self.keep_low_precision_grads else self.orig_dtype
        if reduced.dtype != grad_dtype:
            cast_from, reduced = reduced, reduced.to(grad_dtype)
            if release_input:
                C.release(cast_from)
            del cast_from
        if reduced.device != self.shard_device:
            reduced = self._to_shard_device(reduced)
        if self._saved_grad_shard is not None:
            parked = self._saved_grad_shard
            self._saved_grad_shard = None
            if parked.dtype == reduced.dtype and parked.device == reduced.device:
                reduced = parked.add_(reduced)
            else:
                reduced = parked.to(reduced) + reduced
        _assign_grad(self.flat_param, reduced)
        if self.use_orig_params:
            self.set_grad_views()

    def for_norm(self) -> list[torch.Tensor]:
        """The gradients ``clip_grad_norm_`` must see: the original
        parameters' (``use_orig_params=True``), else the flat gradient."""
        if self.use_orig_params:
            return [info.param.grad for info in self.infos if info.param.grad is not None]
        return [self.flat_param.grad] if self.flat_param.grad is not None else []

    def set_unsharded_grad_views(self, grad: torch.Tensor, frozen_too: bool = False) -> None:
        """The original params' ``.grad`` become full-shape views of ``grad``, an
        unsharded flat gradient: NO_SHARD's reduced one, the local one under
        ``no_sync`` (``summon_full_params(with_grads=True)``: frozen ones too)."""
        pieces = grad.split(self.layout.segments)  # (one split, not a slice per parameter)
        # Plain ``.grad =`` where the views match the parameters: NO_SHARD's
        # full-shape parameters, unless the gradient keeps a low dtype.
        exact = (not self.uses_sharded_strategy and grad.dtype == self.flat_param.dtype
                 and grad.device == self.flat_param.device)
        for info, seg in zip(self.infos, self.layout.info_segment):
            param = info.param
            if not param.requires_grad and not frozen_too:
                param.grad = None
                continue
            piece = pieces[seg]
            if len(info.shape) != 1:  # (1-D pieces already have the shape)
                piece = piece.view(info.shape)
            if exact:
                param.grad = piece
            else:
                _assign_grad(param, piece)

    # ------------------------------------------ whole gradients (summon's with_grads)

    def gather_full(self) -> torch.Tensor | None:
        """The mean gradient of the whole flat parameter (a collective over the
        shard group), or ``None`` when no rank has one (torch then shows no
        gradients).  Ranks without a gradient contribute zeros so every rank
        takes part."""
        grad = self.flat_param.grad
        if not self.uses_sharded_strategy:
            return None if grad is None else grad.detach().to(self.device)
        spec = self.reduce_spec
        missing = torch.tensor([int(grad is None)], device=self.device)
        C.all_reduce(missing, spec.group)
        if int(missing.item()) == spec.world_size:
            return None
        local = (
            torch.zeros(self.layout.shard_numel, dtype=self.orig_dtype, device=self.device)
            if grad is None or self.has_unreduced_grad
            else grad.detach().to(self.device)
        )
        full = local.new_empty(self.layout.padded_numel)
        C.all_gather_into(full, local, spec.group)
        return full[: self.layout.unpadded_numel]

    def show_full(self, full: torch.Tensor | None) -> None:
        """Original parameters' ``.grad`` become full-shape views of ``full``
        (or ``None``); frozen parameters too (zeros), as torch shows them."""
        if full is None:
            for info in self.infos:
                info.param.grad = None
        else:
            self.set_unsharded_grad_views(full, frozen_too=True)

    def write_back_full(self, full: torch.Tensor) -> None:
        """This rank's part of a shown (maybe changed) full gradient goes into
        the sharded gradient, as torch writes it back (only where that gradient
        exists; NO_SHARD shows the gradient itself)."""
        grad = self.flat_param.grad
        if grad is None or not self.uses_sharded_strategy or self.has_unreduced_grad:
            return
        start, numel = self._shard_offset, self.layout.shard_numel
        piece = full[start : min(start + numel, full.numel())]
        grad[: piece.numel()].copy_(piece.to(grad.dtype))

    def show_sharded(self) -> None:
        """Undo :meth:`show_full`: the views of the gradient the handle holds."""
        if self.has_unreduced_grad and self.flat_param.grad is not None:
            self.set_unsharded_grad_views(self.flat_param.grad)
        else:
            self.set_grad_views()

    def set_grad_views(self) -> None:
        """Original params' ``.grad`` become views of the sharded flat gradient."""
        grad = self.flat_param.grad
        if grad is not None and not self.uses_sharded_strategy:
            self.set_unsharded_grad_views(grad)
            return
        if grad is None:
            for info in self.infos:
                info.param.grad = None
            return
        sizes, piece_of = self._shard_split(grad.numel())
        pieces = grad.split(sizes)  # (one split, not a slice per parameter)
        for info, j in zip(self.infos, piece_of):
            param = info.param
            if j < 0 or not param.requires_grad:
                param.grad = None
                continue
            try:
                param.grad = pieces[j]  # (the common case: shape, dtype and device match)
            except RuntimeError:
                _assign_grad(param, pieces[j])  # (they differ: see _assign_grad)

    def _shard_split(self, numel: int) -> tuple[list[int], list[int]]:
        """Split sizes that tile a sharded gradient of ``numel`` elements, and
        per parameter the piece that is its part (``-1``: none in this shard).

        The pieces between parameters (padding) are split off too and unused.
        """
        cached = self._shard_split_cache
        if cached is not None and cached[0] == numel:
            return cached[1], cached[2]
        sizes: list[int] = []
        piece_of: list[int] = []
        end = 0
        for sl in self._shard_slices:
            if sl is None:
                piece_of.append(-1)
                continue
            if sl[0] > end:
                sizes.append(sl[0] - end)
            piece_of.append(len(sizes))
            sizes.append(sl[1] - sl[0])
            end = sl[1]
        if numel > end:
            sizes.append(numel - end)
        self._shard_split_cache = (numel, sizes, piece_of)
        return sizes, piece_of


def _assign_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Set ``param.grad``, also when its shape, dtype or device differ from the data.

    ``.grad =`` checks that they match; FSDP legitimately breaks that (a full
    local gradient on a sharded parameter under ``no_sync``, a low-precision
    gradient with ``keep_low_precision_grads``), so such gradients are
    installed through ``.grad.data``.
    """
    if (
        grad.shape == param.shape
        and grad.dtype == param.dtype
        and grad.device == param.device
    ):
        param.grad = grad
        return
    if param.grad is None:
        param.grad = torch.empty_like(param)
    param.grad.data = grad
