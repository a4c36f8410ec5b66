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

__all__ = ["FLAT_PARAM_NAME", "FlatParameter", "HandleState", "ensure_storage", "same_storage"]

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


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class HandleState(Enum):
    SHARDED = auto()
    UNSHARDED = auto()


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
