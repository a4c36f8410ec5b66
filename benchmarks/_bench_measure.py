"""Measurement helpers for ``bench_fsdp.py``: collective bytes, peak memory, clocks."""

from __future__ import annotations

import collections
import ctypes
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Count every c10d collective and its payload as it reaches the dispatcher.

    Since torch 2.1 every ``torch.distributed`` collective (``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, ``all_reduce``, ...) is dispatched as an op in the
    ``c10d`` namespace (``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``,
    ``c10d::allreduce_``), for gloo as for NCCL, so a dispatch mode sees all of
    them whichever library issued them.  The payload counted is the *unsharded*
    size: the all-gather output, the reduce-scatter input, the all-reduce or
    broadcast tensor.  Under that convention FULL_SHARD moves 3x the parameter
    bytes per step and SHARD_GRAD_OP 2x.

    Every aten op goes through the mode too, so it is only used for a counting
    step that is not timed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            if "allgather" in name:
                nbytes = _nbytes(args[0])  # outputs
            elif "reduce_scatter" in name:
                nbytes = _nbytes(args[1])  # inputs
            elif name in ("barrier", "monitored_barrier_"):
                nbytes = 0
            else:  # allreduce_, allreduce_coalesced_, broadcast_, ...
                nbytes = _nbytes(args[0])
            self.calls[name] += 1
            self.bytes[name] += nbytes
        return func(*args, **(kwargs or {}))

    def gathers(self) -> tuple[int, int]:
        """All-gathers counted so far, and their bytes: gloo's and NCCL's own,
        the broadcasts fsdp_wrap gathers with over more ranks, and its two-rank
        gloo exchanges, an ``isend``/``irecv`` pair each (one gather, counted by
        its receive; its bytes the send's and the receive's together).  Only for
        a span without reductions (a generation, an evaluation forward): a
        two-rank gloo reduce-scatter is such a pair too."""
        names = [n for n in self.calls if "allgather" in n or "broadcast" in n]
        calls = self.calls["recv_"] + sum(self.calls[n] for n in names)
        nbytes = self.bytes["send"] + self.bytes["recv_"] + sum(self.bytes[n] for n in names)
        return calls, nbytes


# ----------------------------------------------------------------- memory


def _read_status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_hwm() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> None:
    """Give freed heap memory back to the OS so RSS reflects live tensors (glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of this rank over a window, relative to a baseline.

    CPU: resident set size (``VmRSS``); the window's peak is the high-water mark
    ``VmHWM`` after resetting it at the window's start.  CUDA:
    ``torch.cuda.memory_allocated`` and ``max_memory_allocated``.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return _read_status("VmRSS")

    def start_window(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            malloc_trim()
            if not _reset_hwm():
                raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs)")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _read_status("VmHWM")


# ----------------------------------------------------------------- clocks


class Clock:
    """Wall time of a region; on CUDA the device is synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
