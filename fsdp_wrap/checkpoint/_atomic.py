"""Atomic checkpoint directories: write under a temporary name, rename when complete.

A save into ``PATH`` writes everything into ``PATH.incomplete`` together with
a marker file (``fsdp_wrap_checkpoint.json``) that says ``"complete": false``.
Each rank that finishes its part leaves ``.rank-<r>.done`` there (where the
directory is visible to it); a rank that fails leaves ``.rank-<r>.failed``
with its error.  Only after every rank has reported success (a collective)
and the data is flushed (``fsync``) does rank 0 mark the directory complete,
fsync it, and rename it to ``PATH`` (``rename`` is atomic on POSIX file
systems).  So ``PATH`` either does not exist or is complete, and a save that
dies midway (a rank SIGKILLed) leaves the previous checkpoint untouched and
``PATH.incomplete`` behind, which every loader here rejects with a message
naming the rank that never finished and the last complete checkpoint next to
it.  The next save to ``PATH`` removes the stale ``PATH.incomplete``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

MARKER = "fsdp_wrap_checkpoint.json"
INCOMPLETE_SUFFIX = ".incomplete"


def temp_path(path: str) -> str:
    return path.rstrip(os.sep) + INCOMPLETE_SUFFIX


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` durably (temp file, fsync, rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_marker(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, MARKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
    except ValueError:
        return {"complete": False, "damaged": True}
    return data


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def begin(path: str, world_size: int, kind: str, extra: dict[str, Any]) -> str:
    """Rank 0: a fresh ``PATH.incomplete`` holding the not-yet-complete marker."""
    tmp = temp_path(path)
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    elif os.path.exists(tmp):
        os.remove(tmp)
    parent = os.path.dirname(os.path.abspath(tmp))
    os.makedirs(parent, exist_ok=True)
    os.makedirs(tmp)
    write_json(
        os.path.join(tmp, MARKER),
        {
            "writer": "fsdp_wrap",
            "kind": kind,
            "complete": False,
            "world_size": world_size,
            "started_at": time.time(),
            **extra,
        },
    )
    return tmp


def report(tmp: str, rank: int, error: BaseException | None) -> None:
    """Leave this rank's outcome in the temporary directory, if this rank can see it."""
    if not os.path.isdir(tmp):
        return  # not a shared file system: rank 0's collective check is what counts
    name = f".rank-{rank}.done" if error is None else f".rank-{rank}.failed"
    try:
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            if error is not None:
                f.write(f"{type(error).__name__}: {error}".splitlines()[0][:500])
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        pass


def commit(tmp: str, path: str, extra: dict[str, Any]) -> None:
    """Rank 0, after every rank reported success: mark complete and rename into place."""
    marker = read_marker(tmp) or {}
    marker.update(extra)
    marker.update(complete=True, finished_at=time.time())
    write_json(os.path.join(tmp, MARKER), marker)
    for name in os.listdir(tmp):
        if name.startswith(".rank-"):
            os.remove(os.path.join(tmp, name))
    fsync_dir(tmp)
    aside = None
    if os.path.exists(path):
        aside = f"{path}.replaced-{os.getpid()}"
        os.replace(path, aside)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# ------------------------------------------------------------------ checking


def incomplete_reason(directory: str, marker: dict[str, Any]) -> str:
    """Which ranks never finished, from the rank files of an incomplete directory."""
    if str(marker.get("kind", "")).startswith("convert"):
        return "the conversion writing it did not finish"
    ws = marker.get("world_size")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    done = {int(n.split("-")[1].split(".")[0]) for n in names if n.endswith(".done")}
    failed: dict[int, str] = {}
    for n in names:
        if n.startswith(".rank-") and n.endswith(".failed"):
            r = int(n.split("-")[1].split(".")[0])
            with open(os.path.join(directory, n), encoding="utf-8", errors="replace") as f:
                failed[r] = f.read().strip()
    if isinstance(ws, int):
        silent = [r for r in range(ws) if r not in done and r not in failed]
        parts = []
        if silent:
            who = "rank" if len(silent) == 1 else "ranks"
            parts.append(f"{who} {', '.join(map(str, silent))} never finished")
        for r, err in sorted(failed.items()):
            parts.append(f"rank {r} failed ({err})")
        if parts:
            return "; ".join(parts)
    return "the save did not finish"


def last_complete_sibling(path: str) -> str | None:
    """The most recently completed fsdp_wrap checkpoint next to ``path`` (not ``path``)."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    me = os.path.abspath(path).rstrip(os.sep)
    best: tuple[float, str] | None = None
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    for name in names:
        full = os.path.join(parent, name)
        if full in (me, temp_path(me)) or not os.path.isdir(full):
            continue
        marker = read_marker(full)
        if marker and marker.get("complete") and not name.endswith(INCOMPLETE_SUFFIX):
            when = float(marker.get("finished_at", 0.0))
            if best is None or when > best[0]:
                best = (when, full)
    return None if best is None else best[1]


def check_complete(path: str) -> dict[str, Any]:
    """The marker of a complete checkpoint at ``path``; otherwise a clear ``ValueError``.

    ``path`` may name the final directory (absent after an interrupted save,
    which left ``path.incomplete``) or the ``.incomplete`` directory itself.
    """
    candidate = path
    if not os.path.exists(path) and os.path.isdir(temp_path(path)):
        candidate = temp_path(path)
    if not os.path.exists(candidate):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    marker = read_marker(candidate)
    if marker is None:
        raise ValueError(
            f"{path} is not a checkpoint written by fsdp_wrap's full-checkpoint saver (no "
            f"{MARKER}); for other checkpoints use `fsdp-wrap ckpt inspect {path}`"
        )
    if not marker.get("complete") or candidate.endswith(INCOMPLETE_SUFFIX):
        last = last_complete_sibling(path[: -len(INCOMPLETE_SUFFIX)] if path.endswith(INCOMPLETE_SUFFIX) else path)
        tail = f"the last complete one is {last}" if last else "no complete checkpoint is next to it"
        raise ValueError(
            f"checkpoint {candidate} is incomplete: {incomplete_reason(candidate, marker)}; {tail}"
        )
    return marker
