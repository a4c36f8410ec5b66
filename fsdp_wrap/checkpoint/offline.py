"""Inspect, consolidate and convert checkpoints offline: no process group, CPU only.

Sources: a DCP directory (``.metadata`` + ``__<rank>_0.distcp``, as written by
torch's FSDP1 or fsdp_wrap with ``SHARDED_STATE_DICT``), a ``torch.save`` file
of full state dicts, or a Hugging Face safetensors directory.  Sinks: one
``torch.save`` file, a Hugging Face safetensors directory, or a DCP directory.

Every conversion streams: a tensor is read, written and dropped before the
next is read, so the peak is about the largest tensor, not the checkpoint
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` loads all of
it).  Full sources are memory-mapped, so writing them to DCP touches only
page cache.

A checkpoint is a tree of *leaves*: tensors and plain values at paths such as
``("model", "layers.0.weight")`` or ``("optim", "state", "layers.0.weight",
"exp_avg")``.  The ``model`` section is the part under a top-level ``model``
key (or the whole tree when there is neither a ``model`` nor an optimizer
key); the optimizer section is the part under ``optim``/``optimizer``.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import fsdp_wrap.checkpoint._atomic as _atomic
import fsdp_wrap.checkpoint._safetensors as _safetensors
from fsdp_wrap.checkpoint._memory import release_freed_memory
from fsdp_wrap.checkpoint._offline_sources import (
    Leaf,
    Source,
    open_source,
)
from fsdp_wrap.checkpoint._safetensors import Entry, ShardedWriter
from fsdp_wrap.checkpoint._torch_save import StreamingTorchSave

DEFAULT_MAX_SHARD = 5 * 2**30


def inspect(path: str, trust_pickle: bool = False) -> dict[str, Any]:
    """What a checkpoint is, as a JSON-able dict: no process group, nothing loaded but metadata.

    ``path`` is a DCP directory, a ``torch.save`` file or a Hugging Face
    safetensors directory.  The dict says which, who wrote it where that can
    be told, the world size it was saved at, the optimizer state present, the
    plain values, and every tensor with shape, dtype, bytes and chunk count
    (``fsdp-wrap ckpt inspect`` prints it; ``format_inspection`` makes the
    text).  ``torch.save`` files are read with ``weights_only=True`` unless
    ``trust_pickle``.  A damaged or foreign input raises ``ValueError`` naming
    what is wrong.
    """
    src = open_source(path, trust_pickle)
    try:
        tensors = [lf for lf in src.leaves if lf.shape is not None]
        kinds = {
            "dcp": "torch.distributed.checkpoint (DCP) directory, SHARDED_STATE_DICT",
            "torch": "torch.save file of full tensors",
            "safetensors": "Hugging Face safetensors (full tensors)",
        }
        sections = {s: [lf for lf in tensors if src.section(lf) == s] for s in ("model", "optim", "other")}
        optim_states = sorted({str(lf.path[-1]) for lf in sections["optim"]})
        return {
            "path": path,
            "format": kinds[src.kind],
            "written_by": src.writer or "unknown",
            "world_size": src.world_size,
            "tensors": len(tensors),
            "total_bytes": sum(lf.nbytes for lf in tensors),
            "model_tensors": len(sections["model"]),
            "model_bytes": sum(lf.nbytes for lf in sections["model"]),
            "optimizer_state": bool(sections["optim"]),
            "optimizer_states": optim_states,
            "optimizer_bytes": sum(lf.nbytes for lf in sections["optim"]),
            "other_values": [lf.name for lf in src.leaves if lf.shape is None],
            "notes": src.notes,
            "entries": [
                {
                    "name": lf.name,
                    "shape": list(lf.shape or ()),
                    "dtype": str(lf.dtype).replace("torch.", ""),
                    "bytes": lf.nbytes,
                    "chunks": lf.chunks,
                }
                for lf in tensors
            ],
        }
    finally:
        src.close()


def format_inspection(info: dict[str, Any], limit: int | None = 50) -> str:
    ws = info["world_size"]
    lines = [
        f"checkpoint:   {info['path']}",
        f"format:       {info['format']}",
        f"written by:   {info['written_by']}",
        "world size:   " + (str(ws) if ws else "n/a (full tensors: loads at any world size)"),
        f"tensors:      {info['tensors']}, {_human(info['total_bytes'])} "
        f"(model {info['model_tensors']}, {_human(info['model_bytes'])})",
        "optimizer:    " + (
            f"yes, {_human(info['optimizer_bytes'])} ({', '.join(info['optimizer_states'])})"
            if info["optimizer_state"] else "no"
        ),
    ]
    if info["other_values"]:
        lines.append("other values: " + ", ".join(info["other_values"]))
    lines.extend(f"note:         {n}" for n in info["notes"])
    entries = info["entries"]
    shown = entries if limit is None else entries[:limit]
    if shown:
        width = min(70, max(len(e["name"]) for e in shown))
        lines.append("")
        lines.append(f"{'name':<{width}}  {'shape':<20} {'dtype':<9} {'bytes':>10} chunks")
        for e in shown:
            shape = "x".join(str(s) for s in e["shape"]) or "()"
            lines.append(
                f"{e['name']:<{width}}  {shape:<20} {e['dtype']:<9} {_human(e['bytes']):>10} {e['chunks']:>6}"
            )
        if len(shown) < len(entries):
            lines.append(f"... {len(entries) - len(shown)} more (--all lists every tensor)")
    return "\n".join(lines)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


# ------------------------------------------------------------------ progress


class Progress:
    """A one-line progress bar on stderr (bytes done of total)."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled, self.done = label, max(total, 1), enabled, 0

    def step(self, nbytes: int) -> None:
        self.done += nbytes
        if self.enabled:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(30 * frac)
            sys.stderr.write(
                f"\r{self.label}: [{bar:<30}] {100 * frac:5.1f}% "
                f"{_human(self.done)} / {_human(self.total)}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ------------------------------------------------------------------- convert


def convert(
    src_path: str,
    out: str,
    fmt: str | None = None,
    include_optim: bool = True,
    max_shard_size: int = DEFAULT_MAX_SHARD,
    progress: bool = False,
    trust_pickle: bool = False,
) -> str:
    """Write ``src_path`` as ``fmt`` (``"torch"``, ``"safetensors"`` or ``"dcp"``) at ``out``.

    The default format is ``"torch"`` for a DCP source and ``"dcp"`` otherwise.
    Streams: one tensor is read, written and freed before the next, so the
    peak memory is about the largest tensor, not the checkpoint.  A full
    checkpoint converted to DCP holds each tensor as one chunk and resumes at
    any world size through the SHARDED recipe.  ``include_optim=False``
    leaves the optimizer state out; ``max_shard_size`` (bytes) bounds each
    safetensors file.  Output goes to ``out + ".incomplete"`` and is
    renamed when complete (a directory carries fsdp_wrap's completeness
    marker); an existing ``out`` raises ``FileExistsError``.
    Returns a one-line summary.  No process group needed.
    """
    src = open_source(src_path, trust_pickle)
    try:
        fmt = fmt or ("torch" if src.kind == "dcp" else "dcp")
        if fmt not in ("torch", "safetensors", "dcp"):
            raise ValueError(f"unknown output format {fmt!r}: use torch, safetensors or dcp")
        if any("LOCAL_STATE_DICT" in n for n in src.notes):
            raise ValueError(
                f"{src_path} is a LOCAL_STATE_DICT checkpoint (flat shards per FSDP unit); only "
                "SHARDED_STATE_DICT checkpoints can be consolidated. Save with SHARDED_STATE_DICT."
            )
        if os.path.exists(out):
            raise FileExistsError(f"{out} already exists; remove it or choose another output path")
        leaves = [
            lf for lf in src.leaves if include_optim or src.section(lf) != "optim"
        ]
        total = sum(lf.nbytes for lf in leaves)
        bar = Progress(f"{fmt} <- {src.kind}", total, progress)
        # Written under OUT.incomplete, renamed when complete (a directory as
        # the full save does it: _atomic's marker says "complete": false until
        # then); a process killed midway leaves nothing any loader accepts.
        tmp = _atomic.temp_path(out)
        try:
            if fmt == "torch":
                _remove(tmp)
                _write_torch(tmp, leaves, bar)
                os.replace(tmp, out)
                _atomic.fsync_dir(os.path.dirname(os.path.abspath(out)))
            else:
                tmp = _atomic.begin(out, 1, f"convert-{fmt}", {"source": src_path})
                if fmt == "safetensors":
                    _write_safetensors(tmp, src, leaves, max_shard_size, bar)
                else:
                    _write_dcp(tmp, src, leaves, bar)
                _atomic.commit(tmp, out, {"tensors": sum(1 for lf in leaves if lf.shape)})
        except BaseException:
            _remove(tmp)
            raise
        finally:
            bar.close()
        n = sum(1 for lf in leaves if lf.shape is not None)
        return f"wrote {out} ({fmt}): {n} tensors, {_human(total)}"
    finally:
        src.close()


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def consolidate(dcp_dir: str, out: str, fmt: str = "torch", **kwargs: Any) -> str:
    """A DCP directory to one ``torch.save`` file or a HF safetensors directory, streaming.

    :func:`convert` with a DCP source: ``fmt="torch"`` writes the nested
    dict a FULL save gives (``{"model": {...}, "optim": {...}, ...}``),
    ``fmt="safetensors"`` a Hugging Face directory (model and optimizer
    files with their indexes).  ``kwargs`` are :func:`convert`'s.  Example::

        consolidate("ckpt/step-1000", "full.pt")     # then torch.load("full.pt")
    """
    import fsdp_wrap.checkpoint._dcp as _dcp  # (DCP's import: only when it is used)

    if not _dcp.is_dcp_dir(dcp_dir):
        if os.path.isdir(dcp_dir) or not os.path.exists(dcp_dir):
            _dcp.read_metadata(dcp_dir)  # raises the precise error
        raise ValueError(f"{dcp_dir} is not a DCP directory; use `convert` for other formats")
    if fmt == "dcp":
        raise ValueError("consolidate writes torch or safetensors; use `convert` for DCP output")
    return convert(dcp_dir, out, fmt=fmt, **kwargs)


def _write_torch(path: str, leaves: Sequence[Leaf], bar: Progress) -> None:
    writer = StreamingTorchSave(path)
    skeleton: dict[Any, Any] = {}
    of_placeholder: dict[int, Leaf] = {}
    for lf in leaves:
        if lf.shape is not None and lf.dtype is not None:
            ph = writer.placeholder(lf.shape, lf.dtype)
            of_placeholder[id(ph)] = lf
            _set(skeleton, lf.path, ph)
        else:
            _set(skeleton, lf.path, lf.load())
    obj = skeleton[""] if list(skeleton) == [""] else _lists(skeleton)
    for ph in writer.write_skeleton(obj):
        lf = of_placeholder[id(ph)]
        writer.fill(lf.load())
        release_freed_memory()
        bar.step(lf.nbytes)
    writer.finish(fsync=True)


def _set(root: dict[Any, Any], path: Sequence[Any], value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _lists(obj: Any) -> Any:
    """Turn dicts keyed 0..n-1 (DCP's flattened lists) back into lists."""
    if isinstance(obj, dict):
        fixed = {_index(k): _lists(v) for k, v in obj.items()}
        if fixed and all(isinstance(k, int) for k in fixed) and sorted(fixed) == list(range(len(fixed))):
            return [fixed[i] for i in range(len(fixed))]
        return fixed
    return obj


def _index(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _write_safetensors(
    directory: str, src: Source, leaves: Sequence[Leaf], max_shard: int, bar: Progress
) -> None:
    for section, prefix in (("model", "model"), ("optim", "optimizer")):
        chosen = [lf for lf in leaves if src.section(lf) == section]
        tensors = [lf for lf in chosen if lf.shape is not None and lf.dtype is not None]
        if not tensors:
            continue
        names = {
            id(lf): src.model_name(lf) if section == "model" else ".".join(str(p) for p in lf.path[1:])
            for lf in tensors
        }
        objects: dict[Any, Any] = {}
        for lf in chosen:
            if lf.shape is None:
                _set(objects, [str(p) for p in lf.path[1:]], _jsonable(lf.load(), lf.name))
        objects = _lists(objects)
        entries = [Entry(names[id(lf)], tuple(lf.shape or ()), lf.dtype) for lf in tensors if lf.dtype]
        writer = ShardedWriter(
            directory, entries, max_shard, prefix=prefix, fsync=True,
            index_metadata={"objects": objects} if objects else None,
        )
        try:
            for lf in tensors:
                writer.write(names[id(lf)], lf.load())
                release_freed_memory()
                bar.step(lf.nbytes)
            writer.close()
        finally:
            writer.abort()


def _jsonable(value: Any, name: str) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError as e:
        raise ValueError(
            f"'{name}' ({type(value).__name__}) cannot be stored in a safetensors index; "
            "write --format torch instead"
        ) from e


def _write_dcp(directory: str, src: Source, leaves: Sequence[Leaf], bar: Progress) -> None:
    """Full tensors to DCP (one chunk each; DCP reshards them for any world size on load)."""
    import torch.distributed.checkpoint as dcp

    state: dict[Any, Any] = {}
    for lf in leaves:
        value = _mapped(lf, src) if lf.shape is not None else lf.load()
        _set(state, lf.path, value)
    obj = _lists(state)
    if not isinstance(obj, dict) or "" in obj:
        raise ValueError(f"{src.path} holds a bare {type(obj).__name__}, not a dict of state")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.save(obj, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    bar.step(sum(lf.nbytes for lf in leaves))


def _mapped(lf: Leaf, src: Source) -> torch.Tensor:
    """A memory-mapped view where the source allows it (torch.save mmap, safetensors)."""
    if lf.stored is not None:
        return _map_stored(lf.stored, src)
    result: torch.Tensor = lf.load()
    return result


def _map_stored(st: _safetensors.StoredTensor, src: Source) -> torch.Tensor:
    cache = src.__dict__.setdefault("_maps", {})
    if st.file not in cache:
        f = open(st.file, "rb")  # noqa: SIM115  (closed by Source.close)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        cache[st.file] = mm
        src.closers.append(f.close)
    mm = cache[st.file]
    itemsize = torch.empty((), dtype=st.dtype).element_size()
    if st.nbytes == 0 or st.begin % itemsize:
        return _safetensors.read_tensor(st)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=st.nbytes, offset=st.begin)
    return flat.view(st.dtype).reshape(st.shape)
