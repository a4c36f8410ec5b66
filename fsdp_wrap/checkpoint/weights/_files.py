"""Finding the tensors of a Hugging Face checkpoint: headers only, no data read (but
fsdp_wrap's own saves are checked whole against the sizes and CRC-32s their marker
records)."""

from __future__ import annotations

import os
from collections.abc import Callable

import fsdp_wrap.checkpoint._atomic as _atomic
import fsdp_wrap.checkpoint._safetensors as _st
from fsdp_wrap.checkpoint._safetensors import StoredTensor
from fsdp_wrap.comm.collectives import global_rank

__all__ = ["stored_tensors"]


def stored_tensors(path: str, verify: bool = True) -> dict[str, StoredTensor]:
    """Every tensor of ``path``: a directory as ``save_pretrained`` writes it
    (``model.safetensors``, or ``model.safetensors.index.json`` and the files it
    names) or one ``.safetensors`` file.  ``verify``: what fsdp_wrap wrote is
    checked whole (its marker, each file's CRC-32) before anything is read."""
    tag = f"[rank {global_rank()}]"
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{tag} expected a checkpoint path (str) but got {type(path).__name__}")
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(
                f"{tag} {path} is not a .safetensors file; pass the directory save_pretrained wrote "
                "or one .safetensors file"
            )
        if verify:
            _check(lambda: _st.check_seal(path), tag)  # (one fsdp_wrap wrote: intact)
        return _st.read_header(path)[0]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{tag} no checkpoint at {path}: neither a directory nor a file")
    if _atomic.read_marker(path) is not None:  # fsdp_wrap's own save: complete, files intact
        _check(lambda: _atomic.check_complete(path, verify), tag)
    elif verify:  # foreign, unless its files say fsdp_wrap wrote them (the marker is missing)
        _check(lambda: _atomic.check_unmarked(path), tag)
    try:
        return _st.stored_tensors(path)
    except FileNotFoundError:
        if any(n.endswith(".bin") for n in os.listdir(path)):
            raise FileNotFoundError(
                f"{tag} {path} holds a PyTorch .bin checkpoint, not safetensors; save it again with "
                "save_pretrained(..., safe_serialization=True) (the default)"
            ) from None
        raise


def _check(fn: Callable[[], object], tag: str) -> None:
    """Run a check; its ``ValueError`` again with this rank's tag in front."""
    try:
        fn()
    except ValueError as e:
        raise ValueError(f"{tag} {e}") from e
