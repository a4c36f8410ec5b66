"""``FlatParameter`` and ``FlatParamHandle``: the one owner of a unit's tensors.

A handle flattens one unit's original parameters into one 1-D flat parameter,
keeps this rank's shard of it, and moves between two states:

* **sharded**: ``flat_param.data`` is the local shard (``shard_numel`` elements,
  right zero-padded); the unsharded buffer's storage is freed.
* **unsharded**: ``flat_param.data`` is the first ``unpadded_numel`` elements of
  the all-gathered buffer, and the original parameters are views into it.

The unsharded buffer is allocated once and its *storage* is freed and
re-allocated in place (``untyped_storage().resize_``).  Autograd saves views of
that buffer in forward; because the storage object survives a free, gathering
into it again before backward makes those saved views valid again.  This is the
trick the whole FULL_SHARD schedule rests on.

The layout (order, alignment, padding, shards) is torch's FSDP1's and lives
in :mod:`fsdp_wrap.handle.layout`; padding holds ``42`` as torch's does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Callable

import torch
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.comm.labels as L
import fsdp_wrap.comm.reduce as R
from fsdp_wrap.comm.quant.wire import EXACT, Wire
from fsdp_wrap.handle.config import SettingsView, UnitSettings
from fsdp_wrap.handle.dtensor import localize
from fsdp_wrap.handle.flat_tensor import (
    FLAT_PARAM_NAME,
    FlatParameter,
    HandleState,
    HandleTrainingState,
    _Gathered,
    gather_source,
    to_cpu,
)
from fsdp_wrap.handle.grads import FlatGrads
from fsdp_wrap.handle.layout import (
    PADDING_VALUE,
    VALUES_PENDING,
    FlatLayout,
    ParamInfo,
    SharedParamInfo,
    alignment,
    alignment_padding_mask,
    check_flat_group,
    check_unit_params,
    flatten_params,
    is_quantized,
    shard_from_params,
)
from fsdp_wrap.handle.views import ParamViews
from fsdp_wrap.handle.writeback import (
    adopt_replaced_data,
    check_still_frozen,
    check_unchanged_since_forward,
    write_back_orig_params,
)

__all__ = [
    "PADDING_VALUE",
    "FlatParamHandle",
]


class FlatParamHandle(SettingsView):
    """Owns one unit's flat parameter: layout, shard, unshard, reshard, reduce.

    Nothing outside this class and its parts mutates ``flat_param``, the local
    shard, the unsharded buffers or the gradient; the runtime, state dicts and
    summon call the methods below.
    """

    training_state: HandleTrainingState

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[tuple[str, nn.Module, str, nn.Parameter]],
        shared: Sequence[tuple[str, nn.Module, str, int]],
        config: UnitSettings,
        unit_fqn: str = "",
        flat_name: str = FLAT_PARAM_NAME,
    ) -> None:
        self.config = config
        # The name the flat parameter is registered under on the unit's module
        # (``_flat_param``; a unit split into several flat parameters numbers
        # the others ``_flat_param_1``, ...).
        self.flat_name = flat_name
        self.module = module  # the unit's wrapped module
        self._unit_fqn = unit_fqn
        # Accelerators gather asynchronously (overlapping compute on the
        # communication stream).  On CPU an asynchronous prefetch competes with
        # compute for the cores, and gloo's all-gather (used under 1 MiB; larger
        # gathers are broadcasts, see comm/collectives) stages a full-unit buffer
        # until wait(): ``limit_all_gathers`` (torch's memory-vs-overlap switch)
        # keeps CPU gathers synchronous.
        self.async_gathers = config.device.type != "cpu" or not config.limit_all_gathers
        self._skip_writeback_check = os.environ.get("FSDP_SKIP_WRITEBACK_CHECK", "") == "1"
        where = f"(rank {self.rank}, FSDP unit '{unit_fqn or '<root>'}')"
        # DTensor parameters: their local tensors are flattened (handle/dtensor.py)
        self.originals, params, self._tp_specs = localize(params, config, unit_fqn, VALUES_PENDING)
        check_unit_params(params, where, self.use_orig_params)
        check_flat_group(params, where, self.use_orig_params)
        self._init_layout(params, shared)
        flat = self._init_flat_param(params)
        self._init_parts()
        self.views.release_originals(self.device)  # (the flat parameter holds the data now)
        if not self.use_orig_params:
            self.register_flat_param(True)
            self.views.install_stale(flat)
        if flat.untyped_storage().data_ptr() != self.local_shard.untyped_storage().data_ptr():
            flat.untyped_storage().resize_(0)
        self.use_sharded_views()

    # -------------------------------------------------------------- phases

    def enter(self, phase: HandleTrainingState) -> None:
        """Move to ``phase`` (the only writer of :attr:`training_state`)."""
        self.training_state = phase

    def expect_phase(self, allowed: tuple[HandleTrainingState, ...], action: str) -> None:
        """:meth:`_expect` the handle in one of ``allowed`` before ``action``."""
        self._expect(self.training_state in allowed,
                     f"the handle training to be {' or '.join(p.name for p in allowed)}",
                     self.training_state.name, action)

    @property
    def _training_state(self) -> HandleTrainingState:  # (torch's name; frameworks read it)
        return self.training_state

    def _expect(self, holds: bool, expected: str, got: str, action: str) -> None:
        """The handle's one check: ``AssertionError`` (torch's type for these)
        unless ``holds``, naming the rank, the unit, the flat parameter, what was
        expected and what was found."""
        if not holds:
            raise AssertionError(
                f"Expects {expected} but got {got} [rank {self.rank}, FSDP unit "
                f"'{self.unit_fqn or '<root>'}', {self.flat_name}]: {action}")

    def _init_layout(
        self, params: Sequence[tuple[str, nn.Module, str, nn.Parameter]],
        shared: Sequence[tuple[str, nn.Module, str, int]],
    ) -> None:
        """Dtypes, the flat layout, the parameters' places in it, the reduction."""
        config, dtype = self.config, params[0][3].dtype
        # Mixed precision: compute in ``compute_dtype``, reduce in
        # ``reduce_dtype`` (defaulting to the compute dtype, as torch does),
        # keep the sharded master copy in the original dtype.
        self._mp_dtypes = (config.param_dtype, config.reduce_dtype)
        self.orig_dtype = dtype
        self.compute_dtype = config.param_dtype or dtype
        self.reduce_dtype = config.reduce_dtype or config.param_dtype or dtype
        self.shard_device = torch.device("cpu") if config.offload_params else config.device
        # Quantized collectives code floating-point values only: a flat
        # parameter holding a 4-bit base's packed bytes (stored as integers or
        # as ``bnb_4bit_quant_storage`` floats) travels as it is.
        packed = not dtype.is_floating_point or any(is_quantized(p) for *_, p in params)
        self.wire: Wire = EXACT if packed else config.wire
        self._dtypes_changed()
        self.layout = FlatLayout.build(
            [p.numel() for *_, p in params],
            align=alignment(config.param_dtype or dtype, self.use_orig_params),
            world_size=self.world_size,
            sharded=self.uses_sharded_strategy,
        )
        self.infos = [
            ParamInfo(fqn, mod, name, p, p.shape, offset, p.numel(), spec)
            for (fqn, mod, name, p), offset, spec in zip(params, self.layout.offsets,
                                                         self._tp_specs)
        ]
        self.shared = [SharedParamInfo(fqn, mod, name, idx) for fqn, mod, name, idx in shared]
        self._reduce_spec = R.ReduceSpec(
            sharded=self.uses_sharded_strategy,
            padded_numel=self.layout.padded_numel,
            shard_numel=self.layout.shard_numel,
            world_size=self.world_size,
            divide=config.divide,
            reduce_dtype=self.reduce_dtype,
            group=self.process_group,
            replicate_group=self.replicate_group,
            wire=self.wire,
        )
        # Where the local shard starts, and how many of its elements hold data
        # (the rest is right padding); each parameter's slice of it.
        self.shard_offset = self.layout.shard_offset(self.rank)
        self.shard_valid_numel = self.layout.shard_valid_numel(self.rank)
        self._shard_slices = self.layout.shard_slices(self.rank)
        self._pad_mask = (alignment_padding_mask(self.shard_numel, self.shard_valid_numel,
                                                 self._shard_slices, self.device)
                          if self.wire.weights else None)

    def _init_flat_param(self, params: Sequence[tuple[str, nn.Module, str, nn.Parameter]]
                         ) -> torch.Tensor:
        """Flatten, shard, make the ``FlatParameter``; returns the unsharded flat
        tensor (its storage is freed by the caller once views are installed)."""
        requires_grad = any(p.requires_grad for *_, p in params)
        with torch.no_grad():
            if self.uses_sharded_strategy:
                # Only this rank's part is copied: the unsharded flat tensor never
                # exists (its stand-in below is shape only and never written).
                self.local_shard = shard_from_params(
                    self.infos, self._shard_slices, self.shard_offset, self.shard_numel,
                    self.shard_valid_numel, self.layout.has_padding, self.orig_dtype,
                    self.device)
                flat = torch.empty(self.unpadded_numel, dtype=self.orig_dtype, device=self.device)
            else:
                flat = self.local_shard = flatten_params(
                    self.infos, self.unpadded_numel, self.layout.has_padding, self.orig_dtype,
                    self.device)
            for info in self.infos:
                info.param.__dict__.pop(VALUES_PENDING, None)
            if self.offload_params:
                self.local_shard = to_cpu(self.local_shard, pin=self.device.type == "cuda")
        self.flat_param = FlatParameter.make(self.local_shard, requires_grad, self.infos)
        # The shard as ``.data`` (torch's ``_local_shard``): same memory, its own
        # version counter, so writing into it (summon write-back between a
        # forward and its backward) does not invalidate the forward's views.
        self.local_shard = self.flat_param.data
        # Unsharded copies: one in the compute dtype for forward/backward, and
        # (only when that differs from the original dtype) one in full
        # precision for summon_full_params and state dicts.
        self._gathered = {False: _Gathered(), True: _Gathered()}
        self._current: _Gathered | None = None
        self.state = HandleState.SHARDED  # (changed by finish_unshard / reshard only)
        self.training_state = HandleTrainingState.IDLE  # (set through enter())
        return flat

    def _init_parts(self) -> None:
        """The gradient and view parts, given what they need explicitly."""
        self.grads = FlatGrads(
            self.flat_param, self.infos, self.layout, self._shard_slices,
            self._reduce_spec, use_orig_params=self.use_orig_params, device=self.device,
            to_shard_device=to_cpu, shard_device=self.shard_device,
            dtypes=(self.orig_dtype, self.compute_dtype, self.reduce_dtype),
            keep_low_precision_grads=self.config.keep_low_precision_grads,
            shard_offset=self.shard_offset,
        )
        self.grads.unit_name = self._unit_fqn  # (named in profiler labels of its reductions)
        self.views = ParamViews(
            self.module, self.infos, self.shared, self.layout, self._shard_slices,
            use_orig_params=self.use_orig_params, sharded=self.uses_sharded_strategy,
            flat_name=self.flat_name,
        )

    def adopt_flat_param_data(self) -> None:
        """Take up a ``flat_param.data`` replaced since construction (see
        :func:`~fsdp_wrap.handle.writeback.adopt_replaced_data`)."""
        adopt_replaced_data(self)

    @property
    def unit_fqn(self) -> str:
        """The unit's clean FQN under its root (set at lazy init; ``""``: the root)."""
        return self._unit_fqn

    @unit_fqn.setter
    def unit_fqn(self, fqn: str) -> None:
        self._unit_fqn = fqn
        self.grads.unit_name = fqn  # (named in profiler labels of its reductions)

    # ------------------------------------------------------------------ views
    # (``self.views``, :class:`~fsdp_wrap.handle.views.ParamViews`; these give it
    # the flat parameter's current data)

    def use_unsharded_views(
        self, as_params: bool = False, source: torch.Tensor | None = None,
        track_graph: bool = False,
    ) -> None:
        """The original parameters as views of the unsharded data (see
        :meth:`ParamViews.use_unsharded_views`); the handle must be unsharded."""
        self._expect(self.state is HandleState.UNSHARDED, "an unsharded flat parameter",
                     self.state.name, "showing the unsharded views")
        self.views.use_unsharded_views(
            self.flat_param, self._needs_copy, as_params, source, track_graph
        )

    def use_sharded_views(self) -> None:
        """The module back in its between-steps form."""
        self.views.use_sharded_views(self.flat_param, self.local_shard)

    def register_params(self, tensors: Sequence[torch.Tensor]) -> None:
        """The original parameters registered with ``tensors`` as their data."""
        self.views.register_params(tensors, self.flat_param)

    def forward_views_reusable(self) -> bool:
        """Whether backward may keep the forward's views."""
        return self.views.forward_views_reusable(
            self.flat_param, self._needs_copy, self.state is HandleState.UNSHARDED
        )

    def _dtypes_changed(self) -> None:
        """Derived from the dtypes and devices, kept as plain attributes (read
        several times per unit and step): whether unsharded data lives apart
        from the shard (always when sharded; NO_SHARD only to cast or move
        it), and whether a mixed precision is set that ``computes_in_full_precision``
        may skip."""
        self._needs_copy = (self.uses_sharded_strategy or self.compute_dtype != self.orig_dtype
                            or self.shard_device != self.device)
        self._may_skip_mp = self.config.use_full_prec_in_eval and (
            (self.compute_dtype, self.reduce_dtype) != (self.orig_dtype, self.orig_dtype))
        # A coded compute copy is never the exact one summon and state dicts want.
        self._full_copy_apart = (self.compute_dtype != self.orig_dtype
                                 or self.wire.weights is not None)

    @property
    def computes_in_full_precision(self) -> bool:
        """Mixed precision is skipped: ``FSDP_USE_FULL_PREC_IN_EVAL=1`` and the
        module in ``eval()`` (torch's ``_force_full_precision`` outside summon)."""
        return self._may_skip_mp and not self.module.training

    # Sizes come from the layout (names kept: the state-dict code reads them).

    @property
    def unpadded_numel(self) -> int: return self.layout.unpadded_numel
    @property
    def shard_numel(self) -> int: return self.layout.shard_numel
    @property
    def padded_numel(self) -> int: return self.layout.padded_numel
    @property
    def _segments(self) -> tuple[int, ...]: return self.layout.segments
    @property
    def _info_segment(self) -> tuple[int, ...]: return self.layout.info_segment

    @property
    def params(self) -> list[nn.Parameter]:
        return [info.param for info in self.infos]

    def param_shard_slice(self, index: int) -> tuple[int, int] | None:
        return self._shard_slices[index]

    # --------------------------------------------------------- unshard/reshard

    @property
    def is_unsharded(self) -> bool:
        return self.state is HandleState.UNSHARDED

    def _slot(self, full_precision: bool) -> _Gathered:
        return self._gathered[full_precision and self._full_copy_apart]

    def gather_source(self, dtype: torch.dtype, coded: bool = False) -> torch.Tensor:
        """What this rank sends in an all-gather (:func:`~fsdp_wrap.handle.flat_tensor.gather_source`):
        coded, the shard in the original dtype with alignment padding zeroed."""
        if coded:
            return gather_source(self.local_shard, self.device, pad_mask=self._pad_mask)
        return gather_source(self.local_shard, self.device, dtype)

    def start_unshard(self, full_precision: bool = True, async_op: bool | None = None) -> None:
        """Issue the all-gather (asynchronously) unless the data is already there.

        ``full_precision=False`` gathers the compute-dtype copy forward and
        backward use; everything else (state dicts, summon) wants the
        original dtype, which is the default.  ``async_op``: whether the
        gather stays in flight (``None``: as the unit gathers, see
        ``async_gathers``; an explicit ``unshard(async_op=True)`` says ``True``).
        """
        slot = self._slot(full_precision)
        if not slot.checked:
            # (a batch or a prefetch that gathered this slot checked already:
            # one check per unshard, as torch's FSDP1 skips a prefetched unit's)
            self.pre_unshard()  # (a write-back frees every slot)
        if slot.valid and slot.version >= 0 and slot.version != self._shard_version():
            slot.free()  # kept past a reshard, but the shard changed since (an optimizer step)
        if not self._needs_copy or slot.valid or slot.pending is not None:
            return
        dtype = self.orig_dtype if full_precision else self.compute_dtype
        if not self.uses_sharded_strategy:
            # A cast and/or host-to-device copy of the whole flat parameter
            # (into the same storage object every time, as for the gathers).
            slot.copy_from(self.local_shard, self.unpadded_numel, dtype, self.device)
            return
        coded = not full_precision and self.wire.weights is not None
        src = self.gather_source(dtype, coded)
        wire = self.wire if coded else EXACT
        async_op = self.async_gathers if async_op is None else async_op
        if L.profiler_enabled():
            with L.span(L.ALL_GATHER, L.names((self.unit_fqn,))):
                slot.gather(src, self.padded_numel, dtype, self.device, wire,
                            self.process_group, async_op)
        else:
            slot.gather(src, self.padded_numel, dtype, self.device, wire, self.process_group,
                        async_op)

    # Batched all-gathers (see fsdp_wrap.comm.gather_batch): the gather itself is
    # shared, the buffers stay each handle's own.

    def needs_gather(self) -> bool:
        """Whether the compute copy must still be all-gathered (not there, not coming)."""
        slot = self._gathered[False]
        return self.uses_sharded_strategy and not slot.valid and slot.pending is None

    @property
    def gather_nbytes(self) -> int:
        """Bytes of the gathered compute copy."""
        return self.layout.padded_numel * self.compute_dtype.itemsize

    def gather_input(self) -> torch.Tensor:
        """What this rank sends in an all-gather of the compute copy (its shard in
        the compute dtype; what a coded wire encodes), after taking up replaced
        original parameters."""
        if not self._gathered[False].checked:
            self.pre_unshard()
        return self.gather_source(self.compute_dtype, coded=self.wire.weights is not None)

    def take_gathered(self, rows: torch.Tensor) -> None:
        """Fill the compute copy from ``rows`` (``(world_size, shard_numel)``, rank
        ``r``'s shard in row ``r``), gathered together with other units.

        Postcondition: as after a completed :meth:`start_unshard`; the copy goes
        into the same storage object as always (autograd may hold views of it).
        """
        slot = self._gathered[False]
        slot.ensure_buffer(self.padded_numel, self.compute_dtype, self.device)
        slot.buffer.view(self.world_size, self.shard_numel).copy_(rows)  # type: ignore[union-attr]
        slot.valid = slot.checked = True  # (gather_input checked)

    def expect_gathered(self, pending: C.PendingWork) -> None:
        """The compute copy comes with a batch still in flight (a prefetch):
        waiting for ``pending`` (shared by the batch) copies it in."""
        slot = self._gathered[False]
        slot.pending, slot.checked = pending, True  # (gather_input checked)

    def pre_unshard(self) -> bool:
        """Take up original parameters or gradients replaced since the last
        step (``use_orig_params=True``), as torch does before every unshard;
        whether any parameter was."""
        if (self.use_orig_params and self.state is HandleState.SHARDED
                and not self.views.params_registered and not self._skip_writeback_check
                and write_back_orig_params(self)):
            for slot in self._gathered.values():
                slot.wait()
                slot.free()
            return True
        return False

    def pre_unshard_for_forward(self) -> bool:
        """:meth:`pre_unshard` at the root's pre-forward, which checks every
        unit before any collective: the compute copy's slot counts as checked
        until the unit's forward unshards it (one check per unshard, as torch
        makes, not a second one there)."""
        replaced = self.pre_unshard()
        self._slot(self.computes_in_full_precision).checked = True
        return replaced

    def finish_unshard(self, full_precision: bool = True) -> None:
        """Wait for the gather and point ``flat_param`` at the unsharded data."""
        self.start_unshard(full_precision)
        slot = self._slot(full_precision)
        if slot.pending is not None and L.profiler_enabled():
            with L.span(L.ALL_GATHER_WAIT, L.names((self.unit_fqn,))):
                slot.wait()
        else:
            slot.wait()
        slot.checked = False  # (the next unshard checks again)
        if self._needs_copy and slot.buffer is not None:
            self.flat_param.data = slot.buffer[: self.unpadded_numel]
        self._current = slot
        self.state = HandleState.UNSHARDED

    def reshard(self, free: bool) -> None:
        """Point ``flat_param`` back at the shard; free the gathered storage if asked.

        Idempotent.  Keeping the storage (``free=False``) lets the next unshard
        skip its all-gather; that is only valid while the shard is unchanged.
        A full-precision copy (summon) and a NO_SHARD cast copy are always
        dropped: they are cheap to make again and may go stale.
        """
        for full_precision, slot in self._gathered.items():
            slot.wait()
            if free or full_precision or not self.uses_sharded_strategy:
                slot.free()
            elif slot.valid:
                slot.version = self._shard_version()
        self.flat_param.data = self.local_shard
        self._current = None
        if self.state is HandleState.UNSHARDED:
            self.state = HandleState.SHARDED
            self.use_sharded_views()

    def set_gradient_divide(self, divide: C.DivideFactors) -> None:
        """Gradients divided by ``divide.pre`` before, ``.post`` after their sum."""
        self._reduce_spec = dataclasses.replace(self._reduce_spec, divide=divide)
        self.grads.reduce_spec = self._reduce_spec

    def _shard_version(self) -> int:
        """Grows whenever the shard is written in place between steps (an
        optimizer steps the flat parameter, or with ``use_orig_params`` the
        original parameters viewing it)."""
        version = self.flat_param._version
        if self.use_orig_params:
            version += sum(info.param._version for info in self.infos)
        return version

    def invalidate_unsharded(self) -> None:
        """The shard changed (load, writeback): drop any gathered copy."""
        self.reshard(free=True)

    @property
    def frees_copy_after_forward(self) -> bool:
        """NO_SHARD computing on a cast or moved copy (mixed precision, offload):
        the copy is freed after forward and made again for backward, as torch
        does, so no unit's copy waits through the rest of the forward."""
        return self._needs_copy and not self.uses_sharded_strategy

    @property
    def holds_unsharded_storage(self) -> bool:
        """Gathered (or being gathered) data that a later unshard would reuse."""
        slot = self._gathered[False]
        return self._needs_copy and (slot.valid or slot.pending is not None)

    # ----------------------------------------------------------- storage

    def free_unsharded_storage(self, full_precision: bool = False) -> None:
        """Free the compute copy's (or summon's full-precision copy's) memory
        now; ``reshard`` finishes the job later."""
        slot = self._slot(full_precision)
        slot.wait()
        slot.free()

    # ------------------------------------------------------------ loading
    # (state dicts, summon and write-back change the shard only through these;
    # gradients: ``self.grads``; whole copies: :mod:`fsdp_wrap.handle.full_copies`)

    def load_shard(self, values: torch.Tensor) -> None:
        """Copy ``values`` into the local shard: the whole (padded) shard, or
        its valid elements (``shard_valid_numel``; the padding stays)."""
        target = self.local_shard
        if values.numel() != target.numel():
            target = target[: self.shard_valid_numel]
        with torch.no_grad():
            target.copy_(values.reshape(-1))

    def load_shard_with(self, write: Callable[[torch.Tensor], None]) -> None:
        """Let ``write`` fill the local shard in place (a SHARDED load's
        exchange writes each received piece where it belongs)."""
        with torch.no_grad():
            write(self.local_shard)

    def load_param(self, index: int, value: torch.Tensor) -> None:
        """Copy this rank's piece of original parameter ``index``'s full ``value``
        into the local shard (nothing where the shard holds none of it)."""
        sl = self._shard_slices[index]
        if sl is not None:
            start = sl[0] + self.shard_offset - self.infos[index].offset
            with torch.no_grad():
                self.local_shard[sl[0] : sl[1]].copy_(
                    value.detach().reshape(-1)[start : start + sl[1] - sl[0]])

    def register_flat_param(self, registered: bool) -> None:
        """Register the flat parameter on the unit's module (its place without
        ``use_orig_params``), or take it off for a while (a load through an
        activation-checkpoint wrapper, whose own hook would move its key)."""
        if registered:
            self.module._parameters[self.flat_name] = self.flat_param
        else:
            self.module._parameters.pop(self.flat_name, None)

    def check_still_frozen(self) -> None:
        """Refuse originals of a frozen flat parameter unfrozen since wrapping
        (:func:`~fsdp_wrap.handle.writeback.check_still_frozen`)."""
        check_still_frozen(self)

    def check_views_unchanged(self) -> None:
        """Kept unsharded since forward: refuse parameters replaced before
        backward (:func:`~fsdp_wrap.handle.writeback.check_unchanged_since_forward`)."""
        check_unchanged_since_forward(self, self.views.compute_views)

    def write_back_from(self, unsharded: torch.Tensor) -> None:
        """Write ``unsharded`` (a full flat copy, e.g. on CPU) into the local shard."""
        with torch.no_grad():
            lo = self.shard_offset
            self.local_shard[: self.shard_valid_numel].copy_(
                unsharded[lo : lo + self.shard_valid_numel]
            )

    def write_back_unsharded(self) -> None:
        """Copy this rank's part of the current unsharded data into the local shard."""
        self._expect(self.state is HandleState.UNSHARDED, "an unsharded flat parameter",
                     self.state.name, "writing the unsharded data back into the shard")
        slot = self._current
        if not self._needs_copy or slot is None or slot.buffer is None:
            return  # the views alias the local shard: nothing to copy
        with torch.no_grad():
            if self.uses_sharded_strategy:
                lo = self.shard_offset
                self.local_shard[: self.shard_valid_numel].copy_(
                    slot.buffer[lo : lo + self.shard_valid_numel]
                )
            else:
                self.local_shard.copy_(slot.buffer[: self.unpadded_numel])


