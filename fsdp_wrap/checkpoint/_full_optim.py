"""Optimizer state in full safetensors checkpoints (``optimizer-*.safetensors``).

Saving starts from the SHARDED optimizer state dict, which fsdp_wrap builds
without gathering anything (each rank gets the dim-0 chunks of every state it
owns).  Each chunk then travels to rank 0 in windows of bounded size, as the
parameters do, and is written at its place in the full tensor.  Tensors are
named ``state.<parameter fqn>.<state name>`` (0-dim ``step`` included); the
``param_groups`` (parameters listed by FQN, as in FULL optimizer state dicts)
and any non-tensor state go into the index's ``metadata.objects``.

Loading reads, on every rank, only the rows of its own chunk of each state,
wraps them as a SHARDED optimizer state dict and hands that to
``optim_state_dict_to_load``, which moves the pieces into the flat shards
without gathering.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import fsdp_wrap.checkpoint._safetensors as _safetensors
import fsdp_wrap.state_dict.chunks as CH
from fsdp_wrap.api import StateDictType
from fsdp_wrap.checkpoint._safetensors import Entry

if TYPE_CHECKING:
    from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

PREFIX = "optimizer"


def _fsdp_cls() -> type[FSDP]:
    from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel

    return FullyShardedDataParallel


def sharded_state(root: FSDP, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's SHARDED optimizer state dict (a collective; nothing gathered)."""
    cls = _fsdp_cls()
    with cls.state_dict_type(root, StateDictType.SHARDED_STATE_DICT):
        osd: dict[str, Any] = cls.optim_state_dict(root, optim)
    return osd


def plan(osd: dict[str, Any]) -> tuple[list[Entry], dict[str, Any]]:
    """The tensors to write (full shapes) and the JSON objects for the index."""
    entries: list[Entry] = []
    other: dict[str, dict[str, Any]] = {}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            key = f"state.{fqn}.{name}"
            if CH.is_chunked(v):
                entries.append(Entry(key, tuple(v.size()), v.dtype))
            elif isinstance(v, torch.Tensor):
                entries.append(Entry(key, tuple(v.shape), v.dtype))
            else:
                other.setdefault(fqn, {})[name] = v
    objects: dict[str, Any] = {"param_groups": osd["param_groups"]}
    if other:
        objects["state"] = other
    try:
        json.dumps(objects)
    except TypeError as e:
        raise TypeError(
            f"the optimizer's param_groups or non-tensor state cannot be stored as JSON ({e}); "
            "save the optimizer state with the SHARDED DCP recipe instead"
        ) from e
    return entries, objects


def _local(value: Any) -> torch.Tensor:
    if CH.is_dtensor(value):
        return value.to_local()
    shards = value.local_shards()
    return shards[0].tensor if shards else torch.empty(0, dtype=value.dtype)


def stream(root: FSDP, osd: dict[str, Any], sink: Any, window_bytes: int) -> None:
    """Move every chunk of every state to global rank 0 in windows; rank 0 writes them."""
    pg = root.process_group
    ws = dist.get_world_size(pg)
    members = [dist.get_global_rank(pg, r) for r in range(ws)]
    if 0 not in members:
        return  # another replica holds the same chunks
    dest = members.index(0)
    me = dist.get_rank(pg)
    bufs: dict[torch.dtype, torch.Tensor] = {}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            key = f"state.{fqn}.{name}"
            if not CH.is_chunked(v):
                if me == dest and isinstance(v, torch.Tensor):
                    sink.write(key, 0, v.detach().reshape(-1))
                continue
            shape = tuple(v.size())
            row = math.prod(shape[1:])
            local = _local(v).detach().reshape(-1)
            window = max(1, window_bytes // local.element_size())
            for r in range(ws):
                start, rows = CH.chunk_rows(shape[0], ws, r)
                n = rows * row
                for w0 in range(0, n, window):
                    w1 = min(n, w0 + window)
                    if me == dest:
                        if r == me:
                            piece = local[w0:w1]
                        else:
                            buf = bufs.get(v.dtype)
                            if buf is None or buf.numel() < w1 - w0:
                                buf = torch.empty(window, dtype=v.dtype, device=local.device)
                                bufs[v.dtype] = buf
                            piece = buf[: w1 - w0]
                            dist.recv(piece, src=members[r], group=pg)
                        sink.write(key, start * row + w0, piece)
                    elif me == r:
                        dist.send(local[w0:w1].contiguous(), dst=0, group=pg)


# ---------------------------------------------------------------------- load


def check(
    path: str, param_shapes: dict[str, tuple[int, ...]], rank: int
) -> tuple[dict[str, _safetensors.StoredTensor], dict[str, Any]]:
    """The stored states and the index objects; raises on the first state that does not
    fit the model (before anything is touched)."""
    index = _safetensors.read_index(path, PREFIX)
    if index is None:
        raise FileNotFoundError(
            f"[rank {rank}] checkpoint {path} holds no optimizer state "
            f"({PREFIX}.safetensors.index.json); save it with save_full_checkpoint(..., optim=...)"
        )
    stored = _safetensors.stored_tensors(path, PREFIX)
    for key, st in stored.items():
        fqn = key[len("state.") :].rpartition(".")[0]
        want = param_shapes.get(fqn)
        if want is None:
            raise KeyError(
                f"[rank {rank}] checkpoint {path}: optimizer state '{key}' is for '{fqn}', which "
                "the model does not have; load a checkpoint saved from this model"
            )
        if st.shape not in ((), want):
            raise ValueError(
                f"[rank {rank}] checkpoint {path}: optimizer state '{key}' has shape "
                f"{list(st.shape)} but parameter '{fqn}' is {list(want)}"
            )
    objects: dict[str, Any] = index.get("metadata", {}).get("objects", {})
    if "param_groups" not in objects:
        raise ValueError(f"[rank {rank}] checkpoint {path}: the optimizer index has no param_groups")
    return stored, objects


def load(
    root: FSDP, optim: torch.optim.Optimizer, stored: dict[str, _safetensors.StoredTensor],
    objects: dict[str, Any],
) -> None:
    """Read this rank's chunks, then ``optim_state_dict_to_load`` (a collective, no gather)."""
    layout = CH.chunk_layout(root._fsdp_state, False)
    state: dict[str, dict[str, Any]] = {}
    files: dict[str, Any] = {}
    try:
        for key, st in stored.items():
            fqn, _, name = key[len("state.") :].rpartition(".")
            if st.file not in files:
                files[st.file] = open(st.file, "rb")  # noqa: SIM115
            f = files[st.file]
            if not st.shape:
                value: Any = _safetensors.read_tensor(st, f)
            else:
                row = math.prod(st.shape[1:])
                start, rows = CH.chunk_rows(st.shape[0], layout.world_size, layout.rank)
                flat = _safetensors.read_flat_range(st, start * row, rows * row, f)
                local = flat.view(rows, *st.shape[1:]).to(root.compute_device)
                value = CH.wrap_chunk(local, torch.Size(st.shape), st.dtype, layout, False)
            state.setdefault(fqn, {})[name] = value
    finally:
        for fh in files.values():
            fh.close()
    for fqn, extra in objects.get("state", {}).items():
        state.setdefault(fqn, {}).update(extra)
    osd = {"state": state, "param_groups": objects["param_groups"]}
    cls = _fsdp_cls()
    with cls.state_dict_type(root, StateDictType.SHARDED_STATE_DICT):
        to_load = cls.optim_state_dict_to_load(root, optim, osd)
    optim.load_state_dict(to_load)
