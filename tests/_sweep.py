"""Sweeps of many configurations inside one pool task, safely.

A sweep runs configuration after configuration on every rank of a
:class:`tests._dist.DistPool` and returns a list of human-readable failures
per rank.  Three rules keep a failure on one rank from turning into a hang:

1. **Decisions that gate a collective are agreed first.**  A rank that saw
   a difference must not skip collectives the other ranks enter (the
   classic: ``if not fails: run the state-dict checks``).  Such a decision is
   taken on :func:`any_rank`, an all-reduce of the flag, so every rank takes
   the same branch.
2. **Differences are data, exceptions end the task.**  Comparison failures
   go into the returned list and the sweep goes on in step.  An exception
   propagates out of the task on the rank that raised it; the pool reports it
   (message and traceback) within its ``failure_grace`` seconds and restarts
   the ranks left waiting in a collective.  :func:`run_sweep` prints the
   configuration first, so the report names it.
3. **Progress is reported** after every configuration
   (:func:`tests._dist.progress`), so the pool's no-progress timeout bounds
   a hang without bounding the sweep's length.

Every comparison helper calls :func:`injected` first.  ``run_sweep(...,
inject=Injection(rank, index, kind))`` arms it on one rank for one
configuration: the first comparison there then reports a difference
(``kind="mismatch"``) or raises (``kind="raise"``).  tests/test_sweeps.py
injects both into every sweep of the suite and checks they are reported,
fast, with the message, and (for a mismatch) that the sweep stays in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from tests._dist import progress

__all__ = ["Injection", "InjectedFailure", "any_rank", "injected", "run_sweep"]


@dataclass(frozen=True)
class Injection:
    """Fail on ``rank`` at configuration ``index``: ``kind`` is "mismatch" or "raise"."""

    rank: int
    index: int
    kind: str = "mismatch"

    def __post_init__(self) -> None:
        if self.kind not in ("mismatch", "raise"):
            raise ValueError(f"kind must be 'mismatch' or 'raise', got {self.kind!r}")


class InjectedFailure(AssertionError):
    """Raised by :func:`injected` for ``Injection(kind="raise")``."""


_ARMED: Injection | None = None  # the injection waiting for this rank's next comparison


def any_rank(flag: bool, group: Any = None) -> bool:
    """``True`` on every rank of ``group`` if ``flag`` is true on any of them.

    The one way a test decides whether to run (or skip) more collectives.
    """
    # NCCL reduces device tensors only (tests/test_cuda.py's world-size-1 pool)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def injected(what: str) -> str | None:
    """The armed injection for the comparison ``what``, if any (used once)."""
    global _ARMED
    armed, _ARMED = _ARMED, None
    if armed is None:
        return None
    msg = f"injected {armed.kind} on rank {armed.rank} at {what}"
    if armed.kind == "raise":
        raise InjectedFailure(msg)
    return msg


def run_sweep(
    configs: list[Any],
    fn: Callable[[Any], list[str]],
    describe: Callable[[Any], str] = repr,
    inject: Injection | None = None,
) -> list[str]:
    """Run ``fn(cfg)`` for every config on this rank; return all failures.

    ``fn`` returns its failures (strings); an exception ends the task after
    printing which configuration raised.  ``inject`` arms :func:`injected`.
    """
    global _ARMED
    rank = dist.get_rank()
    fails: list[str] = []
    for i, cfg in enumerate(configs):
        if inject is not None and inject.index == i and inject.rank == rank:
            _ARMED = inject
        try:
            fails += fn(cfg)
        except BaseException:
            print(f"[rank {rank}] configuration {i} raised: {describe(cfg)}", flush=True)
            raise
        finally:
            leftover, _ARMED = _ARMED, None
        if leftover is not None:
            fails.append(
                f"[rank {rank}] injected {leftover.kind} was never reached: {describe(cfg)} made no comparison"
            )
        progress()
    return fails
