"""Checkpoint tools beyond the FSDP1 state-dict API.

* :func:`save_full_checkpoint` / :func:`load_full_checkpoint` -- the full model
  straight to disk from rank 0, unit by unit, in Hugging Face's safetensors
  layout; atomic and verified (:mod:`fsdp_wrap.checkpoint.full`).
* :mod:`fsdp_wrap.checkpoint.offline` -- inspect, consolidate and convert
  checkpoints without a process group (the ``fsdp-wrap ckpt`` command).
"""

from fsdp_wrap.checkpoint.full import (
    load_full_checkpoint,
    save_full_checkpoint,
    verify_full_checkpoint,
)
from fsdp_wrap.checkpoint.offline import consolidate, convert, inspect

__all__ = [
    "consolidate",
    "convert",
    "inspect",
    "load_full_checkpoint",
    "save_full_checkpoint",
    "verify_full_checkpoint",
]
