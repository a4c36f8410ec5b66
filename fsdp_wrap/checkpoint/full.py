"""Full checkpoints straight to disk, in Hugging Face's safetensors layout.

:func:`save_full_checkpoint` writes the unwrapped model's state dict (clean
FQNs, full tensors) from rank 0 into ``model-0000x-of-0000n.safetensors`` +
``model.safetensors.index.json``, the same tensors a FULL state dict holds.
Nothing is gathered: each original parameter travels to rank 0 in windows of
bounded size (the ranks holding a window's elements send exactly those, point
to point) and each window is written at its place in the file before the next
arrives, so the model, and even a whole unit, never exists in any rank's
memory.  The layout is planned (names, shapes, dtypes -> files and offsets)
before any tensor exists, which is what lets each window be written the moment
it arrives.  The save is atomic (see :mod:`._atomic`).

:func:`load_full_checkpoint` is its twin: every rank verifies the checkpoint
(complete, every tensor present with the right shape and dtype) before it
touches the model, then reads from disk only the bytes of its own shard of
each flat parameter (and the buffers).  No collective, no full tensor.

The files are plain safetensors: ``transformers``' ``from_pretrained``, the
``safetensors`` package, or ``fsdp-wrap ckpt`` read them.

``save_full_checkpoint(..., trainable_only=True)`` is an adapter checkpoint:
only the parameters that train (their flat parameter and the original
parameter require a gradient) are planned and streamed, so frozen bytes never
leave their ranks and buffers are not written.  When the wrapped model is a
``peft`` model (LoRA) the files are PEFT's own, ``adapter_model.safetensors``
under PEFT's key names and ``adapter_config.json``, which
``PeftModel.from_pretrained(base, path)`` loads (:mod:`._adapter`); otherwise
the trainable tensors under their clean names in the layout above.  Every
rank must train the same parameters: one small collective checks it before
anything moves and raises on every rank when they differ or nothing trains.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.checkpoint._adapter as _adapter
import fsdp_wrap.checkpoint._atomic as _atomic
import fsdp_wrap.checkpoint._full_optim as _full_optim
import fsdp_wrap.checkpoint._safetensors as _safetensors
import fsdp_wrap.checkpoint._two_d as _two_d
from fsdp_wrap.checkpoint._safetensors import Entry, ShardedWriter
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.handle.layout import walk_unit_modules
from fsdp_wrap.runtime.names import clean_fqn

if TYPE_CHECKING:
    from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
DEFAULT_WINDOW_BYTES = 64 * 2**20  # what rank 0 receives and writes at a time

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "DEFAULT_WINDOW_BYTES",
    "load_full_checkpoint",
    "save_full_checkpoint",
    "verify_full_checkpoint",
]


def _fsdp_cls() -> type[FSDP]:
    from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel

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
        raise ValueError(f"[rank {global_rank()}] {what} expects the root FSDP module, not a nested unit")
    return model


# ------------------------------------------------------------------ the plan


def _units(model: FSDP) -> list[tuple[str, FSDP]]:
    cls = _fsdp_cls()
    return [(clean_fqn(n), m) for n, m in model.named_modules() if isinstance(m, cls)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def plan_entries(model: FSDP, trainable_only: bool = False) -> dict[str, Entry]:
    """``{clean key: Entry}`` of the FULL state dict, from shapes alone (no collective).

    Flattened parameters (tied aliases included, as FULL state dicts hold
    them), parameters FSDP does not manage (ignored modules) and persistent
    buffers in their original dtype.  ``trainable_only``: the parameters that
    train (see :func:`_trains`), no buffers.
    """
    out: dict[str, Entry] = {}
    for unit_name, st in _units(model):
        for h in st._handles:
            for i, info in enumerate(h.infos):
                if trainable_only and not _trains(h, i):
                    continue
                shape = info.spec.shape if info.spec is not None else info.shape  # (whole)
                for key in _names(h, unit_name, i):
                    out[key] = Entry(key, tuple(shape), h.orig_dtype)
        for key, t, dtype in _unmanaged_tensors(unit_name, st, trainable_only):
            out.setdefault(key, Entry(key, tuple(t.shape), dtype))
    return out


def _trains(h: Any, index: int) -> bool:
    """Parameter ``index`` of handle ``h`` trains: its flat parameter requires a gradient
    and so does the original parameter (frozen after wrapping with ``use_orig_params``)."""
    return bool(h.flat_param.requires_grad and h.infos[index].param.requires_grad)


# ---------------------------------------------------------------------- save


def save_full_checkpoint(
    model: nn.Module,
    path: str,
    optim: torch.optim.Optimizer | None = None,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    extra_files: dict[str, str | bytes] | None = None,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    on_unit: Callable[[str, int, int], None] | None = None,
    trainable_only: bool = False,
) -> None:
    """Write ``model``'s full state dict to ``path`` as Hugging Face safetensors, atomically.

    A collective: call it on every rank.  Rank 0 writes.  Each original
    parameter is moved to rank 0 in windows of at most ``window_bytes``: the
    ranks holding a window's elements send exactly those (point to point),
    rank 0 writes the window at its place in the file and reuses the buffer.
    So rank 0 holds its shard plus one window, whatever the size of the units,
    and every other rank sends its own shard once.  ``max_shard_size`` (bytes,
    default 5 GiB) bounds each ``.safetensors`` file.  ``extra_files`` (name -> content) are
    written alongside, e.g. ``{"config.json": model.config.to_json_string()}``
    so that ``transformers``' ``from_pretrained(path)`` loads the checkpoint.
    ``on_unit(unit_fqn, done, total)`` is called on every rank after each unit
    (progress reporting).  With ``optim``, its state is written too
    (``optimizer-*.safetensors``): built as the
    SHARDED optimizer state dict (nothing gathered; each rank holds a copy of
    its own share) and streamed to rank 0 the same way.  ``path`` appears only
    once every rank has finished
    and the files are flushed; until then the data lives in
    ``path + ".incomplete"``.

    ``trainable_only=True``: only the parameters that train, nothing frozen
    moved or written (an adapter checkpoint, in PEFT's own layout for a
    ``peft`` model; see the module's docstring); not with ``optim``.
    """
    root = _root(model, "save_full_checkpoint")
    path = _check_save_args(path, max_shard_size, window_bytes, trainable_only, optim)
    _two_d.refuse_optim(root, optim, "save_full_checkpoint")
    rank = dist.get_rank()
    world = dist.get_world_size()
    entries = plan_entries(root, trainable_only)
    rename, target = _agree_trainable(root, entries, rank) if trainable_only else ({}, None)
    osd = _full_optim.sharded_state(root, optim) if optim is not None else None
    tmp = _atomic.temp_path(path)
    writer: ShardedWriter | None = None
    optim_writer: ShardedWriter | None = None
    setup_error: BaseException | None = None
    if rank == 0:
        try:
            kind = "full-safetensors" if not trainable_only else (
                "adapter-safetensors" if target is not None else "trainable-safetensors")
            tmp = _atomic.begin(path, world, kind, {"max_shard_size": max_shard_size})
            writer = _model_writer(tmp, entries, max_shard_size, rename, target)
            if osd is not None:
                optim_entries, objects = _full_optim.plan(osd)
                optim_writer = ShardedWriter(
                    tmp, optim_entries, max_shard_size, prefix=_full_optim.PREFIX, fsync=True,
                    index_metadata={"objects": objects},
                )
            for name, content in (extra_files or {}).items():
                _write_extra(tmp, name, content)
        except (OSError, ValueError, TypeError) as e:
            setup_error = e
    # One small collective before any data moves: a rank 0 that could not create
    # the directory makes every rank raise instead of the others waiting.
    _agree(setup_error, rank, "save_full_checkpoint could not start")

    sink = _Sink(writer, rename)
    optim_sink = _Sink(optim_writer)
    try:
        _stream_units(root, sink, window_bytes, on_unit, trainable_only)
        if osd is not None:
            _full_optim.stream(root, osd, optim_sink, window_bytes)
            del osd
        for w, ws in ((writer, sink), (optim_writer, optim_sink)):
            if w is not None and sink.error is None and optim_sink.error is None:
                ws.run(w.close)
    except BaseException as e:  # a collective broke (a rank died): nothing to agree on
        for w in (writer, optim_writer):
            if w is not None:
                w.abort()
        _atomic.report(tmp, rank, e)
        raise
    for w in (writer, optim_writer):
        if w is not None:
            w.abort()
    sink.error = sink.error or optim_sink.error
    _atomic.report(tmp, rank, sink.error)
    # rank 0's write errors were held back so that the others could finish sending
    _agree(sink.error, rank, "save_full_checkpoint failed")
    commit_error: BaseException | None = None
    if rank == 0:
        try:
            total = sum(e.nbytes for e in entries.values())
            seals = {k: v for w in (writer, optim_writer) if w is not None
                     for k, v in w.seals.items()}
            _atomic.commit(tmp, path, {"tensors": len(entries), "total_size": total}, seals)
        except OSError as e:
            commit_error = e
    _agree(commit_error, rank, "save_full_checkpoint could not finish")



def _check_save_args(path: Any, max_shard_size: int, window_bytes: int, trainable_only: bool,
                     optim: torch.optim.Optimizer | None) -> str:
    """Arguments every rank checks alike, before anything else (no collective)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"[rank {global_rank()}] save_full_checkpoint: path must be a str, got {type(path).__name__}")
    for what, value in (("max_shard_size", max_shard_size), ("window_bytes", window_bytes)):
        if value <= 0:
            raise ValueError(
                f"[rank {global_rank()}] save_full_checkpoint: {what} must be a positive number "
                f"of bytes, got {value}"
            )
    if trainable_only and optim is not None:
        raise ValueError(
            f"[rank {global_rank()}] save_full_checkpoint: trainable_only=True saves the model's "
            "trainable weights only; save the optimizer with the full checkpoint "
            "(trainable_only=False) or with FSDP.optim_state_dict"
        )
    return os.fspath(path)


def _model_writer(tmp: str, entries: dict[str, Entry], max_shard_size: int, rename: dict[str, str],
                  target: _adapter.PeftTarget | None) -> ShardedWriter:
    """Rank 0: the model's files, planned; PEFT's adapter layout for a PEFT model's
    trainable weights (its config written first)."""
    if target is None:
        return ShardedWriter(tmp, list(entries.values()), max_shard_size, fsync=True)
    planned = [Entry(rename[e.name], e.shape, e.dtype) for e in entries.values()]
    writer = ShardedWriter(tmp, planned, max_shard_size, fsync=True,
                           single_file=_adapter.ADAPTER_WEIGHTS)
    _adapter.write_adapter_config(tmp, target)
    return writer


class _Sink:
    """Rank 0's writes; the first error is kept (and later writes skipped) so that the
    other ranks, which are sending, are never left waiting."""

    def __init__(self, writer: ShardedWriter | None, rename: dict[str, str] | None = None) -> None:
        self.writer = writer
        self.rename = rename or {}
        self.error: BaseException | None = None

    def run(self, fn: Callable[[], Any]) -> None:
        if self.error is None:
            try:
                fn()
            except (OSError, ValueError, RuntimeError, TypeError) as e:
                self.error = e

    def write(self, name: str, offset: int, flat: torch.Tensor) -> None:
        if self.writer is not None:
            writer = self.writer
            key = self.rename.get(name, name)
            self.run(lambda: writer.write_range(key, offset, flat))


def _stream_units(
    root: FSDP,
    sink: _Sink,
    window_bytes: int,
    on_unit: Callable[[str, int, int], None] | None,
    trainable_only: bool = False,
) -> None:
    units = _units(root)
    for done, (unit_name, st) in enumerate(units, start=1):
        for h in st._handles:
            chosen = [i for i in range(len(h.infos)) if not trainable_only or _trains(h, i)]
            if chosen and _two_d.has_dtensors(h):  # (2-D: gathered whole, see _two_d)
                _two_d.stream_handle(h, chosen, lambda i: _names(h, unit_name, i),  # noqa: B023
                                     None if sink.writer is None else
                                     lambda name, flat: sink.write(name, 0, flat))
            elif chosen:
                _stream_handle(h, unit_name, sink, window_bytes, chosen)
        if sink.writer is not None:
            for name, tensor, dtype in _unmanaged_tensors(unit_name, st, trainable_only):
                flat = tensor.detach().to(dtype).reshape(-1)
                sink.write(name, 0, flat)
        if on_unit is not None:
            on_unit(unit_name, done, len(units))


def _stream_handle(h: Any, unit_name: str, sink: _Sink, window_bytes: int,
                   chosen: list[int]) -> None:
    """Move original parameters ``chosen`` of ``h`` to global rank 0 window by window
    (the others' elements stay where they are)."""
    pg = h.process_group
    ws = h.world_size
    members = [dist.get_global_rank(pg, r) for r in range(ws)]
    if 0 not in members:
        return  # another replica (hybrid sharding): rank 0's own group holds every shard
    dest = members.index(0)
    me = h.rank
    shard = h.local_shard
    if not h.uses_sharded_strategy:  # NO_SHARD: rank 0 holds everything itself
        if me == dest:
            for i in chosen:
                info = h.infos[i]
                flat = shard[info.offset : info.offset + info.numel]
                for name in _names(h, unit_name, i):
                    sink.write(name, 0, flat)
        return
    S = h.shard_numel
    window = max(1, window_bytes // shard.element_size())
    largest = max((h.infos[i].numel for i in chosen), default=1)
    buf = torch.empty(min(window, largest), dtype=shard.dtype, device=shard.device) if me == dest else None
    for i in chosen:
        info = h.infos[i]
        names = _names(h, unit_name, i)
        for w0 in range(0, info.numel, window):
            w1 = min(info.numel, w0 + window)
            a, b = info.offset + w0, info.offset + w1
            holders = range(a // S, (b - 1) // S + 1)
            if buf is not None:
                out = buf[: w1 - w0]
                for r in holders:
                    lo, hi = max(a, r * S), min(b, (r + 1) * S)
                    piece = out[lo - a : hi - a]
                    if r == me:
                        piece.copy_(shard[lo - me * S : hi - me * S])
                    else:
                        dist.recv(piece, src=members[r], group=pg)
                for name in names:
                    sink.write(name, w0, out)
            elif me in holders:
                lo, hi = max(a, me * S), min(b, (me + 1) * S)
                dist.send(shard[lo - me * S : hi - me * S], dst=0, group=pg)


def _names(h: Any, unit_name: str, index: int) -> list[str]:
    """The clean keys of parameter ``index`` of ``h``: itself and its tied aliases."""
    names = [_join(unit_name, clean_fqn(h.infos[index].fqn))]
    names += [_join(unit_name, clean_fqn(s.fqn)) for s in h.shared if s.index == index]
    return names


def _unmanaged_tensors(unit_name: str, st: FSDP, trainable_only: bool = False,
                       ) -> list[tuple[str, torch.Tensor, torch.dtype]]:
    """Persistent buffers (in their original dtype) and parameters FSDP does not manage
    of the modules this unit owns: every rank holds them whole.  ``trainable_only``:
    the parameters that require a gradient, no buffers."""
    cls = _fsdp_cls()
    managed = {id(i.param) for h in st._handles for i in h.infos}
    managed |= {id(h.flat_param) for h in st._handles}
    flat_names = {h.flat_name for h in st._handles}
    out: list[tuple[str, torch.Tensor, torch.dtype]] = []
    for mod_fqn, mod in walk_unit_modules(st._fsdp_wrapped_module, lambda m: isinstance(m, cls)):
        rel_mod = clean_fqn(mod_fqn + "." if mod_fqn else "").rstrip(".")
        for n, p in mod._parameters.items():
            if p is not None and id(p) not in managed and n not in flat_names:
                if p.requires_grad or not trainable_only:
                    out.append((_join(unit_name, _join(rel_mod, n)), p, p.dtype))
        if trainable_only:
            continue
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                rel = _join(rel_mod, n)
                out.append((_join(unit_name, rel), b, st._buffer_orig_dtypes.get(rel, b.dtype)))
    return out


def _write_extra(directory: str, name: str, content: str | bytes) -> None:
    reserved = (_atomic.MARKER, "model.safetensors.index.json", _adapter.ADAPTER_WEIGHTS,
                _adapter.ADAPTER_CONFIG)
    if os.path.basename(name) != name or name in reserved:
        raise ValueError(f"extra_files: {name!r} must be a plain file name of your own")
    data = content.encode() if isinstance(content, str) else content
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _agree_trainable(root: FSDP, entries: dict[str, Entry], rank: int,
                     ) -> tuple[dict[str, str], _adapter.PeftTarget | None]:
    """What an adapter save writes (``{clean key: file key}``, the PEFT model if any),
    agreed by every rank before anything moves: one object all-gather of each rank's
    trainable names and error; a rank differing, or nothing trainable anywhere, raises
    on every rank."""
    cls = _fsdp_cls()
    rename: dict[str, str] = {}
    target: _adapter.PeftTarget | None = None
    error: Exception | None = None
    try:
        named = [(clean_fqn(n + "." if n else "").rstrip("."), m)
                 for n, m in root.named_modules() if not isinstance(m, cls)]
        target = _adapter.find_peft(named)
        if target is not None:
            rename = _adapter.adapter_key_map(target, list(entries), rank)
    except (ValueError, NotImplementedError, ImportError) as e:
        error = e
    everyone: list[Any] = [None] * dist.get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(everyone, (sorted(entries), mine))
    if error is not None:
        raise error  # (every rank raises: the others see it below)
    errors = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if errors:
        raise ValueError(f"[rank {rank}] save_full_checkpoint(trainable_only=True) failed on "
                         f"rank {errors[0][0]}: {errors[0][1]}")
    names = [n for n, _ in everyone]
    if not any(names):
        raise ValueError(
            f"[rank {rank}] save_full_checkpoint(trainable_only=True): no parameter of the model "
            "requires a gradient, so there is nothing to save; unfreeze the weights you train "
            "(requires_grad_(True)) or save the whole model (trainable_only=False)"
        )
    for r, theirs in enumerate(names):
        if theirs != names[0]:
            diff = sorted(set(theirs) ^ set(names[0]))
            raise ValueError(
                f"[rank {rank}] save_full_checkpoint(trainable_only=True): ranks 0 and {r} train "
                f"different parameters ({len(names[0])} vs {len(theirs)}, first difference "
                f"'{diff[0] if diff else ''}'); freeze and unfreeze the same parameters on every rank"
            )
    return rename, target


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


# ---------------------------------------------------------------------- load


def verify_full_checkpoint(model: nn.Module, path: str, strict: bool = True, *,
                           verify: bool = True) -> dict[str, Any]:
    """Check ``path`` against ``model`` without touching it; raise on the first mismatch.

    Complete (the marker says so, every file it lists is there with the size
    and CRC-32 the save recorded, and every file the index names is there and
    long enough), every tensor the model needs present with its shape and
    dtype (a tied parameter under any one of its names), and (``strict``)
    nothing else.  Returns the stored tensors by name.

    A checkpoint fsdp_wrap wrote is always verified: a completion marker that
    is missing (while the files say fsdp_wrap wrote them), edited, or lists no
    files is refused with a ``ValueError`` naming it.  ``verify=False`` loads
    such a checkpoint unverified (no marker seal, no CRC-32; an unfinished save
    is still refused).  Checkpoints written elsewhere (Hugging Face's
    ``save_pretrained``) carry no marker and are read as they are.
    """
    root = _root(model, "load_full_checkpoint")
    rank = global_rank()
    if os.path.isdir(path) and _atomic.read_marker(path) is None:
        # a safetensors directory from elsewhere (e.g. Hugging Face): no marker to
        # check, unless its files say fsdp_wrap wrote them
        if verify:
            _atomic.check_unmarked(path)
    else:
        _atomic.check_complete(path, verify)
    stored = _safetensors.stored_tensors(path)
    want = plan_entries(root)
    fix = "load a checkpoint saved from this model, or build the model the checkpoint was saved from"
    # A tied parameter may be stored under any one of its names (Hugging Face's
    # save_pretrained keeps one): the others then read from it.
    for names in _tied_groups(root):
        present = [n for n in names if n in stored]
        for n in names:
            if n not in stored and present:
                stored[n] = stored[present[0]]
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


def _tied_groups(root: FSDP) -> list[list[str]]:
    """The clean names of every flattened parameter that has tied aliases."""
    groups = []
    for unit_name, st in _units(root):
        for h in st._handles:
            for index in sorted({s.index for s in h.shared}):
                groups.append(_names(h, unit_name, index))
    return groups


def load_full_checkpoint(
    model: nn.Module,
    path: str,
    optim: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
) -> None:
    """Load a :func:`save_full_checkpoint` checkpoint (or a HF safetensors directory).

    Verifies first (see :func:`verify_full_checkpoint`; ``verify=False`` skips
    the checksums of a checkpoint fsdp_wrap wrote), then each rank reads
    only its own shard of every flat parameter plus the buffers and unmanaged
    parameters.  No collective (beyond fsdp_wrap's one-time lazy initialisation
    if the model has not run yet); all ranks should load the same checkpoint.
    With ``optim`` (then a collective), the optimizer state is checked against
    the model before anything is touched, each rank reads the rows of its own
    chunks, and ``optim_state_dict_to_load`` moves them into the flat shards.
    """
    root = _root(model, "load_full_checkpoint")
    _two_d.refuse_optim(root, optim, "load_full_checkpoint")
    stored = verify_full_checkpoint(root, path, strict, verify=verify)
    optim_stored: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    if optim is not None:
        rank = global_rank()
        shapes = {name: e.shape for name, e in plan_entries(root).items()}
        optim_stored, objects = _full_optim.check(path, shapes, rank)
    files: dict[str, Any] = {}
    try:
        def fh(file: str) -> Any:
            if file not in files:
                files[file] = open(file, "rb")  # noqa: SIM115
            return files[file]

        with torch.no_grad():
            for unit_name, st in _units(root):
                for h in st._handles:
                    h.invalidate_unsharded()
                    for i, info in enumerate(h.infos):
                        sl = h.param_shard_slice(i)
                        if info.spec is not None:  # (a DTensor parameter: read whole)
                            s = stored[_join(unit_name, clean_fqn(info.fqn))]
                            _two_d.load_param(h, i, _safetensors.read_tensor(s, fh(s.file)))
                            continue
                        if sl is None:
                            continue
                        start = sl[0] + h.shard_offset - info.offset
                        s = stored[_join(unit_name, clean_fqn(info.fqn))]
                        piece = _safetensors.read_flat_range(s, start, sl[1] - sl[0], fh(s.file))
                        h.local_shard[sl[0] : sl[1]].copy_(piece)
                for key, t, _ in _unmanaged_tensors(unit_name, st):
                    s = stored[key]
                    t.copy_(_safetensors.read_tensor(s, fh(s.file)))
    finally:
        for f in files.values():
            f.close()
    if optim is not None:
        _full_optim.load(root, optim, optim_stored, objects)
