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

[Note: seals]
Every file fsdp_wrap writes here carries its own CRC-32 (its *seal*): the
header's ``__metadata__`` (an index's ``"metadata"``) holds
``"fsdp_wrap_crc32": "<8 hex digits>"``, the CRC-32 of the whole file with
those 8 digits read as ``--------``.  A loader that finds a seal checks it, so
a flipped byte in a file fsdp_wrap wrote is refused even where the
directory's completion marker is gone; files without one (Hugging Face's,
torch's) are foreign and read as they are.  The seal is written last, after
the data (:meth:`ShardedWriter.close`); the marker records each seal too, so
a sealed file swapped in from another save is told apart.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
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
#: The header length a file has until its writer closes it (a writer that died
#: leaves it, and no reader accepts a header of length 0).
UNFINISHED = b"\0" * 8
_ALIGN = 8  # data offsets aligned like the safetensors package aligns them
SEAL_KEY = "fsdp_wrap_crc32"
_SEAL_BLANK = "--------"
_SEAL_RE = re.compile(rb'"fsdp_wrap_crc32":\s*"([0-9a-f-]{8})"')
_CHUNK = 16 * 2**20


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


def _header_bytes(entries: Sequence[Entry], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    offsets: dict[str, int] = {}
    for e in entries:
        header[e.name] = {
            "dtype": st_dtype(e.dtype, e.name),
            "shape": list(e.shape),
            "data_offsets": [pos, pos + e.nbytes],
        }
        offsets[e.name] = pos
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    base = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {k: base + v for k, v in offsets.items()}


def write_tensor_bytes(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s bytes (C order, native little-endian) at ``f``'s position."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return
    t = t.contiguous().reshape(-1).view(torch.uint8)
    f.write(t.numpy().data)


def _crc32_with_blank(path: str, at: int) -> int:
    """CRC-32 of the file at ``path`` with the 8 bytes at ``at`` read as the blank seal."""
    crc, pos = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            end = pos + len(chunk)
            if pos < at + 8 and at < end:
                buf = bytearray(chunk)
                for i in range(max(at, pos), min(at + 8, end)):
                    buf[i - pos] = _SEAL_BLANK.encode()[i - at]
                chunk = bytes(buf)
            crc = zlib.crc32(chunk, crc)
            pos = end
    return crc


def seal_file(path: str, at: int, fsync: bool) -> int:
    """Write the seal of the file at ``path`` (its 8 blank digits at ``at``); return it."""
    crc = _crc32_with_blank(path, at)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(f"{crc:08x}".encode())
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return crc


def _seal_position(path: str) -> tuple[int, str] | None:
    """Where a file's seal lies and what it says, or ``None`` (a foreign file).
    A safetensors file's is in its header, a JSON file's anywhere in it."""
    size = os.path.getsize(path)
    base = 0
    with open(path, "rb") as f:
        if path.endswith(".safetensors"):
            head = f.read(8)
            if len(head) < 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                return None
            base, text = 8, f.read(n)
        else:
            text = f.read(min(size, 16 * 2**20))
    found = list(_SEAL_RE.finditer(text))
    if len(found) != 1:
        return None
    return base + found[0].start(1), found[0].group(1).decode("ascii")


def read_seal(path: str) -> int | None:
    """The seal a file fsdp_wrap wrote carries (``None``: a foreign file, or no valid seal)."""
    found = _seal_position(path)
    if found is None:
        return None
    try:
        return int(found[1], 16)
    except ValueError:
        return None


def check_seal(path: str) -> bool:
    """``True`` if the file carries a seal and its bytes match it; ``False`` for a
    file without one (foreign); ``ValueError`` naming the file otherwise."""
    found = _seal_position(path)
    if found is None:
        return False
    at, digits = found
    crc = _crc32_with_blank(path, at)
    if digits != f"{crc:08x}":
        raise ValueError(
            f"{path} does not hold what fsdp_wrap wrote: its CRC-32 is {crc:08x} but its seal "
            f"says {digits!r} (a damaged, truncated or edited file); load an earlier "
            "checkpoint (or save this one again)"
        )
    return True


def sealed_json(data: dict[str, Any], metadata_key: str | None = "metadata") -> tuple[bytes, int]:
    """``data`` as indented JSON carrying its own seal (in ``data[metadata_key]``,
    or at the top level with ``None``), and the seal."""
    sealed = json.loads(json.dumps(data))
    (sealed if metadata_key is None else sealed.setdefault(metadata_key, {}))[SEAL_KEY] = \
        _SEAL_BLANK
    raw = (json.dumps(sealed, indent=2) + "\n").encode()
    found = list(_SEAL_RE.finditer(raw))
    if len(found) != 1:
        raise ValueError(f"sealed_json: {SEAL_KEY!r} must appear once, as the seal")
    at, crc = found[0].start(1), zlib.crc32(raw)
    return raw[:at] + f"{crc:08x}".encode() + raw[at + 8:], crc


class ShardedWriter:
    """Write planned tensors, in any order, into Hugging Face-style shards in ``directory``.

    Every shard file is created up front with its final header and size, so a
    tensor can be written the moment it exists, wherever it lies; nothing is
    buffered.  ``prefix`` is ``"model"`` for ``model-00001-of-0000n.safetensors``
    and ``model.safetensors.index.json``.  ``single_file``: every tensor in one
    file of that name and no index (PEFT's ``adapter_model.safetensors``).
    :meth:`close` checks every planned tensor was written exactly once.
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
        single_file: str | None = None,
    ) -> None:
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor name '{dup}' appears twice")
        self.directory = directory
        self.prefix = prefix
        self.fsync = fsync
        self.index_metadata = dict(index_metadata or {})
        self.single_file = single_file
        if single_file is None:
            self.shards = plan_shards(entries, max_shard_bytes)
            self.files = [shard_file_name(prefix, i, len(self.shards)) for i in range(len(self.shards))]
        else:
            self.shards = [list(entries)]
            self.files = [single_file]
        self.weight_map = {e.name: f for f, es in zip(self.files, self.shards) for e in es}
        self.total = sum(e.nbytes for e in entries)
        self.planned = {e.name: e for e in entries}
        self.where: dict[str, tuple[int, int]] = {}  # name -> (file index, absolute offset)
        self.written: dict[str, int] = {}  # elements written per tensor
        self._handles: dict[int, BinaryIO] = {}
        meta = {"format": "pt", **(metadata or {}), SEAL_KEY: _SEAL_BLANK}
        self._lengths: list[bytes] = []
        self._seal_at: list[int] = []
        #: each file's seal once :meth:`close` wrote it (see [Note: seals])
        self.seals: dict[str, int] = {}
        for i, (file, shard) in enumerate(zip(self.files, self.shards)):
            head, offsets = _header_bytes(shard, meta)
            self._seal_at.append(_SEAL_RE.search(head).start(1))  # type: ignore[union-attr]
            with open(os.path.join(directory, file), "wb") as f:
                # The header's length stays 0 until close(): a file whose
                # writer died is refused by every safetensors reader instead
                # of loading with zeros where its data never arrived.
                f.write(UNFINISHED + head[8:])
                f.truncate(len(head) + sum(e.nbytes for e in shard))
            self._lengths.append(head[:8])
            for name, off in offsets.items():
                self.where[name] = (i, off)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write all of tensor ``name`` (shape and dtype as planned)."""
        e = self.planned.get(name)
        if e is not None and (tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype):
            raise ValueError(
                f"tensor '{name}' was planned as {e.dtype} {list(e.shape)} but got "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        self.write_range(name, 0, tensor.reshape(-1))

    def write_range(self, name: str, offset: int, flat: torch.Tensor) -> None:
        """Write elements ``[offset, offset + flat.numel())`` of tensor ``name`` (flattened)."""
        e = self.planned.get(name)
        if e is None:
            raise RuntimeError(f"tensor '{name}' was not planned for {self.directory}")
        numel = math.prod(e.shape)
        if flat.dtype != e.dtype or offset < 0 or offset + flat.numel() > numel:
            raise ValueError(
                f"tensor '{name}' ({e.dtype}, {numel} elements): cannot write {flat.numel()} "
                f"{flat.dtype} elements at element {offset}"
            )
        i, off = self.where[name]
        f = self._handles.get(i)
        if f is None:
            f = open(os.path.join(self.directory, self.files[i]), "r+b")  # noqa: SIM115
            self._handles[i] = f
        f.seek(off + offset * _itemsize(e.dtype))
        write_tensor_bytes(f, flat)
        self.written[name] = self.written.get(name, 0) + flat.numel()

    def close(self) -> str:
        """Flush every shard, write the index; return the index path (the file's
        path with ``single_file``, which has no index)."""
        missing = [
            n for n, e in self.planned.items() if self.written.get(n, 0) != math.prod(e.shape)
        ]
        for f in self._handles.values():
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
            f.close()
        self._handles.clear()
        if missing:
            raise RuntimeError(
                f"{len(missing)} planned tensor(s) were never written to {self.directory}, "
                f"first '{missing[0]}'"
            )
        for file, length, at in zip(self.files, self._lengths, self._seal_at):
            path = os.path.join(self.directory, file)
            with open(path, "r+b") as f:  # the data are down: now valid
                f.write(length)
            self.seals[file] = seal_file(path, at, self.fsync)  # (last: it covers the rest)
        if self.single_file is not None:
            return os.path.join(self.directory, self.single_file)
        index = {
            "metadata": {"total_size": self.total, **self.index_metadata},
            "weight_map": self.weight_map,
        }
        raw, self.seals[self.prefix + INDEX_SUFFIX] = sealed_json(index)
        path = os.path.join(self.directory, self.prefix + INDEX_SUFFIX)
        with open(path, "wb") as out:
            out.write(raw)
            out.flush()
            if self.fsync:
                os.fsync(out.fileno())
        return path

    def abort(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


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
        if head == UNFINISHED and size > 8:
            raise ValueError(
                f"{path} is incomplete: its writer never finished it (the header length is "
                "still 0, as a save or conversion leaves it until every tensor is written); "
                "use an earlier checkpoint or run the save again"
            )
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


def read_flat_range(st: StoredTensor, start: int, count: int, f: BinaryIO) -> torch.Tensor:
    """Elements ``[start, start + count)`` of the flattened tensor, reading only those bytes."""
    item = _itemsize(st.dtype)
    buf = torch.empty(count * item, dtype=torch.uint8)
    if count:
        f.seek(st.begin + start * item)
        got = f.readinto(buf.numpy().data)  # type: ignore[attr-defined]
        if got != count * item:
            raise ValueError(f"{st.file} is truncated: tensor '{st.name}' is short")
    return buf.view(st.dtype)
