"""Reading a ``torch.distributed.checkpoint`` (DCP) directory offline, tensor by tensor.

No process group: every read goes through DCP's own ``no_dist`` load path and
``FileSystemReader`` with a one-entry template, so DCP does the resharding
(a tensor saved as chunks by W ranks comes back whole) and only that tensor's
chunks are read.  The metadata is parsed once and cached.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

import fsdp_wrap._compat as _compat
from fsdp_wrap.checkpoint._memory import release_freed_memory

METADATA_FILE = ".metadata"
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


class _CachedReader(FileSystemReader):
    """A FileSystemReader that parses ``.metadata`` once for many loads."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


@dataclass(frozen=True)
class DcpTensor:
    fqn: str  # DCP's flattened key, e.g. "model.layers.0.weight"
    path: tuple[Any, ...]  # the nested path it came from, e.g. ("model", "layers.0.weight")
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: int

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class DcpEntry:
    """A non-tensor value (``param_groups``, a step counter ...), stored pickled."""

    fqn: str
    path: tuple[Any, ...]


class DcpCheckpoint:
    """An opened, checked DCP directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.metadata = read_metadata(directory)
        check_files(directory, self.metadata)
        mapping: dict[str, tuple[Any, ...]] = dict(self.metadata.planner_data or {})
        self.tensors: list[DcpTensor] = []
        self.objects: list[DcpEntry] = []
        for fqn, md in self.metadata.state_dict_metadata.items():
            path = tuple(mapping.get(fqn, (fqn,)))
            if isinstance(md, TensorStorageMetadata):
                self.tensors.append(
                    DcpTensor(fqn, path, tuple(md.size), md.properties.dtype, len(md.chunks))
                )
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(DcpEntry(fqn, path))
        self._reader = _CachedReader(directory, self.metadata)

    @property
    def rank_files(self) -> list[str]:
        files = {
            info.relative_path for info in (self.metadata.storage_data or {}).values()
        }
        return sorted(files)

    @property
    def world_size(self) -> int:
        """The number of ranks that wrote it: ``__<rank>_*.distcp`` files, or the most chunks."""
        ranks = {int(m.group(1)) for f in self.rank_files if (m := _RANK_FILE.match(f))}
        on_disk = {
            int(m.group(1)) for f in os.listdir(self.directory) if (m := _RANK_FILE.match(f))
        }
        most_chunks = max((t.chunks for t in self.tensors), default=1)
        return max(max(ranks | on_disk, default=0) + 1, most_chunks)

    def load_tensor(self, t: DcpTensor) -> torch.Tensor:
        """Read ``t`` whole (DCP assembles its chunks) into fresh memory."""
        out = torch.empty(t.shape, dtype=t.dtype)
        self._load({t.fqn: out})
        release_freed_memory()  # DCP's per-chunk temporaries
        return out

    def load_object(self, e: DcpEntry) -> Any:
        holder: dict[str, Any] = {e.fqn: None}
        self._load(holder)
        return holder[e.fqn]

    def _load(self, template: dict[str, Any]) -> None:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
                dcp.load(template, storage_reader=self._reader, no_dist=True)
        except (Exception, CheckpointException) as e:  # (CheckpointException: a BaseException)
            # A data file whose bytes are damaged where DCP's reader parses them:
            # one line naming the checkpoint and the entry, not DCP's traceback.
            cause: Any = e
            if isinstance(e, CheckpointException):
                cause = next(iter(e.failures.values()), e)
                cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, stack)
            what = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
            raise ValueError(
                f"checkpoint {self.directory} is damaged: reading {', '.join(template)} failed "
                f"({type(cause).__name__}: {what}); use an earlier checkpoint"
            ) from e

class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles ``.metadata``, also as written by a newer torch than this one.

    torch 2.15 pickles six fields of each ``TensorProperties`` (it added the
    tensor's strides); an older torch's class takes five and fails ("too many
    values to unpack").  Here such a record becomes the installed torch's
    ``TensorProperties`` with the first five fields: the strides only say how
    the saved tensor was laid out in memory, and a load makes its own.
    """

    def find_class(self, module: str, name: str) -> Any:
        cls = super().find_class(module, name)
        if name == "TensorProperties" and not _compat.dcp_properties_have_strides():
            return _five_field_properties(cls)
        return cls


_FIVE_FIELD: dict[type, type] = {}


def _five_field_properties(base: type) -> type:
    if base not in _FIVE_FIELD:

        def __setstate__(self: Any, state: Any) -> None:
            base.__setstate__(self, tuple(state)[:5])  # type: ignore[attr-defined]
            self.__class__ = base  # the installed torch's own class from here on

        _FIVE_FIELD[base] = type(base.__name__, (base,), {"__setstate__": __setstate__})
    return _FIVE_FIELD[base]


def read_metadata(directory: str) -> Metadata:
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory")
    if not os.path.exists(path):
        distcp = [n for n in os.listdir(directory) if n.endswith(".distcp")]
        if distcp:
            raise ValueError(
                f"checkpoint {directory} is incomplete: it holds {len(distcp)} .distcp file(s) "
                "but no .metadata (DCP writes .metadata last, after every rank finished: the "
                "save was interrupted). Use an earlier checkpoint."
            )
        raise ValueError(
            f"{directory} is not a torch.distributed.checkpoint directory (no .metadata file)"
        )
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:
        raise ValueError(
            f"checkpoint {directory} is damaged: its .metadata cannot be read ({type(e).__name__}: "
            f"{e}). Use an earlier checkpoint."
        ) from e
    if not isinstance(md, Metadata):
        raise ValueError(
            f"{path} is not DCP metadata (it unpickles to {type(md).__name__})"
        )
    return md


def check_files(directory: str, md: Metadata) -> None:
    """Every data file the metadata names exists and is long enough (truncation check)."""
    need: dict[str, tuple[int, str]] = {}
    for index, info in (md.storage_data or {}).items():
        end = info.offset + info.length
        if end > need.get(info.relative_path, (0, ""))[0]:
            need[info.relative_path] = (end, index.fqn)
    for rel, (end, fqn) in sorted(need.items()):
        path = os.path.join(directory, rel)
        if not os.path.exists(path):
            raise ValueError(
                f"checkpoint {directory} is incomplete: {rel} is missing (it holds '{fqn}'); "
                "use an earlier checkpoint"
            )
        size = os.path.getsize(path)
        if size < end:
            raise ValueError(
                f"checkpoint {directory} is truncated: {rel} holds {size} bytes but its "
                f"metadata needs {end} (for '{fqn}'); use an earlier checkpoint"
            )


def is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.exists(os.path.join(path, METADATA_FILE))
        or any(n.endswith(".distcp") for n in os.listdir(path))
    )
