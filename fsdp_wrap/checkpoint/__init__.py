"""Checkpoint tools beyond the FSDP1 state-dict API.

* :mod:`fsdp_wrap.checkpoint.offline` -- inspect, consolidate and convert
  checkpoints without a process group (the ``fsdp-wrap ckpt`` command).
"""

from .offline import consolidate, convert, inspect

__all__ = ["consolidate", "convert", "inspect"]
