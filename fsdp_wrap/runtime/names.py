"""The names wrappers put into module and state-dict keys, and the clean form.

``FullyShardedDataParallel`` keeps the wrapped module as ``_fsdp_wrapped_module``
and torch's ``checkpoint_wrapper`` as ``_checkpoint_wrapped_module``.  State-dict
keys, ``named_parameters()`` inside ``summon_full_params`` and every message use
the clean form, without the wrappers' prefixes (torch's ``clean_tensor_name``).
The flat parameter's name is :data:`fsdp_wrap.handle.flat_tensor.FLAT_PARAM_NAME`.
"""

from __future__ import annotations

__all__ = ["CHECKPOINT_WRAPPED", "WRAPPED", "WRAPPED_MODULE", "clean_fqn"]

WRAPPED_MODULE = "_fsdp_wrapped_module"
WRAPPED = WRAPPED_MODULE + "."
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def clean_fqn(name: str) -> str:
    """``name`` without the FSDP and activation-checkpointing wrappers' prefixes."""
    return name.replace(WRAPPED, "").replace(CHECKPOINT_WRAPPED, "")
