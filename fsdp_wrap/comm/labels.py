"""Profiler labels: every unit's hooks and collectives named in a trace.

torch's FSDP1 and FSDP2 run their hooks and collectives under
``torch.profiler.record_function("FSDP::...")``, so a profiler trace
attributes each all-gather and reduce-scatter to the module it serves.
fsdp_wrap does the same with FSDP2's names, each followed by the unit's
clean FQN (``<root>`` for the root unit; several units where one collective
serves several, a batched gather or a gradient bucket)::

    FSDP::pre_forward (layers.3)
    FSDP::all_gather (layers.3)              a gather issued (and, if synchronous, done)
    FSDP::all_gather (layers.3, layers.4)    one batched gather for two units
    FSDP::all_gather_wait (layers.4)         waiting for a gather in flight (copy-out included)
    FSDP::forward_prefetch for layers.4      a prefetch started in forward
    FSDP::pre_backward (layers.3)
    FSDP::backward_prefetch for layers.2
    FSDP::post_backward (layers.3)
    FSDP::post_backward_reduce (layers.3)    a reduction issued (done, if synchronous)
    FSDP::post_backward_rs_wait (layers.3, layers.2)   waiting for a bucket in flight
    FSDP::writeback_orig_params (layers.3)   use_orig_params: replaced parameters taken up
    FSDP::root_pre_forward / FSDP::root_post_backward_callback

``all_gather_wait`` and ``writeback_orig_params`` are fsdp_wrap's own (torch's
waits are stream events; its write-back is unlabelled); the others are
FSDP2's names (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``).

Cost: nothing is made unless a profiler records
(``fsdp_wrap._compat.profiler_enabled``, one C call): ``record_function``
costs ~50 us a label even with no profiler running, the check ~0.1 us.  Call
sites test ``profiler_enabled()`` themselves (no wrapper frame on the hot
path) or use ``labelled`` on a whole function.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Callable, TypeVar

from torch.profiler import record_function

from fsdp_wrap._compat import profiler_enabled

__all__ = [
    "ALL_GATHER", "ALL_GATHER_WAIT", "BACKWARD_PREFETCH", "FORWARD_PREFETCH", "POST_BACKWARD",
    "POST_BACKWARD_REDUCE", "POST_BACKWARD_RS_WAIT", "POST_FORWARD", "PRE_BACKWARD",
    "PRE_FORWARD", "ROOT_POST_BACKWARD", "ROOT_PRE_FORWARD", "WRITEBACK", "labelled",
    "names", "profiler_enabled", "span",
]

ROOT_PRE_FORWARD = "FSDP::root_pre_forward"
PRE_FORWARD = "FSDP::pre_forward"
POST_FORWARD = "FSDP::post_forward"
PRE_BACKWARD = "FSDP::pre_backward"
POST_BACKWARD = "FSDP::post_backward"
POST_BACKWARD_REDUCE = "FSDP::post_backward_reduce"
POST_BACKWARD_RS_WAIT = "FSDP::post_backward_rs_wait"
ROOT_POST_BACKWARD = "FSDP::root_post_backward_callback"
ALL_GATHER = "FSDP::all_gather"
ALL_GATHER_WAIT = "FSDP::all_gather_wait"
FORWARD_PREFETCH = "FSDP::forward_prefetch"
BACKWARD_PREFETCH = "FSDP::backward_prefetch"
WRITEBACK = "FSDP::writeback_orig_params"

ROOT_NAME = "<root>"


def names(fqns: Iterable[str]) -> str:
    """Units' clean FQNs for a label, each once, in order (``<root>`` for ``""``)."""
    seen: dict[str, None] = {}
    for fqn in fqns:
        seen.setdefault(fqn or ROOT_NAME, None)
    return ", ".join(seen)


def span(label: str, units: str = "") -> record_function:
    """The ``record_function`` of ``label`` for ``units`` (call only where
    :func:`profiler_enabled` is true).  Prefetches read ``... for UNIT``, as
    FSDP2's do; the rest ``... (UNITS)``."""
    if not units:
        return record_function(label)
    if label in (FORWARD_PREFETCH, BACKWARD_PREFETCH):
        return record_function(f"{label} for {units}")
    return record_function(f"{label} ({units})")


F = TypeVar("F", bound=Callable[..., Any])


def labelled(label: str, units: Callable[..., str] | None = None) -> Callable[[F], F]:
    """Run the decorated function under ``label`` (naming ``units(*args)``)
    while a profiler records; otherwise call it straight through (one check,
    one frame)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not profiler_enabled():
                return fn(*args, **kwargs)
            with span(label, units(*args) if units is not None else ""):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
