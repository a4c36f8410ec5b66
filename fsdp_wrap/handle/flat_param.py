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

import torch
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
import fsdp_wrap.comm.labels as L
import fsdp_wrap.comm.reduce as R
from fsdp_wrap.api import RESHARD_AFTER_FORWARD, SHARDED_STRATEGIES
from fsdp_wrap.comm.quant.wire import EXACT, Wire
from fsdp_wrap.handle.config import HandleConfig
from fsdp_wrap.handle.flat_tensor import FLAT_PARAM_NAME, FlatParameter, HandleState, _Gathered
from fsdp_wrap.handle.grads import FlatGrads
from fsdp_wrap.handle.layout import (
    PADDING_VALUE,
    VALUES_PENDING,
    FlatLayout,
    ParamInfo,
    SharedParamInfo,
    alignment,
    check_flat_group,
    check_unit_params,
    flatten_params,
    is_quantized,
    shard_from_params,
)
from fsdp_wrap.handle.views import ParamViews
from fsdp_wrap.handle.writeback import write_back_orig_params

__all__ = [
    "PADDING_VALUE",
    "FlatParamHandle",
]


class FlatParamHandle:
    """Owns one unit's flat parameter: layout, shard, unshard, reshard, reduce.

    Nothing outside this class mutates ``flat_param``, the local shard or the
    unsharded buffer; the runtime calls the methods below.
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[tuple[str, nn.Module, str, nn.Parameter]],
        shared: Sequence[tuple[str, nn.Module, str, int]],
        config: HandleConfig,
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
        self.device, self.strategy = config.device, config.strategy
        self.process_group, self.replicate_group = config.process_group, config.replicate_group
        self.rank, self.world_size = config.rank, config.world_size
        self.use_orig_params = config.use_orig_params
        self.uses_sharded_strategy = config.strategy in SHARDED_STRATEGIES
        self.reshard_after_forward = config.strategy in RESHARD_AFTER_FORWARD
        self.offload_params = config.offload_params
        # Accelerators gather asynchronously (overlapping compute on the
        # communication stream).  On CPU an asynchronous prefetch competes with
        # compute for the cores, and gloo's all-gather (used under 1 MiB; larger
        # gathers are broadcasts, see comm/collectives) stages a full-unit buffer
        # until wait(): ``limit_all_gathers`` (torch's memory-vs-overlap switch)
        # keeps CPU gathers synchronous.
        self.async_gathers = config.device.type != "cpu" or not config.limit_all_gathers
        self._skip_writeback_check = os.environ.get("FSDP_SKIP_WRITEBACK_CHECK", "") == "1"
        self._use_full_prec_in_eval = config.use_full_prec_in_eval  # FSDP_USE_FULL_PREC_IN_EVAL
        where = f"(rank {self.rank}, FSDP unit '{unit_fqn or '<root>'}')"
        check_unit_params(params, where, self.use_orig_params)
        check_flat_group(params, where, self.use_orig_params)
        self._init_layout(params, shared)
        flat = self._init_flat_param(params)
        self._init_parts()
        self._release_original_storage()
        if not self.use_orig_params:
            module._parameters[self.flat_name] = self.flat_param
            self.views.install_stale(flat)
        if flat.untyped_storage().data_ptr() != self.local_shard.untyped_storage().data_ptr():
            flat.untyped_storage().resize_(0)
        self.use_sharded_views()

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
            ParamInfo(fqn, mod, name, p, p.shape, offset, p.numel())
            for (fqn, mod, name, p), offset in zip(params, self.layout.offsets)
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
        self._pad_mask = self._alignment_padding_mask() if self.wire.weights else None

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
                self.local_shard = self._to_shard_device(self.local_shard, pin=True)
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
        self.state = HandleState.SHARDED
        return flat

    def _init_parts(self) -> None:
        """The gradient and view parts, given what they need explicitly."""
        self.grads = FlatGrads(
            self.flat_param, self.infos, self.layout, self._shard_slices,
            self._reduce_spec, use_orig_params=self.use_orig_params, device=self.device,
            to_shard_device=self._to_shard_device, shard_device=self.shard_device,
            dtypes=(self.orig_dtype, self.compute_dtype, self.reduce_dtype),
            keep_low_precision_grads=self.config.keep_low_precision_grads,
        )
        self.grads.unit_name = self._unit_fqn
        self.views = ParamViews(
            self.module, self.infos, self.shared, self.layout, self._shard_slices,
            use_orig_params=self.use_orig_params, sharded=self.uses_sharded_strategy,
            flat_name=self.flat_name,
        )

    def adopt_flat_param_data(self) -> None:
        """Take up a ``flat_param.data`` replaced since construction.

        Code written for torch's FSDP1 may swap the flat parameter's data
        before the first forward (Accelerate upcasts a bf16-loaded model's flat
        parameters to fp32 master weights: ``flat_param.data =
        flat_param.data.float()``); torch re-reads it at lazy init.  The new
        data becomes the local shard and its dtype the original (master) dtype;
        the compute and reduce dtypes follow unless mixed precision fixed them.
        """
        data = self.flat_param.data
        if data.data_ptr() == self.local_shard.data_ptr() and data.dtype == self.local_shard.dtype:
            return
        if data.shape != self.local_shard.shape:
            raise RuntimeError(
                f"(rank {self.rank}, FSDP unit '{self.unit_fqn or '<root>'}') the flat "
                f"parameter's data was replaced by a tensor of shape {tuple(data.shape)}; "
                f"expected this rank's shard, {tuple(self.local_shard.shape)}. Replace it "
                "only with a same-shaped tensor (e.g. flat_param.data = flat_param.data.float())"
            )
        self.local_shard = data
        self.views.forget_kept()  # (they view the old data: let it go now)
        if data.dtype != self.orig_dtype:
            param_dtype, reduce_dtype = self._mp_dtypes
            self.orig_dtype = data.dtype
            self.compute_dtype = param_dtype or data.dtype
            self.reduce_dtype = reduce_dtype or param_dtype or data.dtype
            self._dtypes_changed()
            self._reduce_spec = dataclasses.replace(self._reduce_spec,
                                                    reduce_dtype=self.reduce_dtype)
            self.grads.retype((self.orig_dtype, self.compute_dtype, self.reduce_dtype),
                              self._reduce_spec)
            self._gathered = {False: _Gathered(), True: _Gathered()}
            if not self.use_orig_params:
                # The modules' between-steps views take the new dtype: views of
                # the data itself where NO_SHARD needs no copy, else shape only.
                if self._needs_copy:
                    flat = torch.empty(self.unpadded_numel, dtype=data.dtype, device=self.device)
                    self.views.install_stale(flat)
                    flat.untyped_storage().resize_(0)
                else:
                    self.views.install_stale(data[: self.unpadded_numel])
        if self.use_orig_params:
            self.use_sharded_views()

    @property
    def unit_fqn(self) -> str:
        """The unit's clean FQN under its root (set at lazy init; ``""``: the root)."""
        return self._unit_fqn

    @unit_fqn.setter
    def unit_fqn(self, fqn: str) -> None:
        self._unit_fqn = fqn
        self.grads.unit_name = fqn  # (named in profiler labels of its reductions)

    # ------------------------------------------------------------------ layout

    def _release_original_storage(self) -> None:
        """The flat parameter now holds the data; drop the originals' storage."""
        for info in self.infos:
            info.param.data = torch.empty(0, dtype=info.param.dtype, device=self.device)
            info.param.grad = None
        if not self.use_orig_params:
            for info in self.infos:
                info.module._parameters.pop(info.name, None)
            for shared in self.shared:
                shared.module._parameters.pop(shared.name, None)

    # ------------------------------------------------------------------ views
    # (``self.views``, :class:`~fsdp_wrap.handle.views.ParamViews`; these give it
    # the flat parameter's current data)

    def use_unsharded_views(
        self, as_params: bool = False, source: torch.Tensor | None = None,
        track_graph: bool = False,
    ) -> None:
        """The original parameters as views of the unsharded data (see
        :meth:`ParamViews.use_unsharded_views`)."""
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
        self._may_skip_mp = self._use_full_prec_in_eval and (
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
    def unpadded_numel(self) -> int:
        return self.layout.unpadded_numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def _segments(self) -> tuple[int, ...]:
        return self.layout.segments

    @property
    def _info_segment(self) -> tuple[int, ...]:
        return self.layout.info_segment

    @property
    def params(self) -> list[nn.Parameter]:
        return [info.param for info in self.infos]

    def param_shard_slice(self, index: int) -> tuple[int, int] | None:
        return self._shard_slices[index]

    # --------------------------------------------------------- unshard/reshard

    @property
    def is_unsharded(self) -> bool:
        return self.state is HandleState.UNSHARDED

    def _to_shard_device(self, tensor: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Copy to CPU; ``pin`` for the persistent shard, whose host-to-device
        copy before every all-gather is then asynchronous."""
        out = tensor.to("cpu")
        return out.pin_memory() if pin and self.device.type == "cuda" else out

    def _slot(self, full_precision: bool) -> _Gathered:
        return self._gathered[full_precision and self._full_copy_apart]

    def _coded_gather_source(self) -> torch.Tensor:
        """What a coded all-gather encodes: the shard in the original dtype (no
        rounding to the compute dtype first), alignment padding zeroed (its
        ``PADDING_VALUE`` would set the scale of its block)."""
        src = self.local_shard
        if src.device != self.device:
            src = src.to(self.device, non_blocking=True)
        return src if self._pad_mask is None else src.masked_fill(self._pad_mask, 0)

    def _alignment_padding_mask(self) -> torch.Tensor | None:
        """The local shard's alignment padding (``None`` where it has none)."""
        mask = torch.zeros(self.shard_numel, dtype=torch.bool)
        mask[: self.shard_valid_numel] = True
        for sl in self._shard_slices:
            if sl is not None:
                mask[sl[0] : sl[1]] = False
        return mask.to(self.device) if bool(mask.any()) else None

    def _gather_source(self, dtype: torch.dtype) -> torch.Tensor:
        src = self.local_shard
        if src.device != self.device:
            src = src.to(self.device, non_blocking=True)
        return src if src.dtype == dtype else src.to(dtype)

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
            # A cast and/or host-to-device copy of the whole flat parameter, made
            # into the same storage object every time (autograd holds views of
            # it across a free, as for the sharded strategies).
            if slot.buffer is None or slot.buffer.dtype != dtype:
                slot.buffer = torch.empty(self.unpadded_numel, dtype=dtype, device=self.device)
            else:
                _ensure_storage(slot.buffer)
            slot.buffer.copy_(self.local_shard, non_blocking=True)
            # (checked until its unit uses it, as a gathered slot: a prefetched
            # unit's finish_unshard does not check again; reshard frees it)
            slot.valid = slot.checked = True
            return
        coded = not full_precision and self.wire.weights is not None
        src = self._coded_gather_source() if coded else self._gather_source(dtype)
        if slot.buffer is None or slot.buffer.dtype != dtype:
            slot.buffer = torch.empty(self.padded_numel, dtype=dtype, device=self.device)
        else:
            _ensure_storage(slot.buffer)
        slot.source = src  # keep the input alive until the gather finishes
        wire = self.wire if coded else EXACT
        if async_op is None:
            async_op = self.async_gathers
        if L.profiler_enabled():
            with L.span(L.ALL_GATHER, L.names((self.unit_fqn,))):
                slot.pending = wire.all_gather(slot.buffer, src, self.process_group,
                                               async_op=async_op)
        else:
            slot.pending = wire.all_gather(slot.buffer, src, self.process_group,
                                           async_op=async_op)
        slot.checked = True
        if slot.pending is None:  # completed synchronously
            slot.source, slot.valid = None, True

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
        if self.wire.weights is not None:
            return self._coded_gather_source()
        return self._gather_source(self.compute_dtype)

    def take_gathered(self, rows: torch.Tensor) -> None:
        """Fill the compute copy from ``rows`` (``(world_size, shard_numel)``, rank
        ``r``'s shard in row ``r``), gathered together with other units.

        Postcondition: as after a completed :meth:`start_unshard`; the copy goes
        into the same storage object as always (autograd may hold views of it).
        """
        slot = self._gathered[False]
        if slot.buffer is None or slot.buffer.dtype != self.compute_dtype:
            slot.buffer = torch.empty(self.padded_numel, dtype=self.compute_dtype,
                                      device=self.device)
        else:
            _ensure_storage(slot.buffer)
        slot.buffer.view(self.world_size, self.shard_numel).copy_(rows)
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

    def free_unsharded_storage(self) -> None:
        """Free the compute copy's memory now; ``reshard`` finishes the job later."""
        slot = self._gathered[False]
        slot.wait()
        slot.free()

    # -------------------------------------------------------------- utilities
    # (gradients: ``self.grads``, :class:`~fsdp_wrap.handle.grads.FlatGrads`;
    # whole copies for state dicts and exports: :mod:`fsdp_wrap.handle.full_copies`)

    def flat_grad_for_norm(self) -> list[torch.Tensor]:
        """The gradients ``clip_grad_norm_`` must see for this handle."""
        if self.use_orig_params:
            return [info.param.grad for info in self.infos if info.param.grad is not None]
        return [self.flat_param.grad] if self.flat_param.grad is not None else []

    def write_back_from(self, unsharded: torch.Tensor) -> None:
        """Write ``unsharded`` (a full flat copy, e.g. on CPU) into the local shard."""
        with torch.no_grad():
            lo = self.shard_offset
            self.local_shard[: self.shard_valid_numel].copy_(
                unsharded[lo : lo + self.shard_valid_numel]
            )

    def write_back_unsharded(self) -> None:
        """Copy this rank's part of the current unsharded data into the local shard."""
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


def _ensure_storage(buffer: torch.Tensor) -> None:
    """Give a freed buffer (storage resized to zero) its bytes back, in place."""
    storage = buffer.untyped_storage()
    nbytes = buffer.numel() * buffer.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)

