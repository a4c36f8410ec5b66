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

The complete marker lists every file with its size and CRC-32 (or the
file's own seal, see [Note: seals] in :mod:`._safetensors`) and is sealed
itself.  Loaders verify a checkpoint fsdp_wrap wrote unless asked not to
(``verify=False``): a missing marker (while the files carry seals), a marker
without its file list or an edited one is refused, naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from typing import Any

import fsdp_wrap.checkpoint._safetensors as _st

MARKER = "fsdp_wrap_checkpoint.json"
INCOMPLETE_SUFFIX = ".incomplete"


def temp_path(path: str) -> str:
    return path.rstrip(os.sep) + INCOMPLETE_SUFFIX


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` durably (temp file, fsync, rename)."""
    _write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def _write_bytes(path: str, raw: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(raw)
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


def commit(tmp: str, path: str, extra: dict[str, Any], seals: dict[str, int] | None = None,
           ) -> None:
    """Rank 0, after every rank reported success: mark complete and rename into place.

    The marker records each file's size and CRC-32 (read back once, from the
    page cache as a rule; for the files in ``seals``, which carry their own,
    that one), so that a loader can tell a damaged, truncated or swapped-in
    file from the one this save wrote (:func:`check_files`).  The marker is
    sealed itself (``_safetensors.sealed_json``): an edited one is refused."""
    marker = read_marker(tmp) or {}
    marker.update(extra)
    marker["files"] = file_checksums(tmp, seals or {})
    marker.update(complete=True, finished_at=time.time())
    marker.pop(_st.SEAL_KEY, None)
    raw, _ = _st.sealed_json(marker, metadata_key=None)
    _write_bytes(os.path.join(tmp, MARKER), raw)
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


# ------------------------------------------------------------------ checksums

_CHUNK = 16 * 2**20


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_checksums(directory: str, seals: dict[str, int]) -> dict[str, dict[str, int]]:
    """``{name: {"size": bytes, "crc32": int}}`` of every file the save wrote (the
    marker and the ranks' progress files aside); ``{"size", "seal"}`` for the
    files in ``seals`` (their own CRC-32, :mod:`._safetensors`), not read again."""
    out: dict[str, dict[str, int]] = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name == MARKER or name.startswith(".rank-") or not os.path.isfile(full):
            continue
        if name in seals:
            out[name] = {"size": os.path.getsize(full), "seal": seals[name]}
        else:
            out[name] = {"size": os.path.getsize(full), "crc32": _crc32(full)}
    return out


def check_files(directory: str, marker: dict[str, Any]) -> None:
    """Every file the marker lists is there, of its size and CRC-32 (or its own
    seal, the one the marker recorded); else a ``ValueError`` naming the file
    and what is wrong (nothing is read into any model before this passes)."""
    files = marker.get("files")
    if not isinstance(files, dict):
        raise ValueError(_unverifiable(directory, f"its {MARKER} lists no files"))
    fix = "it is damaged; load an earlier checkpoint (or save this one again)"
    for name, want in sorted(files.items()):
        full = os.path.join(directory, name)
        if not os.path.isfile(full):
            raise ValueError(f"checkpoint {directory} is damaged: {name} is missing; load an "
                             "earlier checkpoint (or save this one again)")
        size = os.path.getsize(full)
        if size != want.get("size"):
            raise ValueError(
                f"checkpoint {directory}: {name} holds {size} bytes but the save wrote "
                f"{want.get('size')} (truncated or replaced); {fix}"
            )
        if "seal" in want:
            seal = _st.read_seal(full)
            if seal != want["seal"]:
                raise ValueError(
                    f"checkpoint {directory}: {name} is not the file this save wrote (its seal "
                    f"{'none' if seal is None else f'{seal:08x}'}, recorded "
                    f"{int(want['seal']):08x}: a swapped-in or edited file); {fix}")
            _st.check_seal(full)
            continue
        crc = _crc32(full)
        if crc != want.get("crc32"):
            raise ValueError(
                f"checkpoint {directory}: {name} does not hold what the save wrote (CRC-32 "
                f"{crc:08x}, recorded {int(want.get('crc32', 0)):08x}: a damaged or swapped-in "
                f"file); {fix}"
            )


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


def _unverifiable(directory: str, what: str) -> str:
    return (f"checkpoint {directory} cannot be verified: {what} (edited, damaged, or written "
            "before fsdp_wrap recorded checksums), so a damaged file would load silently; "
            "load an earlier checkpoint, save this one again, or pass verify=False to load "
            "it unverified")


def check_marker_seal(directory: str) -> None:
    """The completion marker is the one the save sealed; else a ``ValueError``
    naming it."""
    path = os.path.join(directory, MARKER)
    try:
        sealed = _st.check_seal(path)
    except ValueError:
        raise ValueError(_unverifiable(directory, f"{path} is not the marker the save wrote "
                                       "(its seal does not match its contents)")) from None
    if not sealed:
        raise ValueError(_unverifiable(directory, f"{path} carries no seal"))


def check_unmarked(directory: str) -> None:
    """A directory without a completion marker: ``ValueError`` (naming the file)
    if any of its files was written by fsdp_wrap (it carries a seal), since the
    marker that says the save finished, and which files it wrote, is gone;
    nothing for foreign checkpoints (Hugging Face's, DCP's)."""
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full) and name.endswith((".safetensors", ".json")) \
                and _st.read_seal(full) is not None:
            raise ValueError(_unverifiable(
                directory, f"{name} was written by fsdp_wrap but the directory's completion "
                f"marker {MARKER} is missing"))


def check_sealed_files(directory: str) -> None:
    """Every file of ``directory`` that carries a seal matches it (a directory
    whose marker is gone, read by the offline tool: what can still be checked)."""
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full) and name.endswith((".safetensors", ".json")):
            _st.check_seal(full)


def check_complete(path: str, verify: bool = True) -> dict[str, Any]:
    """The marker of a complete checkpoint at ``path``; otherwise a clear ``ValueError``.

    ``path`` may name the final directory (absent after an interrupted save,
    which left ``path.incomplete``) or the ``.incomplete`` directory itself.
    ``verify`` (the default): the marker is the sealed one the save wrote and
    every file it lists is intact (:func:`check_files`); ``False`` only checks
    that the save finished.
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
    if verify:
        check_marker_seal(candidate)
        check_files(candidate, marker)
    return marker
