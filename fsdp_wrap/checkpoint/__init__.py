"""Checkpoint tools beyond the FSDP1 state-dict API.

* :func:`save_full_checkpoint` / :func:`load_full_checkpoint` -- the full model
  straight to disk from rank 0, unit by unit, in Hugging Face's safetensors
  layout; atomic and verified (:mod:`fsdp_wrap.checkpoint.full`).
* :func:`init_optim_state_from_checkpoint` -- a fresh optimizer made a
  complete DCP load template for a sharded optimizer checkpoint
  (:mod:`fsdp_wrap.checkpoint.optim_template`).
* :mod:`fsdp_wrap.checkpoint.offline` -- inspect, consolidate and convert
  checkpoints without a process group (the ``fsdp-wrap ckpt`` command).
"""

from fsdp_wrap.checkpoint.full import (
    load_full_checkpoint,
    save_full_checkpoint,
    verify_full_checkpoint,
)
from fsdp_wrap.checkpoint.offline import consolidate, convert, inspect
from fsdp_wrap.checkpoint.optim_template import init_optim_state_from_checkpoint

__all__ = [
    "consolidate",
    "convert",
    "init_optim_state_from_checkpoint",
    "inspect",
    "load_full_checkpoint",
    "save_full_checkpoint",
    "verify_full_checkpoint",
]
