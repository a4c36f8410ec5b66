"""The prefixes wrappers put into module and state-dict keys, and the clean form.

``FullyShardedDataParallel`` keeps the wrapped module as ``_fsdp_wrapped_module``
and torch's ``checkpoint_wrapper`` as ``_checkpoint_wrapped_module``; the flat
parameter of a unit is ``_flat_param``.  State-dict keys and messages use the
clean form, without the wrappers' prefixes (as torch's FSDP1 does).
"""

from __future__ import annotations

__all__ = ["CHECKPOINT_WRAPPED", "FLAT_PARAM_KEY", "WRAPPED", "clean_key"]

WRAPPED = "_fsdp_wrapped_module."
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."
FLAT_PARAM_KEY = "_flat_param"


def clean_key(key: str) -> str:
    """``key`` without the FSDP and activation-checkpointing wrappers' prefixes."""
    return key.replace(WRAPPED, "").replace(CHECKPOINT_WRAPPED, "")
