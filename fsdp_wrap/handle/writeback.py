"""Write-back of original parameters changed outside forward (``use_orig_params=True``).

Between steps each original parameter is a view of its unit's local shard,
and its ``.grad`` a view of the sharded flat gradient.  Code written for
torch's FSDP1 may break that link: ``p.data = new``, ``module.weight =
nn.Parameter(new)``, ``p.grad = new`` or ``p.grad = None``.  torch copies
such changes into the flat parameter (and flat gradient) before the next
unshard; so does :func:`write_back_orig_params`, which the handle calls
before every gather of a sharded unit.

``module.half()`` / ``.to(dtype)`` after wrapping converts the flat
parameter itself (:func:`flat_param_exposed`), as torch's FSDP1 does.

A unit kept unsharded after forward (``SHARD_GRAD_OP``) computes its backward
from the forward's views; :func:`check_unchanged_since_forward` fails when one
of those was replaced before backward, as torch does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator
from typing import Protocol

import torch
import torch.nn as nn

import fsdp_wrap.comm.labels as L
from fsdp_wrap.api import ShardingStrategy
from fsdp_wrap.comm.reduce import ReduceSpec
from fsdp_wrap.handle.flat_tensor import HandleState, _Gathered, same_storage
from fsdp_wrap.handle.grads import FlatGrads, _assign_grad
from fsdp_wrap.handle.layout import ParamInfo, SharedParamInfo
from fsdp_wrap.handle.views import ParamViews


class OwningHandle(Protocol):
    """What write-back reads and calls on its handle (the ``FlatParamHandle`` of
    ``handle/flat_param.py``, which owns it: only the handle calls these functions,
    and they change only the handle's own flat parameter, its gradient and its
    unit's registered parameters)."""

    flat_param: nn.Parameter
    local_shard: torch.Tensor
    infos: list[ParamInfo]
    shared: list[SharedParamInfo]
    module: nn.Module
    flat_name: str
    unit_fqn: str
    state: HandleState
    grads: FlatGrads  # reads has_unreduced_grad; retype (adopt_replaced_data)
    views: ParamViews  # forget_kept, install_stale (adopt_replaced_data)
    # dtypes and the unsharded copies (adopt_replaced_data retypes them)
    orig_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    _mp_dtypes: tuple[torch.dtype | None, torch.dtype | None]
    _reduce_spec: ReduceSpec
    _gathered: dict[bool, _Gathered]
    _needs_copy: bool

    @property
    def rank(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def strategy(self) -> ShardingStrategy: ...
    @property
    def use_orig_params(self) -> bool: ...
    @property
    def uses_sharded_strategy(self) -> bool: ...
    @property
    def unpadded_numel(self) -> int: ...

    def param_shard_slice(self, index: int) -> tuple[int, int] | None: ...
    def pre_unshard(self) -> bool: ...
    def use_sharded_views(self) -> None: ...
    def adopt_flat_param_data(self) -> None: ...
    def _dtypes_changed(self) -> None: ...

__all__ = [
    "adopt_replaced_data",
    "check_still_frozen",
    "check_unchanged_since_forward",
    "flat_param_exposed",
    "write_back_orig_params",
]


def _where(handle: OwningHandle, fqn: str) -> str:
    unit = handle.unit_fqn
    full = f"{unit}.{fqn}" if unit else fqn
    return f"(rank {handle.rank}, FSDP unit '{unit or '<root>'}') '{full}'"


def _shard_range(handle: OwningHandle, index: int, full: bool) -> tuple[int, int]:
    """``[start, end)`` of parameter ``index`` in the local shard (or, with
    ``full``, in the unsharded flat tensor)."""
    info = handle.infos[index]
    if full or not handle.uses_sharded_strategy:
        return info.offset, info.offset + info.numel
    sl = handle.param_shard_slice(index)
    return (0, 0) if sl is None else sl


def _copy_into(handle: OwningHandle, what: str, index: int, src: torch.Tensor,
               dst: torch.Tensor, full: bool) -> None:
    info = handle.infos[index]
    lo, hi = _shard_range(handle, index, full)
    if full:
        ok, expected, flat_src = src.numel() == info.numel, tuple(info.shape), src.reshape(-1)
    else:
        ok, expected, flat_src = src.shape == torch.Size([hi - lo]), (hi - lo,), src
    if not ok:
        kind = "full shape" if full else "this rank's 1-D shard of it"
        raise RuntimeError(
            f"{_where(handle, info.fqn)}: Cannot writeback when the {what} shape changes. "
            f"Expects {expected} ({kind}) but got {tuple(src.shape)}. With "
            f"use_orig_params=True, assign a {what} of the shape FSDP gave it "
            f"(e.g. p.{'data' if what == 'parameter' else 'grad'} = new of shape "
            f"p.{'shape' if what == 'parameter' else 'grad.shape'}), or change the model "
            "before wrapping it"
        )
    dst[lo:hi].copy_(flat_src)


def check_still_frozen(handle: OwningHandle) -> None:
    """A frozen flat parameter's originals must stay frozen (``use_orig_params=True``).

    A unit splits its frozen parameters into a flat parameter of their own,
    which has no gradient.  torch's FSDP1 keeps them in the unit's one flat
    parameter, so one unfrozen after wrapping (Lightning's ``BaseFinetuning``,
    a hand-written unfreeze) starts training there; here it would silently
    get no gradient, so it is refused, before any collective of the forward.
    Runs at the root's pre-forward of every training forward with grad: one
    attribute read per frozen original parameter.
    """
    if handle.flat_param.requires_grad:
        return
    for info in handle.infos:
        if info.param.requires_grad:
            raise RuntimeError(
                f"{_where(handle, info.fqn)} requires grad now but was frozen when its unit "
                "was wrapped, and fsdp_wrap keeps a unit's frozen parameters in a flat "
                "parameter of their own, without gradients: it would silently not train. "
                "Set requires_grad=True on it before wrapping (leave it out of the "
                "optimizer, or give it lr=0, until it should train), or wrap it in a unit "
                "of its own with use_orig_params=False and unfreeze that unit's flat "
                "parameter"
            )


def _unit_of(handle: OwningHandle) -> str:
    return L.names((handle.unit_fqn,))


@L.labelled(L.WRITEBACK, _unit_of)
def write_back_orig_params(handle: OwningHandle) -> bool:
    """Copy replaced original parameters and gradients into the flat ones.

    Precondition: the handle is sharded (its original parameters registered as
    views of the local shard).  Returns whether any parameter data changed,
    in which case the caller must drop gathered copies.
    """
    if _nothing_replaced(handle):
        return False
    wrote = False
    shard = handle.local_shard
    grad_full = not handle.uses_sharded_strategy or handle.grads.has_unreduced_grad
    with torch.no_grad():
        for i, info in enumerate(handle.infos):
            if info.name not in info.module._parameters:
                continue  # deregistered (e.g. by activation checkpointing code)
            current = info.module._parameters[info.name]
            if current is None:
                continue
            if current is not info.param:
                # A new Parameter set on the module: it becomes the original.
                _copy_into(handle, "parameter", i, current.detach(), shard,
                           not handle.uses_sharded_strategy)
                handle.infos[i] = info = dataclasses.replace(info, param=current)
                for shared in handle.shared:
                    if shared.index == i:
                        shared.module._parameters[shared.name] = current
                wrote = True
            elif not same_storage(current, shard):
                wrote = True
                _copy_into(handle, "parameter", i, current.detach(), shard,
                           not handle.uses_sharded_strategy)
            _write_back_grad(handle, i, grad_full)
        for shared in handle.shared:
            prim = handle.infos[shared.index]
            if shared.module._parameters.get(shared.name, prim.param) is not prim.param:
                raise NotImplementedError(
                    f"{_where(handle, shared.fqn)}: Changing shared parameters is not "
                    f"supported yet: it shares '{prim.fqn}', which must stay the same "
                    "Parameter object; assign to both names, or to the first one only"
                )
    if wrote:
        handle.use_sharded_views()  # the original parameters view the shard again
    return wrote


def _span(t: torch.Tensor) -> tuple[int, int]:
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


def _nothing_replaced(handle: OwningHandle) -> bool:
    """The common case, decided cheaply: every original parameter is still the
    registered object, its data lies in the local shard and its ``.grad`` in
    the flat gradient (or both gradients are ``None``).

    Address ranges stand for "same storage" here: while a view keeps a storage
    alive, no other storage can occupy its bytes.  ``False`` only sends the
    caller down the full path, which decides (and copies) exactly.
    """
    shard = handle.local_shard
    shard_lo, shard_hi = _span(shard)
    flat_grad = handle.flat_param.grad
    grad_lo, grad_hi = _span(flat_grad) if flat_grad is not None else (0, 0)
    full = not handle.uses_sharded_strategy or handle.grads.has_unreduced_grad
    shard_storage = 0  # (the shard's storage address, read once if an empty view needs it)
    for i, info in enumerate(handle.infos):
        current = info.module._parameters.get(info.name)
        if current is None:
            continue  # (deregistered or None: the full path skips it too)
        if current is not info.param:
            return False
        ptr = current.data_ptr()  # (0 for an empty view: nothing of it in this shard)
        if not shard_lo <= ptr < shard_hi:
            if ptr != 0:
                return False
            shard_storage = shard_storage or shard.untyped_storage().data_ptr()
            if current.untyped_storage().data_ptr() != shard_storage:
                return False  # (as same_storage(current, shard))
        grad = current.grad
        if grad is None:
            # No gradient where the flat one has one: the full path zeroes this
            # parameter's range of it, unless that range is empty (a parameter
            # with nothing in this rank's shard, whose .grad is always None).
            if flat_grad is not None:
                lo, hi = _shard_range(handle, i, full)
                if lo != hi:
                    return False
        elif not grad_lo <= grad.data_ptr() < grad_hi:
            return False
    for shared in handle.shared:
        prim = handle.infos[shared.index].param
        if shared.module._parameters.get(shared.name, prim) is not prim:
            return False
    return True


def _write_back_grad(handle: OwningHandle, index: int, full: bool) -> None:
    """Gradient part of :func:`write_back_orig_params` for parameter ``index``."""
    param = handle.infos[index].param
    flat = handle.flat_param
    flat_grad = flat.grad
    if param.grad is None:
        if flat_grad is None:
            return
        lo, hi = _shard_range(handle, index, full)
        flat_grad[lo:hi].zero_()  # torch's meaning of a gradient set to None
        return
    if flat_grad is not None and same_storage(param.grad, flat_grad):
        return
    if flat_grad is None:
        flat_grad = torch.zeros_like(flat)
    _copy_into(handle, "gradient", index, param.grad.detach(), flat_grad, full)
    if flat.grad is None:
        flat.grad = flat_grad
    # The parameter's .grad is a view of the flat gradient again.

    info = handle.infos[index]
    lo, hi = _shard_range(handle, index, full)
    view = flat.grad[lo:hi]
    _assign_grad(param, view.view(info.shape) if full else view)


def check_unchanged_since_forward(handle: OwningHandle, views: list[torch.Tensor]) -> None:
    """Fail if a unit kept unsharded after forward had a parameter replaced
    before its backward (the gradient would silently belong to the old one)."""
    flat = handle.flat_param
    for info, view in zip(handle.infos, views):
        current = info.module._parameters.get(info.name, view)
        if current is view and same_storage(view, flat):
            continue
        raise AssertionError(
            f"{_where(handle, info.fqn)}: FSDP does not support changing the parameters "
            f"between forward and backward for {handle.strategy}: it was "
            f"{'replaced' if current is not view else 'given new data'} after forward. "
            "Change parameters after backward (e.g. after optimizer.step()), or use "
            "FULL_SHARD, which reshards after forward"
        )



@contextlib.contextmanager
def flat_param_exposed(handle: OwningHandle | None) -> Generator[None, None, None]:
    """Register the flat parameter in place of the original ones for a while.

    ``nn.Module._apply`` (``.half()``, ``.to(dtype)``, ``.double()``) then
    converts the flat parameter (``flat_param.data = fn(flat_param)``); on
    exit the handle takes the new data up as its shard and the original
    parameters view it again.  With ``use_orig_params=True`` only, on a
    sharded unit (as torch's ``_deregister_orig_params_ctx``).
    """

    if handle is None or not handle.use_orig_params or handle.state is not HandleState.SHARDED:
        yield
        return
    handle.pre_unshard()  # take up pending changes before the originals are hidden
    params = handle.module._parameters
    for info in handle.infos:
        info.module._parameters.pop(info.name, None)
    for shared in handle.shared:
        shared.module._parameters.pop(shared.name, None)
    params[handle.flat_name] = handle.flat_param
    try:
        yield
    finally:
        params.pop(handle.flat_name, None)
        handle.adopt_flat_param_data()
        handle.use_sharded_views()


def adopt_replaced_data(handle: OwningHandle) -> None:
    """Take up a ``flat_param.data`` replaced since construction (the handle's
    ``adopt_flat_param_data``).

    Code written for torch's FSDP1 may swap the flat parameter's data
    before the first forward (Accelerate upcasts a bf16-loaded model's flat
    parameters to fp32 master weights: ``flat_param.data =
    flat_param.data.float()``); torch re-reads it at lazy init.  The new
    data becomes the local shard and its dtype the original (master) dtype;
    the compute and reduce dtypes follow unless mixed precision fixed them.
    """
    data = handle.flat_param.data
    if (data.data_ptr() == handle.local_shard.data_ptr()
            and data.dtype == handle.local_shard.dtype):
        return
    if data.shape != handle.local_shard.shape:
        raise RuntimeError(
            f"(rank {handle.rank}, FSDP unit '{handle.unit_fqn or '<root>'}') the flat "
            f"parameter's data was replaced by a tensor of shape {tuple(data.shape)}; "
            f"expected this rank's shard, {tuple(handle.local_shard.shape)}. Replace it "
            "only with a same-shaped tensor (e.g. flat_param.data = flat_param.data.float())"
        )
    handle.local_shard = data
    handle.views.forget_kept()  # (they view the old data: let it go now)
    if data.dtype != handle.orig_dtype:
        param_dtype, reduce_dtype = handle._mp_dtypes
        handle.orig_dtype = data.dtype
        handle.compute_dtype = param_dtype or data.dtype
        handle.reduce_dtype = reduce_dtype or param_dtype or data.dtype
        handle._dtypes_changed()
        handle._reduce_spec = dataclasses.replace(handle._reduce_spec,
                                                  reduce_dtype=handle.reduce_dtype)
        handle.grads.retype((handle.orig_dtype, handle.compute_dtype, handle.reduce_dtype),
                            handle._reduce_spec)
        handle._gathered = {False: _Gathered(), True: _Gathered()}
        if not handle.use_orig_params:
            # The modules' between-steps views take the new dtype: views of
            # the data itself where NO_SHARD needs no copy, else shape only.
            if handle._needs_copy:
                flat = torch.empty(handle.unpadded_numel, dtype=data.dtype, device=handle.device)
                handle.views.install_stale(flat)
                flat.untyped_storage().resize_(0)
            else:
                handle.views.install_stale(data[: handle.unpadded_numel])
    if handle.use_orig_params:
        handle.use_sharded_views()
