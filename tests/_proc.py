"""Run a command (the demo, a CLI, ``torchrun``) from a test, bounded in time.

:func:`run_bounded` is ``subprocess.run(..., capture_output=True, text=True)``
with one difference: when ``timeout`` passes, every Python process the command
started (``torchrun``'s agent and its ranks included) first dumps its stack
(``PYTHONFAULTHANDLER`` plus ``SIGABRT`` to its process group and to every
process below it, which reaches ``torchrun``'s ranks in their own sessions),
and the test fails with those stacks instead of a bare ``TimeoutExpired``.
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
            # torchrun starts each rank in a session of its own: signal them by pid too
            family = _descendants(proc.pid)
            _signal(proc.pid, family, signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                _signal(proc.pid, family + _descendants(proc.pid), signal.SIGKILL)
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


def _descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (read from /proc; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue  # /proc/self, /proc/meminfo ...
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _signal(pid: int, family: list[int], sig: int) -> None:
    """``sig`` to ``pid``'s process group and to each of ``family`` (gone ones skipped)."""
    for send, target in [(os.killpg, pid)] + [(os.kill, p) for p in family]:
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass
