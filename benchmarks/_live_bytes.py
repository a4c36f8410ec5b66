"""Live heap bytes on CPU, sampled after every op: a peak that fragmentation cannot blur.

glibc's ``mallinfo2`` reports the bytes the allocator has handed out and not got
back (``uordblks``: in-heap chunks, ``hblkhd``: mmapped chunks).  Sampling it
after each dispatched op (forward *and* backward: autograd carries the mode
into backward) gives the peak of live allocations, where the RSS high-water
mark also counts freed memory the allocator kept.  Slow; for diagnosis only.
"""

from __future__ import annotations

import ctypes
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def live_bytes() -> int:
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class LivePeak(TorchDispatchMode):
    """``peak``: the most live heap bytes seen after any op inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = live_bytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        now = live_bytes()
        if now > self.peak:
            self.peak = now
        return out
