"""A Hugging Face checkpoint straight into an fsdp_wrap model's shards.

The flow (``docs/checkpointing.rst``, "Loading a pretrained model")::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)       # no memory
    model = FSDP(model, auto_wrap_policy=...,                  # unit by unit:
                 param_init_fn=fsdp_wrap.pretrained_init(model, path))
    fsdp_wrap.load_pretrained(model, path)                     # each rank its shard

:func:`load_pretrained` checks the whole checkpoint against the model on
every rank (every tensor present, of the right shape, of a dtype it can be
converted from), agrees the verdict across ranks, and only then reads: each
rank reads from the files the byte ranges of its own shard of every flat
parameter, converting dtype as it copies them into the shard, plus the
persistent buffers and the parameters FSDP does not manage.  Nothing is
gathered and no rank ever holds a whole unit's worth of checkpoint data.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.checkpoint._safetensors as _st
from fsdp_wrap.checkpoint._safetensors import StoredTensor
from fsdp_wrap.checkpoint._two_d import load_param as load_tp_param
from fsdp_wrap.checkpoint.full import _fsdp_cls, _join, _names, _units, _unmanaged_tensors
from fsdp_wrap.checkpoint.weights._files import stored_tensors
from fsdp_wrap.checkpoint.weights._names import NameMap, adapter_prefix, hf_hints, match_names
from fsdp_wrap.comm.collectives import global_rank
from fsdp_wrap.runtime.names import clean_fqn

if TYPE_CHECKING:
    from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

__all__ = ["PretrainedLoad", "load_pretrained"]

_WINDOW_BYTES = 64 * 2**20  # staged reads for a device shard: at most this much at a time


class PretrainedLoad(NamedTuple):
    """What :func:`load_pretrained` did not fill from the checkpoint.

    ``missing_keys``: model keys the checkpoint lacks (buffers, which keep the
    values the model's init computed; a PEFT model's adapters, which keep
    PEFT's init from ``pretrained_init``; with ``strict=False``, parameters);
    ``unexpected_keys``: checkpoint tensors nothing read (``strict=False``).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


class _Want(NamedTuple):
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool


def _wanted(root: FSDP) -> tuple[list[_Want], list[list[str]], set[str]]:
    """The FULL state dict's keys (shape, dtype, parameter or buffer), the tied
    groups, and the non-persistent buffers' keys."""
    want: list[_Want] = []
    tied: list[list[str]] = []
    computed: set[str] = set()
    seen: set[str] = set()
    for unit_name, st in _units(root):
        for h in st._handles:  # one per flat parameter (a split unit has several)
            for i, info in enumerate(h.infos):
                names = _names(h, unit_name, i)
                if len(names) > 1:
                    tied.append(names)
                shape = info.spec.shape if info.spec is not None else info.shape  # (whole)
                for key in names:
                    want.append(_Want(key, tuple(shape), h.orig_dtype, True))
                    seen.add(key)
        for key, t, dtype in _unmanaged_tensors(unit_name, st):
            if key not in seen:
                seen.add(key)
                want.append(_Want(key, tuple(t.shape), dtype, isinstance(t, nn.Parameter)))
        for mod_name, mod in st._fsdp_wrapped_module.named_modules():
            for n in mod._non_persistent_buffers_set:
                computed.add(_join(unit_name, clean_fqn(_join(mod_name, n))))
    return want, tied, computed


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    def kind(d: torch.dtype) -> str:
        return "float" if d.is_floating_point else "complex" if d.is_complex else (
            "bool" if d is torch.bool else "int")

    return kind(src) == kind(dst)


def _check(
    root: FSDP, path: str, strict: bool, verify: bool = True
) -> tuple[dict[str, StoredTensor], NameMap, list[_Want]]:
    """Everything :func:`load_pretrained` will read, checked; raises on the first
    problem.  Local: no collective, nothing touched."""
    stored = stored_tensors(path, verify)
    want, tied, computed = _wanted(root)
    inner = root._fsdp_wrapped_module
    prefixes, patterns = hf_hints(inner)
    nm = match_names([w.key for w in want], stored, prefixes=prefixes, tied=tied,
                     computed=computed, ignore_unexpected=patterns, adapters=adapter_prefix(inner))
    cls = type(root._fsdp_wrapped_module).__name__
    head = f"Error(s) in loading state_dict for {cls}:\n\t"
    where = f"\n[rank {global_rank()}] checkpoint {path} ({nm.rule})"
    missing_set = set(nm.missing) - set(nm.adapters)
    missing_params = [w.key for w in want if w.is_param and w.key in missing_set]
    if strict and missing_params:
        shown = ", ".join(f'"{k}"' for k in missing_params[:8])
        more = f" (and {len(missing_params) - 8} more)" if len(missing_params) > 8 else ""
        raise RuntimeError(
            f"{head}Missing key(s) in state_dict: {shown}{more}.{where}: the checkpoint does not "
            "hold these parameters. Load the checkpoint of this model (same architecture and "
            "config), or pass strict=False to keep their initial values (pretrained_init(model, "
            "path) computes them with the model's own init)"
        )
    if strict and nm.unexpected:
        shown = ", ".join(f'"{k}"' for k in nm.unexpected[:8])
        more = f" (and {len(nm.unexpected) - 8} more)" if len(nm.unexpected) > 8 else ""
        raise RuntimeError(
            f"{head}Unexpected key(s) in state_dict: {shown}{more}.{where}: the model has no such "
            "tensors. Build the model from the checkpoint's config, or pass strict=False to "
            "leave them unread"
        )
    for w in want:
        name = nm.stored_for.get(w.key)
        if name is None:
            continue
        s = stored[name]
        if s.shape != w.shape:
            raise RuntimeError(
                f"{head}size mismatch for {w.key}: copying a param with shape {list(s.shape)} "
                f"from checkpoint, the shape in current model is {list(w.shape)}.{where}: stored "
                f"as '{name}'. Build the model from the checkpoint's config"
            )
        if not _convertible(s.dtype, w.dtype):
            raise RuntimeError(
                f"{head}dtype mismatch for {w.key}: the checkpoint holds {s.dtype} ('{name}'), the "
                f"model {w.dtype}.{where}: only conversions between floating-point dtypes (or "
                "between integer dtypes) are made while reading"
            )
    return stored, nm, want


def _agree(error: BaseException | None, groups: list[Any]) -> None:
    """Every rank of ``groups`` raises if any of them failed its check.

    One object all-gather per group (the shard group, then the replica group
    for hybrid sharding: together every rank of the model hears every other).
    """
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reports = {global_rank(): mine}
    for g in groups:
        everyone: list[Any] = [None] * dist.get_world_size(g)
        dist.all_gather_object(everyone, reports, group=g)
        for theirs in everyone:
            reports.update(theirs)
    bad = {r: e for r, e in sorted(reports.items()) if e is not None}
    if not bad:
        return
    if error is not None:
        raise error
    first, text = next(iter(bad.items()))
    raise RuntimeError(
        f"[rank {global_rank()}] load_pretrained refused on rank(s) {sorted(bad)}; nothing was "
        f"loaded on any rank. Rank {first} reported: {text}"
    )


class _Source:
    """One checkpoint file, opened once: read for same-dtype copies, and mapped
    range by range for converting copies, which then read the page cache
    directly instead of copying through a staging buffer first."""

    def __init__(self, file: str) -> None:
        self.f: BinaryIO = open(file, "rb")  # noqa: SIM115

    def convert_into(self, flat: torch.Tensor, s: StoredTensor, start: int) -> None:
        """Elements ``[start, start + flat.numel())`` of ``s`` into the 1-D ``flat``.

        The range is mapped copy-on-write (never written) and unmapped at once,
        so the file's pages count in this process's RSS only while one range is
        being converted.
        """
        item = _st._itemsize(s.dtype)
        lo = s.begin + start * item
        hi = lo + flat.numel() * item
        if hi > s.end:
            raise ValueError(f"{s.file} is truncated: tensor '{s.name}' is short")
        base = lo - lo % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self.f.fileno(), hi - base, access=mmap.ACCESS_COPY, offset=base)
        try:
            raw = torch.frombuffer(m, dtype=torch.uint8, count=hi - lo, offset=lo - base)
            flat.copy_(raw.view(s.dtype))
            del raw
        finally:
            m.close()

    def close(self) -> None:
        self.f.close()


@contextmanager
def _open_files() -> Iterator[Any]:
    files: dict[str, _Source] = {}

    def source(file: str) -> _Source:
        if file not in files:
            files[file] = _Source(file)
        return files[file]

    try:
        yield source
    finally:
        for f in files.values():
            f.close()


def _read_into(dst: torch.Tensor, s: StoredTensor, start: int, src: _Source) -> None:
    """Elements ``[start, start + dst.numel())`` of ``s`` (flattened) into ``dst``,
    converting dtype; straight into ``dst``'s memory when nothing needs converting,
    else converted from the file's mapped pages in one pass."""
    n = dst.numel()
    if n == 0:
        return
    f = src.f
    if not dst.is_contiguous():  # (a buffer made by expand(), say)
        dst.copy_(_st.read_flat_range(s, start, n, f).view(dst.shape))
        return
    if dst.dtype == s.dtype and dst.device.type == "cpu":
        view = dst.view(torch.uint8)
        item = dst.element_size()
        f.seek(s.begin + start * item)
        got = f.readinto(view.numpy().data)  # type: ignore[attr-defined]
        if got != n * item:
            raise ValueError(f"{s.file} is truncated: tensor '{s.name}' is short")
        return
    if dst.device.type == "cpu":
        src.convert_into(dst.view(-1), s, start)
        return
    window = max(1, _WINDOW_BYTES // max(1, _st._itemsize(s.dtype)))
    flat = dst.view(-1)
    for a in range(0, n, window):
        b = min(n, a + window)
        flat[a:b].copy_(_st.read_flat_range(s, start + a, b - a, f))


def load_pretrained(
    model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True,
    verify: bool = True,
) -> PretrainedLoad:
    """Fill the fsdp_wrap-wrapped ``model`` from the Hugging Face checkpoint at ``path``.

    ``path``: a directory as ``save_pretrained`` writes it (``model.safetensors``,
    or ``model.safetensors.index.json`` and its files), or one ``.safetensors``
    file.  ``model``: the root ``FullyShardedDataParallel``, any sharding
    strategy, ``use_orig_params`` either way, nested units, CPU offload and mixed
    precision allowed; typically built on the meta device and wrapped with
    ``param_init_fn=pretrained_init(model, path)``.

    Every rank checks every tensor first (names matched by the rules in
    :doc:`/checkpointing`, "Loading a pretrained model": tied weights stored
    once, PEFT's and the base model's prefixes) and the ranks agree on the verdict (one
    small all-gather on the model's process group(s), before any other
    collective): a missing parameter, a tensor of the wrong shape or an
    unconvertible dtype (``strict``: also tensors the model lacks) raises
    ``RuntimeError`` on every rank, torch's ``load_state_dict`` sentence first,
    naming the tensor, and the model is untouched.  Then each rank reads only
    the bytes of its own shards, converting to the model's dtype (a bf16
    checkpoint into fp32 units).  Buffers the checkpoint lacks keep their values
    (computed by the model's own init, see :func:`pretrained_init`).  A
    checkpoint fsdp_wrap wrote (:func:`fsdp_wrap.checkpoint.save_full_checkpoint`)
    is verified whole first (its completion marker and every file's CRC-32; a
    missing or edited marker is refused); ``verify=False`` reads it unverified.

    A collective: call it on every rank of the model.  Returns
    :class:`PretrainedLoad` (what was not filled).
    """
    cls = _fsdp_cls()
    if not isinstance(model, cls):
        raise TypeError(
            f"[rank {global_rank()}] load_pretrained expects the root fsdp_wrap "
            f"FullyShardedDataParallel module but got {type(model).__name__}; wrap the model "
            "first (FullyShardedDataParallel(model, param_init_fn=pretrained_init(model, path)))"
        )
    root: FSDP = model
    if root._is_root is False:
        raise ValueError(f"[rank {global_rank()}] load_pretrained expects the root FSDP module, "
                         "not a nested unit")
    error: BaseException | None = None
    checked: Any = None
    try:
        checked = _check(root, os.fspath(path), strict, verify)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        error = e
    groups = [g for g in (root.process_group, root._inter_node_pg) if g is not None]
    if dist.is_initialized():
        _agree(error, groups)
    elif error is not None:
        raise error
    root._lazy_init()
    stored, nm, _ = checked
    _fill(root, stored, nm)
    return PretrainedLoad(list(nm.missing), [] if strict else list(nm.unexpected))


def _fill(root: FSDP, stored: dict[str, StoredTensor], nm: NameMap) -> None:
    """Each rank's shard of every flat parameter, and the unmanaged tensors, from disk."""
    with _open_files() as fh, torch.no_grad():
        for unit_name, st in _units(root):
            for h in st._handles:  # one per flat parameter (a split unit has several)
                h.invalidate_unsharded()
                for i, info in enumerate(h.infos):
                    sl = h.param_shard_slice(i)
                    name = next((nm.stored_for[k] for k in _names(h, unit_name, i)
                                 if k in nm.stored_for), None)
                    if info.spec is not None and name is not None:  # (DTensor: read whole)
                        s = stored[name]
                        whole = torch.empty(s.shape, dtype=h.orig_dtype)
                        _read_into(whole, s, 0, fh(s.file))
                        load_tp_param(h, i, whole)
                        continue
                    if sl is None or name is None:
                        continue
                    s = stored[name]
                    start = sl[0] + h.shard_offset - info.offset
                    _read_into(h.local_shard[sl[0]:sl[1]], s, start, fh(s.file))
            for key, t, _ in _unmanaged_tensors(unit_name, st):
                name = nm.stored_for.get(key)
                if name is not None:
                    s = stored[name]
                    _read_into(t.detach(), s, 0, fh(s.file))
