"""Full checkpoints straight to disk, in Hugging Face's safetensors layout.

:func:`save_full_checkpoint` writes the unwrapped model's state dict (clean
FQNs, full tensors) from rank 0 into ``model-0000x-of-0000n.safetensors`` +
``model.safetensors.index.json`` while the FULL state dict is being produced:
each FSDP unit's tensors go to disk as soon as the unit has been gathered to
rank 0 and are dropped before the next unit, so the model never exists whole
in any rank's memory.  The layout is planned (names, shapes, dtypes -> files
and offsets) before any tensor exists, which is what lets each tensor be
written the moment it arrives.  The save is atomic (see :mod:`._atomic`).

:func:`load_full_checkpoint` is its twin: every rank verifies the checkpoint
(complete, every tensor present with the right shape and dtype) before it
touches the model, then reads from disk only the bytes of its own shard of
each flat parameter (and the buffers).  No collective, no full tensor.

The files are plain safetensors: ``transformers``' ``from_pretrained``, the
``safetensors`` package, or ``fsdp-wrap ckpt`` read them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _compat
from .._layout import walk_unit_modules
from .._state_dict import FLAT_PARAM_KEY, clean_key
from ..api import FullStateDictConfig, StateDictType
from . import _atomic, _safetensors
from ._safetensors import Entry, ShardedWriter

if TYPE_CHECKING:
    from ..fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30

__all__ = ["save_full_checkpoint", "load_full_checkpoint", "DEFAULT_MAX_SHARD_SIZE"]


def _fsdp_cls() -> type[FSDP]:
    from ..fully_sharded_data_parallel import FullyShardedDataParallel

    return FullyShardedDataParallel


def _root(model: nn.Module, what: str) -> FSDP:
    cls = _fsdp_cls()
    if not isinstance(model, cls):
        raise TypeError(
            f"{what} expects the root fsdp_wrap FullyShardedDataParallel module but got "
            f"{type(model).__name__}; pass the model returned by FullyShardedDataParallel(...)"
        )
    model._lazy_init()
    if not model._is_root:
        raise ValueError(f"[rank {model.rank}] {what} expects the root FSDP module, not a nested unit")
    return model


# ------------------------------------------------------------------ the plan


def _units(model: FSDP) -> list[tuple[str, FSDP]]:
    cls = _fsdp_cls()
    return [(clean_key(n), m) for n, m in model.named_modules() if isinstance(m, cls)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def plan_entries(model: FSDP) -> dict[str, Entry]:
    """``{clean key: Entry}`` of the FULL state dict, from shapes alone (no collective).

    Flattened parameters (tied aliases included, as FULL state dicts hold
    them), parameters FSDP does not manage (ignored modules) and persistent
    buffers in their original dtype.
    """
    cls = _fsdp_cls()
    out: dict[str, Entry] = {}
    for unit_name, st in _units(model):
        h = st._handle
        managed: set[int] = set()
        if h is not None:
            managed = {id(info.param) for info in h.infos} | {id(h.flat_param)}
            for info in h.infos:
                key = _join(unit_name, clean_key(info.fqn))
                out[key] = Entry(key, tuple(info.shape), h.orig_dtype)
            for shared in h.shared:
                key = _join(unit_name, clean_key(shared.fqn))
                info = h.infos[shared.index]
                out[key] = Entry(key, tuple(info.shape), h.orig_dtype)
        for mod_fqn, mod in walk_unit_modules(st._fsdp_wrapped_module, lambda m: isinstance(m, cls)):
            rel_mod = clean_key(mod_fqn + "." if mod_fqn else "").rstrip(".")
            for n, p in mod._parameters.items():
                if p is None or id(p) in managed or n == FLAT_PARAM_KEY:
                    continue
                key = _join(unit_name, _join(rel_mod, n))
                out.setdefault(key, Entry(key, tuple(p.shape), p.dtype))
            for n, b in mod._buffers.items():
                if b is None or n in mod._non_persistent_buffers_set:
                    continue
                rel = _join(rel_mod, n)
                dtype = st._buffer_orig_dtypes.get(rel, b.dtype)
                key = _join(unit_name, rel)
                out.setdefault(key, Entry(key, tuple(b.shape), dtype))
    return out


# ---------------------------------------------------------------------- save


def save_full_checkpoint(
    model: nn.Module,
    path: str,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    extra_files: dict[str, str | bytes] | None = None,
    on_unit: Callable[[str, int, int], None] | None = None,
) -> None:
    """Write ``model``'s full state dict to ``path`` as Hugging Face safetensors, atomically.

    A collective: call it on every rank.  Rank 0 writes; each FSDP unit is
    gathered to rank 0 alone, written and dropped, so rank 0 holds its shard
    plus the copies of the units on the current nesting path (one unit for a
    flat stack of blocks) and the other ranks only send their shards.
    ``max_shard_size`` (bytes) bounds each ``.safetensors`` file.
    ``extra_files`` (name -> content) are written by rank 0 alongside, e.g.
    ``{"config.json": model.config.to_json_string()}`` so that ``transformers``'
    ``from_pretrained(path)`` loads the checkpoint.
    ``on_unit(unit_fqn, done, total)`` is called on every rank after each unit
    (progress reporting).  ``path`` appears only once every rank has finished
    and the files are flushed; until then the data lives in
    ``path + ".incomplete"``.
    """
    root = _root(model, "save_full_checkpoint")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"[rank {root.rank}] save_full_checkpoint: path must be a str, got {type(path).__name__}")
    path = os.fspath(path)
    if max_shard_size <= 0:
        raise ValueError(
            f"[rank {root.rank}] save_full_checkpoint: max_shard_size must be a positive number "
            f"of bytes, got {max_shard_size}"
        )
    rank = dist.get_rank()
    world = dist.get_world_size()
    entries = plan_entries(root)
    tmp = _atomic.temp_path(path)
    writer: ShardedWriter | None = None
    setup_error: BaseException | None = None
    if rank == 0:
        try:
            tmp = _atomic.begin(path, world, "full-safetensors", {"max_shard_size": max_shard_size})
            writer = ShardedWriter(tmp, list(entries.values()), max_shard_size, fsync=True)
            for name, content in (extra_files or {}).items():
                _write_extra(tmp, name, content)
        except (OSError, ValueError, TypeError) as e:
            setup_error = e
    # One small collective before the state-dict traversal: a rank 0 that could not
    # create the directory makes every rank raise instead of the others waiting.
    _agree(setup_error, rank, "save_full_checkpoint could not start")

    error: BaseException | None = None
    try:
        _stream_full_state_dict(root, writer, entries, on_unit)
        if writer is not None:
            writer.close()
    except BaseException as e:  # reported below, and re-raised
        error = e
        if writer is not None:
            writer.abort()
        _atomic.report(tmp, rank, e)
        raise
    _atomic.report(tmp, rank, None)
    _agree(error, rank, "save_full_checkpoint failed")
    commit_error: BaseException | None = None
    if rank == 0:
        try:
            total = sum(e.nbytes for e in entries.values())
            _atomic.commit(tmp, path, {"tensors": len(entries), "total_size": total})
        except OSError as e:
            commit_error = e
    _agree(commit_error, rank, "save_full_checkpoint could not finish")


def _write_extra(directory: str, name: str, content: str | bytes) -> None:
    if os.path.basename(name) != name or name in (_atomic.MARKER, "model.safetensors.index.json"):
        raise ValueError(f"extra_files: {name!r} must be a plain file name of your own")
    data = content.encode() if isinstance(content, str) else content
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _agree(error: BaseException | None, rank: int, what: str) -> None:
    """Every rank raises if any rank reports an error (one object all-gather)."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    bad = {r: e for r, e in enumerate(everyone) if e is not None}
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(bad.items()))
        if error is not None and rank in bad:
            raise RuntimeError(f"[rank {rank}] {what}: {detail}") from error
        raise RuntimeError(f"[rank {rank}] {what}: {detail}")


def _stream_full_state_dict(
    root: FSDP,
    writer: ShardedWriter | None,
    entries: dict[str, Entry],
    on_unit: Callable[[str, int, int], None] | None,
) -> None:
    """FULL ``state_dict()`` (rank0_only) whose values are written and dropped per unit.

    A post-hook on every unit runs after fsdp_wrap's own one: the keys still in
    the dict under that unit's prefix are its own (nested units already took
    theirs), so they are written and removed.
    """
    cls = _fsdp_cls()
    units = _units(root)
    total = len(units)
    done = [0]
    write_error: list[BaseException] = []

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            value = state_dict.pop(key)
            if writer is None or write_error:
                continue
            name = clean_key(key)
            try:
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"'{name}' is a {type(value).__name__}: safetensors holds tensors only"
                    )
                if name not in entries:
                    raise RuntimeError(f"'{name}' is in the state dict but was not planned")
                writer.write(name, value.to(entries[name].dtype))
            except BaseException as e:  # keep the collective traversal going; raise after
                write_error.append(e)
        done[0] += 1
        if on_unit is not None:
            on_unit(clean_key(prefix).rstrip("."), done[0], total)

    handles = [_compat.register_state_dict_post_hook(m, hook) for _, m in units]
    try:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with cls.state_dict_type(root, StateDictType.FULL_STATE_DICT, cfg):
            leftover = root.state_dict()
    finally:
        for h in handles:
            h.remove()
    if write_error:
        raise write_error[0]
    if leftover:
        raise RuntimeError(f"state dict keys outside every FSDP unit: {sorted(leftover)[:5]}")


# ---------------------------------------------------------------------- load


def verify_full_checkpoint(model: nn.Module, path: str, strict: bool = True) -> dict[str, Any]:
    """Check ``path`` against ``model`` without touching it; raise on the first mismatch.

    Complete (the marker says so and every file the index names is there and
    long enough), every tensor the model needs present with its shape and
    dtype, and (``strict``) nothing else.  Returns the stored tensors by name.
    """
    root = _root(model, "load_full_checkpoint")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if os.path.isdir(path) and _atomic.read_marker(path) is None:
        pass  # a safetensors directory from elsewhere (e.g. Hugging Face): no marker to check
    else:
        _atomic.check_complete(path)
    stored = _safetensors.stored_tensors(path)
    want = plan_entries(root)
    fix = "load a checkpoint saved from this model, or build the model the checkpoint was saved from"
    for name, e in want.items():
        st = stored.get(name)
        if st is None:
            raise KeyError(
                f"[rank {rank}] checkpoint {path} has no tensor '{name}' (expected {e.dtype} "
                f"{list(e.shape)}); {fix}"
            )
        if st.shape != e.shape:
            raise ValueError(
                f"[rank {rank}] checkpoint {path}: '{name}' has shape {list(st.shape)} but the "
                f"model expects {list(e.shape)}; {fix}"
            )
        if st.dtype != e.dtype:
            raise ValueError(
                f"[rank {rank}] checkpoint {path}: '{name}' is {st.dtype} but the model expects "
                f"{e.dtype}; convert the model (or the checkpoint) to one dtype first"
            )
    if strict:
        extra = [n for n in stored if n not in want]
        if extra:
            raise KeyError(
                f"[rank {rank}] checkpoint {path} holds {len(extra)} tensor(s) the model does not "
                f"have, first '{extra[0]}'; pass strict=False to ignore them"
            )
    return stored


def load_full_checkpoint(model: nn.Module, path: str, *, strict: bool = True) -> None:
    """Load a :func:`save_full_checkpoint` checkpoint (or a HF safetensors directory).

    Verifies first (see :func:`verify_full_checkpoint`), then each rank reads
    only its own shard of every flat parameter plus the buffers and unmanaged
    parameters.  No collective: every rank may call it independently, but all
    ranks should load the same checkpoint.
    """
    root = _root(model, "load_full_checkpoint")
    stored = verify_full_checkpoint(root, path, strict)
    cls = _fsdp_cls()
    files: dict[str, Any] = {}
    try:
        def fh(file: str) -> Any:
            if file not in files:
                files[file] = open(file, "rb")  # noqa: SIM115
            return files[file]

        with torch.no_grad():
            for unit_name, st in _units(root):
                h = st._handle
                managed: set[int] = set()
                if h is not None:
                    managed = {id(info.param) for info in h.infos} | {id(h.flat_param)}
                    h.invalidate_unsharded()
                    for i, info in enumerate(h.infos):
                        sl = h.param_shard_slice(i)
                        if sl is None:
                            continue
                        start = sl[0] + h.shard_offset - info.offset
                        s = stored[_join(unit_name, clean_key(info.fqn))]
                        piece = _safetensors.read_flat_range(s, start, sl[1] - sl[0], fh(s.file))
                        h.local_shard[sl[0] : sl[1]].copy_(piece)
                for mod_fqn, mod in walk_unit_modules(st._fsdp_wrapped_module, lambda m: isinstance(m, cls)):
                    rel_mod = clean_key(mod_fqn + "." if mod_fqn else "").rstrip(".")
                    tensors = [
                        (n, t) for n, t in mod._parameters.items()
                        if t is not None and id(t) not in managed and n != FLAT_PARAM_KEY
                    ] + [
                        (n, t) for n, t in mod._buffers.items()
                        if t is not None and n not in mod._non_persistent_buffers_set
                    ]
                    for n, t in tensors:
                        s = stored[_join(unit_name, _join(rel_mod, n))]
                        t.copy_(_safetensors.read_tensor(s, fh(s.file)))
    finally:
        for f in files.values():
            f.close()
