"""The sources :mod:`fsdp_wrap.checkpoint.offline` reads: a checkpoint as leaves.

A checkpoint is a tree of *leaves* (tensors and plain values at paths such as
``("model", "layers.0.weight")``), read one at a time on demand from a DCP
directory, a ``torch.save`` file (memory-mapped; pickles only when trusted) or
a safetensors directory; :func:`open_source` tells them apart and refuses a
checkpoint whose save did not finish.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import fsdp_wrap.checkpoint._atomic as _atomic
import fsdp_wrap.checkpoint._safetensors as _safetensors
from fsdp_wrap.checkpoint._torch_save import check_zip_crcs
from fsdp_wrap.checkpoint._torch_save import is_unfinished as is_unfinished_torch

MARKER = _atomic.MARKER  # written by fsdp_wrap's own savers
_MODEL_KEYS = ("model",)
_OPTIM_KEYS = ("optim", "optimizer")


@dataclass
class Leaf:
    path: tuple[Any, ...]
    shape: tuple[int, ...] | None  # None: not a tensor
    dtype: torch.dtype | None
    load: Callable[[], Any]
    chunks: int = 1
    stored: _safetensors.StoredTensor | None = None  # where a safetensors tensor lies

    @property
    def name(self) -> str:
        return ".".join(str(p) for p in self.path)

    @property
    def nbytes(self) -> int:
        if self.shape is None or self.dtype is None:
            return 0
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Source:
    path: str
    kind: str  # "dcp" | "torch" | "safetensors"
    leaves: list[Leaf]
    world_size: int | None = None
    writer: str = ""
    notes: list[str] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            c()
        self.closers.clear()

    def section(self, leaf: Leaf) -> str:
        """``"model"``, ``"optim"`` or ``"other"``."""
        if "_tops" not in self.__dict__:
            self.__dict__["_tops"] = {lf.path[0] for lf in self.leaves if len(lf.path) > 1}
        tops = self.__dict__["_tops"]
        head = leaf.path[0] if len(leaf.path) > 1 else None
        if head in _MODEL_KEYS:
            return "model"
        if head in _OPTIM_KEYS:
            return "optim"
        if not tops & {*_MODEL_KEYS, *_OPTIM_KEYS} and head not in ("state", "param_groups"):
            return "model" if leaf.shape is not None else "other"
        return "other"

    def model_name(self, leaf: Leaf) -> str:
        return ".".join(str(p) for p in (leaf.path[1:] if leaf.path[0] in _MODEL_KEYS else leaf.path))


# ------------------------------------------------------------------- sources


def open_source(path: str, trust_pickle: bool = False) -> Source:
    """Recognise and open a checkpoint; clear errors for foreign or damaged ones."""
    _check_not_unfinished_file(path)
    if not os.path.exists(path) and not os.path.isdir(_atomic.temp_path(path)):
        raise FileNotFoundError(f"{path} does not exist")
    marker = _read_marker(path)
    if os.path.isdir(path) or os.path.isdir(_atomic.temp_path(path)):
        if marker or not os.path.exists(path):
            _atomic.check_complete(path)  # a save of fsdp_wrap's that did not finish
        else:  # (no marker: the files fsdp_wrap wrote still carry their own checksums)
            _atomic.check_sealed_files(path)
        import fsdp_wrap.checkpoint._dcp as _dcp  # (DCP's import: only for a directory)

        if _dcp.is_dcp_dir(path):
            return _open_dcp(path, marker)
        if _safetensors.read_index(path) is not None or any(_safetensors.iter_files(path)):
            return _open_safetensors_dir(path, marker)
        raise ValueError(
            f"{path} is not a checkpoint fsdp-wrap knows: expected a torch.distributed.checkpoint "
            "directory (.metadata + *.distcp), a Hugging Face safetensors directory "
            "(model.safetensors.index.json / *.safetensors) or a torch.save file"
        )
    if path.endswith(".safetensors"):
        _safetensors.check_seal(path)
        tensors, _ = _safetensors.read_header(path)
        return Source(path, "safetensors", [_st_leaf(("model", n), t) for n, t in tensors.items()])
    return _open_torch_file(path, trust_pickle)


def _check_not_unfinished_file(path: str) -> None:
    """A ``torch.save`` output whose conversion was interrupted (``OUT.incomplete``)."""
    tmp = path if path.endswith(_atomic.INCOMPLETE_SUFFIX) else _atomic.temp_path(path)
    if os.path.exists(path) and not path.endswith(_atomic.INCOMPLETE_SUFFIX):
        return
    if os.path.isfile(tmp):
        how = ("its conversion was interrupted before the end" if is_unfinished_torch(tmp)
               else "it was never renamed into place")
        raise ValueError(
            f"checkpoint {tmp} is incomplete: {how} (`fsdp-wrap ckpt` writes OUT.incomplete "
            f"and renames it to OUT when done); delete it and run the conversion again"
        )


def _read_marker(path: str) -> dict[str, Any]:
    p = os.path.join(path, MARKER) if os.path.isdir(path) else None
    if p is None or not os.path.exists(p):
        return {}
    try:
        with open(p, encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
        return data
    except ValueError:
        return {}


def _open_dcp(path: str, marker: dict[str, Any]) -> Source:
    import fsdp_wrap.checkpoint._dcp as _dcp

    ck = _dcp.DcpCheckpoint(path)
    leaves: list[Leaf] = []
    for t in ck.tensors:
        leaves.append(Leaf(t.path, t.shape, t.dtype, _bind(ck.load_tensor, t), t.chunks))
    for e in ck.objects:
        leaves.append(Leaf(e.path, None, None, _bind(ck.load_object, e)))
    src = Source(path, "dcp", leaves, world_size=ck.world_size)
    src.writer = (
        "fsdp_wrap" if marker.get("writer") == "fsdp_wrap"
        else "torch's FSDP1 or fsdp_wrap (both write this same layout)"
    )
    if any(str(lf.path[-1]) == "_flat_param" for lf in leaves):
        src.notes.append(
            "LOCAL_STATE_DICT (flat shards): tied to the saving job's wrapping and world size; "
            "it cannot be consolidated into per-parameter tensors"
        )
    return src


def _bind(fn: Callable[[Any], Any], arg: Any) -> Callable[[], Any]:
    return lambda: fn(arg)


def _st_leaf(path: tuple[Any, ...], t: _safetensors.StoredTensor) -> Leaf:
    return Leaf(path, t.shape, t.dtype, _bind(_safetensors.read_tensor, t), stored=t)


def _open_safetensors_dir(path: str, marker: dict[str, Any]) -> Source:
    leaves: list[Leaf] = []
    for prefix, section in (("model", "model"), ("optimizer", "optim")):
        index = _safetensors.read_index(path, prefix)
        lone = os.path.join(path, prefix + ".safetensors")
        if index is None and not os.path.exists(lone):
            continue
        for name, t in _safetensors.stored_tensors(path, prefix).items():
            sub = tuple(name.split(".", 2)) if section == "optim" else (name,)
            if section == "optim" and sub[0] == "state":
                head, _, rest = name.partition(".")
                fqn, _, state_name = rest.rpartition(".")
                sub = (head, fqn, state_name)
            leaves.append(_st_leaf((section, *sub), t))
        meta = (index or {}).get("metadata", {})
        for sub_path, value in _flatten(meta.get("objects", {}), split_all=True):
            if sub_path != ("",):
                leaves.append(Leaf((section, *sub_path), None, None, _const(value)))
    if not leaves:
        # safetensors files outside the HF naming: read each file
        for file in _safetensors.iter_files(path):
            for n, t in _safetensors.read_header(os.path.join(path, file))[0].items():
                leaves.append(_st_leaf(("model", n), t))
    src = Source(path, "safetensors", leaves)
    if marker.get("writer") == "fsdp_wrap" and str(marker.get("kind", "")).startswith("convert"):
        src.writer = "fsdp_wrap (fsdp-wrap ckpt convert), complete"
    elif marker.get("writer") == "fsdp_wrap":
        src.writer = "fsdp_wrap (save_full_checkpoint), complete"
        src.notes.append(f"saved by {marker.get('world_size')} ranks; full tensors load at any world size")
    return src


def _const(value: Any) -> Callable[[], Any]:
    return lambda: value


def _open_torch_file(path: str, trust_pickle: bool) -> Source:
    check_zip_crcs(path)
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=not trust_pickle)
    except Exception as e:
        hint = (
            "" if trust_pickle else
            " If it holds Python objects you trust, pass --trust-pickle (weights_only=False)."
        )
        raise ValueError(
            f"{path} is not a checkpoint fsdp-wrap can read: torch.load failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).{hint}"
        ) from e
    leaves = [
        Leaf(p, tuple(v.shape), v.dtype, _const(v)) if isinstance(v, torch.Tensor)
        else Leaf(p, None, None, _const(v))
        for p, v in _flatten(obj, split_all=True)
    ]
    return Source(path, "torch", leaves, writer="torch.save (FULL_STATE_DICT)")


def _flatten(
    obj: Any, prefix: tuple[Any, ...] = (), split_all: bool = False
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Leaves of nested dicts and lists, as DCP flattens them: a list without tensors
    is one leaf (``split_all`` splits every non-empty container)."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _flatten(v, (*prefix, k), split_all)
    elif isinstance(obj, (list, tuple)) and obj and (split_all or _has_tensor(obj)):
        for i, v in enumerate(obj):
            yield from _flatten(v, (*prefix, i), split_all)
    else:
        yield (prefix or ("",)), obj


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


# ------------------------------------------------------------------- inspect
