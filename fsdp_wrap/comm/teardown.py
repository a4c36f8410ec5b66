"""Ending a worker process that used a gloo process group, without a crash at exit.

gloo runs each collective on a worker thread of its own, and that thread drops
its reference to a finished collective only after the caller has been told
the collective completed.  A barrier also keeps the collectives that were still
in flight when it was queued.  Dropping the last reference to a tensor that was
created in Python needs the GIL.  If the main thread has meanwhile reached
interpreter shutdown, the worker thread cannot take the GIL: Python ends the
thread, the unwind crosses a C++ destructor, and the C++ runtime aborts the
process with "terminate called without an active exception" (SIGABRT).  The
run itself succeeded, but the launcher reports a crashed rank.

Seen with torch 2.13 on CPU, in a few percent of two-rank runs whose last
steps are ``all_gather_object``, ``barrier``, ``destroy_process_group``.  It
happens with or without ``destroy_process_group``, and a ``gc.collect()``
only narrows the window, since the worker threads outlive the process group's
Python object.  The one sure way out is not to finalise the interpreter: the
processes we start ourselves (the demo's ranks, benchmark workers) flush their
output and leave with :func:`exit_now` once their work is done.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    """Flush standard streams and logging handlers, then end the process with ``code``
    at once, skipping interpreter finalisation (and with it ``atexit`` handlers).

    Only for processes whose work is complete and whose files are closed.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # closed or replaced stream: nothing left to write
    logging.shutdown()
    os._exit(code)
