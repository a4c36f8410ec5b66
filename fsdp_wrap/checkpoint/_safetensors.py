"""The safetensors file format and Hugging Face's sharded layout, streamed.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}``, offsets relative to the end of the header) and the raw tensor bytes.
Because the header only needs names, shapes and dtypes, a file can be planned
before any tensor exists and then filled one tensor at a time, so writing never
holds more than the tensor being written.  The ``safetensors`` package builds
the whole dict in memory first, which is why fsdp_wrap writes the format itself
(the tests read every file back with ``safetensors`` and ``transformers``).

Hugging Face's layout for a sharded model: ``model-00001-of-00003.safetensors``
... plus ``model.safetensors.index.json`` = ``{"metadata": {"total_size": N},
"weight_map": {name: file}}``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _st
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}

INDEX_SUFFIX = ".safetensors.index.json"
_ALIGN = 8  # data offsets aligned like the safetensors package aligns them


@dataclass(frozen=True)
class Entry:
    """One tensor to be written: its name, shape and dtype (no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def st_dtype(dtype: torch.dtype, name: str) -> str:
    try:
        return DTYPE_TO_ST[dtype]
    except KeyError:
        raise TypeError(
            f"tensor '{name}' has dtype {dtype}, which safetensors cannot store; "
            f"supported: {sorted(str(d) for d in DTYPE_TO_ST)}"
        ) from None


def shard_file_name(prefix: str, index: int, count: int) -> str:
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Split ``entries`` (kept in order) into shards of at most ``max_shard_bytes``.

    A tensor larger than the limit gets a shard of its own, as in transformers.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_bytes} bytes")
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


class _PlannedFile:
    """One safetensors file whose header is written up front and data appended in order."""

    def __init__(self, path: str, entries: Sequence[Entry], metadata: dict[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        pos = 0
        self.offsets: dict[str, tuple[int, int]] = {}
        for e in entries:
            header[e.name] = {
                "dtype": st_dtype(e.dtype, e.name),
                "shape": list(e.shape),
                "data_offsets": [pos, pos + e.nbytes],
            }
            self.offsets[e.name] = (pos, pos + e.nbytes)
            pos += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % _ALIGN)
        self.path = path
        self.entries = list(entries)
        self.next = 0
        self.f: BinaryIO = open(path, "wb")  # noqa: SIM115  (closed by finish)
        self.f.write(struct.pack("<Q", len(raw)))
        self.f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        e = self.entries[self.next]
        if name != e.name:
            raise RuntimeError(
                f"safetensors writer for {self.path} expected tensor '{e.name}' next but got "
                f"'{name}' (tensors must arrive in the planned order)"
            )
        if tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            raise ValueError(
                f"tensor '{name}' was planned as {e.dtype} {list(e.shape)} but got "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        write_tensor_bytes(self.f, tensor)
        self.next += 1

    def finish(self, fsync: bool) -> None:
        if self.next != len(self.entries):
            missing = self.entries[self.next].name
            self.f.close()
            raise RuntimeError(f"{self.path} is missing tensor '{missing}' and later ones")
        self.f.flush()
        if fsync:
            os.fsync(self.f.fileno())
        self.f.close()


def write_tensor_bytes(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Append ``tensor``'s bytes (C order, native little-endian) to ``f``."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return
    t = t.contiguous().reshape(-1).view(torch.uint8)
    f.write(t.numpy().data)


class ShardedWriter:
    """Write tensors, in a planned order, into Hugging Face-style shards in ``directory``.

    ``prefix`` is ``"model"`` for the model (``model-00001-of-0000n.safetensors``
    and ``model.safetensors.index.json``).  Only one shard file is open at a time.
    """

    def __init__(
        self,
        directory: str,
        entries: Sequence[Entry],
        max_shard_bytes: int,
        prefix: str = "model",
        metadata: dict[str, str] | None = None,
        index_metadata: dict[str, Any] | None = None,
        fsync: bool = False,
    ) -> None:
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor name '{dup}' appears twice")
        self.directory = directory
        self.prefix = prefix
        self.fsync = fsync
        self.metadata = {"format": "pt", **(metadata or {})}
        self.index_metadata = dict(index_metadata or {})
        self.shards = plan_shards(entries, max_shard_bytes)
        self.files = [shard_file_name(prefix, i, len(self.shards)) for i in range(len(self.shards))]
        self.weight_map = {e.name: f for f, es in zip(self.files, self.shards) for e in es}
        self.total = sum(e.nbytes for e in entries)
        self._shard = -1
        self._current: _PlannedFile | None = None
        self._open_next()

    def _open_next(self) -> None:
        if self._current is not None:
            self._current.finish(self.fsync)
            self._current = None
        self._shard += 1
        if self._shard < len(self.shards):
            path = os.path.join(self.directory, self.files[self._shard])
            self._current = _PlannedFile(path, self.shards[self._shard], self.metadata)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        while self._current is not None and self._current.next == len(self._current.entries):
            self._open_next()
        if self._current is None:
            raise RuntimeError(f"tensor '{name}' was not planned for {self.directory}")
        self._current.write(name, tensor)

    def close(self) -> str:
        """Finish the last shard, write the index; return the index path."""
        while self._current is not None:
            self._open_next()
        index = {
            "metadata": {"total_size": self.total, **self.index_metadata},
            "weight_map": self.weight_map,
        }
        path = os.path.join(self.directory, self.prefix + INDEX_SUFFIX)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        return path

    def abort(self) -> None:
        if self._current is not None:
            self._current.f.close()
            self._current = None


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a safetensors file."""

    file: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: str) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """The tensors of one safetensors file (checked against its size) and its metadata."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file: only {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise ValueError(
                f"{path} is not a valid safetensors file: header length {n} but the file "
                f"holds {size} bytes (truncated or not safetensors)"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path} is not a valid safetensors file: bad header ({e})") from e
    meta = header.pop("__metadata__", None) or {}
    out: dict[str, StoredTensor] = {}
    base = 8 + n
    for name, h in header.items():
        dtype = ST_TO_DTYPE.get(h.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {h.get('dtype')}")
        begin, end = h["data_offsets"]
        shape = tuple(int(s) for s in h["shape"])
        if end - begin != math.prod(shape) * _itemsize(dtype) or base + end > size:
            raise ValueError(
                f"{path} is truncated or corrupt: tensor '{name}' needs bytes "
                f"[{base + begin}, {base + end}) but the file holds {size}"
            )
        out[name] = StoredTensor(path, name, dtype, shape, base + begin, base + end)
    return out, meta


def read_tensor(st: StoredTensor, f: BinaryIO | None = None) -> torch.Tensor:
    """Read one tensor into fresh memory (only its bytes are read)."""
    buf = torch.empty(st.nbytes, dtype=torch.uint8)
    own = f is None
    fh = open(st.file, "rb") if f is None else f  # noqa: SIM115
    try:
        fh.seek(st.begin)
        if st.nbytes:
            got = fh.readinto(buf.numpy().data)  # type: ignore[attr-defined]
            if got != st.nbytes:
                raise ValueError(f"{st.file} is truncated: tensor '{st.name}' is short")
    finally:
        if own:
            fh.close()
    return buf.view(st.dtype).reshape(st.shape)


def read_index(directory: str, prefix: str = "model") -> dict[str, Any] | None:
    path = os.path.join(directory, prefix + INDEX_SUFFIX)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            index: dict[str, Any] = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is damaged") from e
    return index


def stored_tensors(directory: str, prefix: str = "model") -> dict[str, StoredTensor]:
    """Every tensor of a HF-layout directory (index, or a lone ``<prefix>.safetensors``).

    Checks that every file the index names exists and holds the tensors it claims.
    """
    index = read_index(directory, prefix)
    if index is None:
        single = os.path.join(directory, prefix + ".safetensors")
        if not os.path.exists(single):
            raise FileNotFoundError(
                f"{directory} holds no {prefix}{INDEX_SUFFIX} and no {prefix}.safetensors"
            )
        return read_header(single)[0]
    weight_map: dict[str, str] = index.get("weight_map", {})
    out: dict[str, StoredTensor] = {}
    headers: dict[str, dict[str, StoredTensor]] = {}
    for name, file in weight_map.items():
        if file not in headers:
            path = os.path.join(directory, file)
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"checkpoint {directory} is incomplete: {file} (holding '{name}') is missing"
                )
            headers[file] = read_header(path)[0]
        if name not in headers[file]:
            raise ValueError(
                f"checkpoint {directory} is inconsistent: the index puts '{name}' in {file} "
                "but that file does not hold it"
            )
        out[name] = headers[file][name]
    return out


def iter_files(directory: str) -> Iterable[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
