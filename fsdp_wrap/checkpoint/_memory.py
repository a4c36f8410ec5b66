"""Handing freed heap memory back to the operating system between tensors.

glibc serves large allocations from the heap once a large block has been
freed (its mmap threshold adapts), so a loop that allocates and frees one big
tensor after another keeps every freed block resident; the streaming
checkpoint code calls :func:`release_freed_memory` between tensors so that
its peak stays about one tensor.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["release_freed_memory"]


def _load_malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``, or a no-op where the C library has none."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return lambda: None

    def release() -> None:
        trim(0)

    return release


#: Hand freed heap memory back to the OS (a no-op without glibc).
release_freed_memory: Callable[[], None] = _load_malloc_trim()
