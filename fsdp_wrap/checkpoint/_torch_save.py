"""Write a ``torch.save`` file one tensor at a time.

``torch.save`` pickles a whole object at once, so every tensor must exist in
memory together.  Here the object is first saved with *fake* tensors (shapes
and dtypes, no data) under ``torch.serialization.skip_data``: torch writes the
pickle and reserves each storage's bytes in the zip archive.  The real bytes
are then written into those reserved records one tensor at a time, and the
zip CRCs fixed up, so the result is an ordinary ``torch.save`` file
(``torch.load`` and ``zipfile`` both accept it) written with at most one real
tensor in memory.

Storages are keyed ``0, 1, ...`` in the order the pickler first meets them,
which for a nested dict is insertion order; every placeholder has its own
storage, and the record sizes are checked against the plan before any byte is
written.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

import fsdp_wrap._compat as _compat


def _placeholder(shape: Sequence[int], dtype: torch.dtype, mode: Any) -> torch.Tensor:
    with mode:
        return torch.empty(tuple(shape), dtype=dtype)


class StreamingTorchSave:
    """Save an object whose tensors are placeholders, then fill them one by one.

    ``placeholder(shape, dtype)`` makes a tensor without data to put into the
    object; :meth:`write_skeleton` saves the object and returns its
    placeholders in storage order; :meth:`fill` then takes their real values
    in that order.
    """

    def __init__(self, path: str) -> None:
        _compat.require_torch_save_skip_data()
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.path = path
        self._mode = FakeTensorMode()
        self._planned: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._records: list[tuple[int, int, int]] = []  # (header offset, data offset, nbytes)
        self._crcs: list[int] = []
        self._next = 0

    def placeholder(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return _placeholder(shape, dtype, self._mode)

    def write_skeleton(self, obj: Any) -> list[torch.Tensor]:
        order = list(_tensors_in_pickle_order(obj))
        self._planned = [(tuple(t.shape), t.dtype) for t in order]
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(obj, self.path)
        self._records = _data_records(self.path)
        want = [t.numel() * t.element_size() for t in order]
        got = [n for _, _, n in self._records]
        if got != want:
            raise RuntimeError(
                f"torch.save laid out {len(got)} storages of {got} bytes for {self.path}, "
                f"but {len(want)} of {want} bytes were planned; this torch version orders "
                "storages differently (please report it)"
            )
        self._crcs = [0] * len(self._records)
        self._seal = _unseal(self.path)
        return order

    def fill(self, tensor: torch.Tensor) -> None:
        shape, dtype = self._planned[self._next]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"tensor #{self._next} of {self.path} was planned as {dtype} {list(shape)} "
                f"but got {tensor.dtype} {list(tensor.shape)}"
            )
        _, data_offset, nbytes = self._records[self._next]
        t = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if nbytes:
            data = t.numpy().data
            with open(self.path, "r+b") as f:
                f.seek(data_offset)
                f.write(data)
            self._crcs[self._next] = zlib.crc32(data)
        self._next += 1

    def finish(self, fsync: bool = False) -> None:
        if self._next != len(self._planned):
            raise RuntimeError(
                f"{self.path}: {len(self._planned) - self._next} planned tensors were never written"
            )
        start, eocd = self._seal
        _fix_crcs(self.path, [h for h, _, _ in self._records], self._crcs, start)
        with open(self.path, "rb+") as f:  # the archive is readable from here on
            f.seek(eocd)
            f.write(_EOCD_SIGNATURE)
            f.flush()
            if fsync:
                os.fsync(f.fileno())


_EOCD_SIGNATURE = b"PK\x05\x06"
#: Written over the archive's end-of-central-directory signature while the data
#: are being filled in: ``zipfile`` and ``torch.load`` find no archive there, so
#: a writer that died leaves a file nothing loads (instead of one whose
#: tensors read as zeros).  ``finish`` puts the signature back last.
UNFINISHED_SIGNATURE = b"FW\x00\x00"


def _unseal(path: str) -> tuple[int, int]:
    """Hide the archive's end record; return (central directory offset, its offset)."""
    with zipfile.ZipFile(path) as z:
        start = int(z.start_dir)  # type: ignore[attr-defined]
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 65536 - 22))
        tail = f.read()
        at = tail.rfind(_EOCD_SIGNATURE)
        if at < 0:
            raise RuntimeError(f"{path}: torch.save wrote no end-of-central-directory record")
        eocd = size - len(tail) + at
        f.seek(eocd)
        f.write(UNFINISHED_SIGNATURE)
        f.flush()
    return start, eocd


def is_unfinished(path: str) -> bool:
    """Whether ``path`` is a torch.save file this module started and never finished."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536 - 22))
            tail = f.read()
    except OSError:
        return False
    return head == b"PK\x03\x04" and _EOCD_SIGNATURE not in tail and UNFINISHED_SIGNATURE in tail


def _data_records(path: str) -> list[tuple[int, int, int]]:
    """``(local header offset, data offset, size)`` of ``<archive>/data/<k>`` for k = 0, 1, ..."""
    out: dict[int, tuple[int, int, int]] = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
                f.seek(info.header_offset)
                head = f.read(30)
                name_len, extra_len = struct.unpack("<HH", head[26:30])
                data = info.header_offset + 30 + name_len + extra_len
                out[int(parts[2])] = (info.header_offset, data, info.file_size)
    return [out[k] for k in sorted(out)]


def _fix_crcs(path: str, header_offsets: list[int], crcs: list[int], start: int) -> None:
    """Write each record's CRC-32 into its local header and central directory entry
    (the central directory begins at ``start``)."""
    by_header = dict(zip(header_offsets, crcs))
    with open(path, "r+b") as f:
        for off, crc in by_header.items():
            f.seek(off + 14)
            f.write(struct.pack("<I", crc))
        # central directory: walk its entries (signature PK\1\2), 46-byte fixed part
        f.seek(start)
        pos = start
        while True:
            f.seek(pos)
            fixed = f.read(46)
            if len(fixed) < 46 or fixed[:4] != b"PK\x01\x02":
                break
            name_len, extra_len, comment_len = struct.unpack("<HHH", fixed[28:34])
            (local,) = struct.unpack("<I", fixed[42:46])
            extra = f.read(name_len + extra_len)[name_len:]
            if local == 0xFFFFFFFF:  # zip64: the real offset is in the extra field
                local = _zip64_local_offset(extra, fixed)
            if local in by_header:
                f.seek(pos + 16)
                f.write(struct.pack("<I", by_header[local]))
            pos += 46 + name_len + extra_len + comment_len


def _zip64_local_offset(extra: bytes, fixed: bytes) -> int:
    usize, csize = struct.unpack("<II", fixed[24:28] + fixed[20:24])
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[i : i + 4])
        body = extra[i + 4 : i + 4 + size]
        if tag == 1:
            j = 0
            for field in (usize, csize):
                if field == 0xFFFFFFFF:
                    j += 8
            return int(struct.unpack("<Q", body[j : j + 8])[0])
        i += 4 + size
    return -1


def _tensors_in_pickle_order(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors of a nested dict/list/tuple in the order the pickler meets them (each once)."""
    seen: set[int] = set()

    def walk(o: Any) -> Iterator[torch.Tensor]:
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                yield o
        elif isinstance(o, dict):
            for k, v in o.items():
                yield from walk(k)
                yield from walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                yield from walk(v)

    yield from walk(obj)


def check_zip_crcs(path: str) -> None:
    """A ``torch.save`` zip records a CRC-32 per record, which ``torch.load``
    does not check: a flipped byte in a tensor would convert silently."""
    if not zipfile.is_zipfile(path):
        return  # the legacy format, or no zip at all: torch.load says what it is
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"{path} is damaged: its zip records cannot be read ({e}); use an "
                         "earlier checkpoint") from e
    if bad is not None:
        raise ValueError(
            f"{path} is damaged: record {bad} does not match the CRC-32 torch.save wrote for it "
            "(a flipped or overwritten byte); use an earlier checkpoint"
        )
