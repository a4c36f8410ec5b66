"""Run a command (the demo, a CLI, ``torchrun``) from a test, bounded in time.

:func:`run_bounded` is ``subprocess.run(..., capture_output=True, text=True)``
with one difference: when ``timeout`` passes, every Python process the command
started (``torchrun``'s agent and its ranks included) first dumps its stack
(``PYTHONFAULTHANDLER`` plus ``SIGABRT`` to the whole process group), and the
test fails with those stacks instead of a bare ``TimeoutExpired``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

__all__ = ["run_bounded"]

_TAIL = 12_000  # characters of each stream in the failure message


def run_bounded(cmd: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = dict(kwargs.pop("env", None) or os.environ)
    env["PYTHONFAULTHANDLER"] = "1"  # stacks on SIGABRT, in every Python child too
    posix = sys.platform != "win32"
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=posix,  # its own process group: one signal reaches all
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if posix:
            os.killpg(proc.pid, signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
        else:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} did not finish within {timeout:g}s; the stacks of its "
            f"processes are at the end of its stderr.\n--- stdout ---\n{out[-_TAIL:]}\n"
            f"--- stderr ---\n{err[-_TAIL:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
