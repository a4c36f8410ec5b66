"""Profile a few training steps of an unchanged script: ``$FSDP_WRAP_TRACE``.

``fsdp-wrap trace -- CMD`` (``fsdp_wrap.cli.trace``) runs a training
script with ``FSDP_WRAP_TRACE=DIR`` (and ``FSDP_WRAP_TRACE_STEPS=W,N``, default
``2,3``); in every process, the first FSDP root to initialise then profiles
its steps ``W+1 .. W+N`` with ``torch.profiler`` and writes
``DIR/trace_rank{R}.json`` (Chrome/Perfetto JSON; ``R`` the global rank).  A
step runs from one forward with grad of the root to the next (backward, the
optimizer step and the data loading between them included); forwards
without grad (evaluation) are not counted.  ``fsdp_wrap.cli.timeline`` reads
the files and draws the steps.

Without the variable nothing is attached: the root's forward carries no
extra hook.  With it, a forward pre-hook on the root counts forwards (torch's
``nn.Module`` hook, one per process).  The profile records CPU ops and, where
CUDA is present, its kernels; fsdp_wrap's labels (:mod:`fsdp_wrap.comm.labels`)
name each unit's collectives in it.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["ENV_DIR", "ENV_STEPS", "DEFAULT_STEPS", "attach_if_asked", "parse_steps",
           "trace_path"]

ENV_DIR = "FSDP_WRAP_TRACE"
ENV_STEPS = "FSDP_WRAP_TRACE_STEPS"
DEFAULT_STEPS = (2, 3)  # (warm-up steps, profiled steps)

_ATTACHED: list[_StepTracer] = []  # (one at a time per process: the first root's)


def parse_steps(text: str) -> tuple[int, int]:
    """``"W,N"`` -> ``(W, N)``; ``ValueError`` naming the variable unless W >= 0, N >= 1."""
    try:
        warmup, steps = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{ENV_STEPS} must be 'WARMUP,STEPS' (e.g. 2,3) but got {text!r}") \
            from None
    if warmup < 0 or steps < 1:
        raise ValueError(f"{ENV_STEPS} needs WARMUP >= 0 and STEPS >= 1 but got {text!r}")
    return warmup, steps


def trace_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"trace_rank{rank}.json")


def attach_if_asked(root: nn.Module) -> None:
    """At a root's lazy init: profile its steps if ``$FSDP_WRAP_TRACE`` says so
    (one root at a time per process: the first, until its profile is written)."""
    directory = os.environ.get(ENV_DIR, "")
    if not directory or _ATTACHED:
        return
    warmup, steps = parse_steps(os.environ.get(ENV_STEPS, "") or
                                f"{DEFAULT_STEPS[0]},{DEFAULT_STEPS[1]}")
    os.makedirs(directory, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tracer = _StepTracer(trace_path(directory, rank), warmup, steps)
    # (lazy init runs in the root's first forward, before this hook exists:
    # that forward counts as the first step; from a state-dict call before
    # training, one warm-up step fewer)
    tracer.forwards = 1 if torch.is_grad_enabled() else 0
    tracer.hook = root.register_forward_pre_hook(tracer.on_forward)
    _ATTACHED.append(tracer)
    atexit.register(tracer.finish)


class _StepTracer:
    """Counts the root's forwards with grad; profiles steps ``warmup+1 .. warmup+steps``."""

    def __init__(self, path: str, warmup: int, steps: int) -> None:
        self.path, self.warmup, self.steps = path, warmup, steps
        self.forwards = 0
        self.prof: Any = None
        self.step: Any = None  # the open "ProfilerStep#k" label (torch's name for a step)
        self.hook: Any = None

    def on_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self.forwards += 1  # (this forward begins step number self.forwards)
        if self.forwards == self.warmup + 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self._next_step()
        elif self.prof is not None and self.forwards <= self.warmup + self.steps:
            self._next_step()
        elif self.prof is not None:
            self.finish()

    def _next_step(self) -> None:
        """Close the step's label and open the next (torch's profiler marks steps
        only under a schedule)."""
        if self.step is not None:
            self.step.__exit__(None, None, None)
        self.step = torch.profiler.record_function(
            f"ProfilerStep#{self.forwards - self.warmup - 1}")
        self.step.__enter__()

    def finish(self) -> None:
        """Stop and write the profile (once; at the step after the last, or at exit)."""
        prof, self.prof = self.prof, None
        if prof is None:
            return
        if self.hook is not None:
            self.hook.remove()
        if self.step is not None:
            self.step.__exit__(None, None, None)
            self.step = None
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(self.path)
        if self in _ATTACHED:
            _ATTACHED.remove(self)  # (a later root of this process may trace again)
