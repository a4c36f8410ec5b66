"""The flat parameter tensor and one unsharded copy of it.

``FlatParameter`` is what the optimizer sees of a unit; ``_Gathered`` holds one
all-gathered (unsharded) copy and the collective filling it.  The handle in
:mod:`fsdp_wrap.handle.flat_param` owns both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn

import fsdp_wrap.comm.collectives as C

__all__ = ["FLAT_PARAM_NAME", "FlatParameter", "HandleState", "HandleTrainingState",
           "ensure_storage", "same_storage"]

#: The name a flat parameter is registered under on its unit's module.
FLAT_PARAM_NAME = "_flat_param"


class _FlatParameterMeta(type(nn.Parameter)):  # type: ignore[misc]
    """``isinstance(t, FlatParameter)`` holds for any tensor flagged ``_is_flat_param``.

    torch's FSDP1 recognises flat parameters the same way, so tools written
    for it (and torch's own ``FlatParameter`` isinstance checks) see ours.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch.Tensor) and bool(getattr(instance, "_is_flat_param", False))


class FlatParameter(nn.Parameter, metaclass=_FlatParameterMeta):
    """The flat parameter of one FSDP unit.

    Instances are plain ``nn.Parameter`` objects flagged ``_is_flat_param``
    (the flag is the part of torch's API that other code checks).  Build them
    with :meth:`make`.  They also carry the metadata frameworks written for
    torch's FSDP1 read: ``_fsdp_flattened`` (Lightning's optimizer check),
    ``_fqns`` (the original parameters' names relative to the unit's module;
    Accelerate's logs, DCP's ``state_dict`` helpers), ``_shapes`` and
    ``_numels``.
    """

    @staticmethod
    def make(data: torch.Tensor, requires_grad: bool,
             infos: Sequence[Any] = ()) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad=requires_grad)
        param._is_flat_param = True  # type: ignore[attr-defined]
        param._fsdp_flattened = True  # type: ignore[attr-defined]
        param._fqns = tuple(i.fqn for i in infos)  # type: ignore[attr-defined]
        param._shapes = tuple(i.shape for i in infos)  # type: ignore[attr-defined]
        param._numels = tuple(i.numel for i in infos)  # type: ignore[attr-defined]
        return param


def ensure_storage(buffer: torch.Tensor) -> None:
    """Give a freed buffer (storage resized to zero) its bytes back, in place."""
    storage = buffer.untyped_storage()
    nbytes = buffer.numel() * buffer.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def to_cpu(tensor: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """A CPU copy; ``pin`` for a persistent offloaded shard, whose
    host-to-device copy before every all-gather is then asynchronous."""
    out = tensor.to("cpu")
    return out.pin_memory() if pin else out


def gather_source(shard: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None,
                  pad_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What a rank sends in an all-gather of its ``shard``: on the compute
    ``device``, cast to ``dtype``; or, for a coded gather, in the original
    dtype (no rounding to the compute dtype first) with the alignment padding
    of ``pad_mask`` zeroed (its ``PADDING_VALUE`` would set its block's scale)."""
    src = shard if shard.device == device else shard.to(device, non_blocking=True)
    if pad_mask is not None:
        return src.masked_fill(pad_mask, 0)
    return src if dtype is None or src.dtype == dtype else src.to(dtype)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (a DTensor: its local tensor's)."""
    a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class HandleState(Enum):
    """Which memory a handle's flat parameter shows (FSDP2's ``ShardedState``):
    ``SHARDED``, the local shard (the gathered storage freed or kept aside);
    ``UNSHARDED``, the gathered data the original parameters view."""

    SHARDED = auto()
    UNSHARDED = auto()


class HandleTrainingState(Enum):
    """What a handle's unit is doing with it (torch's FSDP1 names and order):
    set by the runtime's hooks and by summon, read by code written for torch
    (``handle._training_state``)."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()


@dataclass
class _Gathered:
    """One unsharded copy of the flat parameter and the gather filling it."""

    buffer: torch.Tensor | None = None
    valid: bool = False
    pending: C.Work | C.PendingWork | None = None
    source: torch.Tensor | None = None
    version: int = -1  # the shard's version when kept past a reshard (see FlatParamHandle)
    # Gathered (or being gathered) after a write-back check and not yet used:
    # the unshard that uses it need not check again (torch's ``_prefetched``).
    checked: bool = False

    def ensure_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """A buffer of ``numel`` elements of ``dtype``: the one it had, its bytes
        given back in place (autograd holds views of its storage across a
        free), or a new one where the dtype changed."""
        if self.buffer is None or self.buffer.dtype != dtype:
            self.buffer = torch.empty(numel, dtype=dtype, device=device)
        else:
            ensure_storage(self.buffer)

    def copy_from(self, shard: torch.Tensor, numel: int, dtype: torch.dtype,
                  device: torch.device) -> None:
        """NO_SHARD: fill with a cast and/or device copy of the whole ``shard``.
        Checked until its unit uses it, as a gathered copy (a prefetched
        unit's unshard does not check again; a reshard frees it)."""
        self.ensure_buffer(numel, dtype, device)
        self.buffer.copy_(shard, non_blocking=True)  # type: ignore[union-attr]
        self.valid = self.checked = True

    def gather(self, source: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device,
               wire: Any, group: Any, async_op: bool) -> None:
        """Issue the all-gather of every rank's ``source`` into this copy over
        ``group`` (through ``wire``, which may code it)."""
        self.ensure_buffer(numel, dtype, device)
        self.source = source  # keep the input alive until the gather finishes
        self.pending = wire.all_gather(self.buffer, source, group, async_op=async_op)
        self.checked = True
        if self.pending is None:  # completed synchronously
            self.source, self.valid = None, True

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.source = None
            self.valid = True
            self.version = -1

    def free(self) -> None:
        """Release the memory but keep the storage *object* (resized to zero
        bytes): autograd and the modules hold views of it, which become valid
        again when the next unshard refills the same storage."""
        if self.buffer is not None:
            self.buffer.untyped_storage().resize_(0)
        self.valid = self.checked = False
        self.version = -1
