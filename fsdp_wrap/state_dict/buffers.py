"""Buffers in state dicts: which tensors, in which dtype (torch's FSDP1 rules).

FULL and SHARDED state dicts hold the modules' own buffer tensors (``nn.Module``
puts ``buf.detach()`` there: the same storage).  With
``MixedPrecision(buffer_dtype=...)`` every buffer FSDP manages (not an ignored
module's) is saved as a copy in its original dtype.  LOCAL state dicts only
return cast buffers to their original dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_wrap.handle.layout import walk_unit_modules
from fsdp_wrap.runtime.names import CHECKPOINT_WRAPPED, WRAPPED
from fsdp_wrap.runtime.state import UnitState, is_unit

__all__ = ["buffers_in_original_dtype"]


def buffers_in_original_dtype(state: UnitState, state_dict: dict[str, Any], prefix: str,
                              local: bool) -> None:
    """Replace this unit's buffer entries as torch's post-state-dict hooks do."""
    if local:
        for rel, dtype in state._buffer_orig_dtypes.items():
            key = prefix + WRAPPED + rel
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                state_dict[key] = value.to(dtype)
        return
    if state.settings.mixed_precision.buffer_dtype is None:
        return
    for mod_fqn, mod in walk_unit_modules(state.wrapped_module, is_unit):
        if mod in state._ignored_modules:
            continue
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set:
                continue
            raw = f"{mod_fqn}.{name}" if mod_fqn else name
            key = prefix + WRAPPED + raw.replace(CHECKPOINT_WRAPPED, "")
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor):
                dtype = state._buffer_orig_dtypes.get(raw, value.dtype)
                state_dict[key] = value.to(dtype=dtype, copy=True)
