"""Can this machine honour the constructor's arguments?  Checked before any collective.

An argument naming a device the machine does not have, a process group whose
backend cannot carry the compute device's tensors, or a mixed-precision dtype
the device cannot compute in used to fail deep inside torch (``Torch not
compiled with CUDA enabled``, ``Invalid scalar type`` at the first
all-gather, ``"div_cpu_reduced_float" not implemented``), naming no argument.
Here each is refused when the unit is built, on every rank alike, with the
argument, the value, and what would work on this machine.

The dtype checks run a few operations on two-element tensors of the dtype on
the compute device (cast, add, and for ``param_dtype`` a matmul, for
``reduce_dtype`` a division: what FSDP itself does in that dtype), once per
``(device, dtype)`` per process.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from fsdp_wrap.comm.collectives import global_rank

__all__ = [
    "check_device_id",
    "check_mixed_precision",
    "check_group_device",
    "check_mesh_device",
]

# The floating dtypes offered as alternatives (those the device computes with).
_COMMON_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tag() -> str:
    return f" [rank {global_rank()}]"


def _device_count(kind: str) -> int | None:
    """Devices of type ``kind`` this process can use; ``None`` if torch cannot tell."""
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    module = getattr(torch, kind, None)
    is_available = getattr(module, "is_available", None)
    if not callable(is_available):
        return None
    try:
        if not is_available():
            return 0
        count = getattr(module, "device_count", None)
        return int(count()) if callable(count) else 1
    except Exception:  # noqa: BLE001  (a backend's own probe failing: it cannot be used)
        return 0


def _here() -> str:
    """The devices this machine offers, for messages."""
    found = []
    for kind in ("cuda", "xpu", "mps", "hpu", "mtia"):
        n = _device_count(kind)
        if n:
            found.append(f"{n} {kind.upper() if kind == 'cuda' else kind} device(s) "
                         f"({kind}:0..{kind}:{n - 1})")
    return ", ".join(found) if found else "no accelerator (CPU only)"


def _suggestion() -> str:
    if torch.cuda.is_available():
        return "device_id=torch.cuda.current_device() (the GPU of this rank)"
    return "device_id=torch.device('cpu') or leave device_id out (the module's device)"


def _shown(device_id: Any) -> str:
    return f"torch.device({str(device_id)!r})" if isinstance(device_id, torch.device) else repr(device_id)


def check_device_id(device_id: Any) -> torch.device | None:
    """``device_id`` as a ``torch.device`` this machine has; ``None`` stays ``None``.

    An int is a CUDA device index (as torch's FSDP1 reads it on a CUDA
    machine).  ``cuda`` without an index means this rank's current device.
    """
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"device_id expects an int (a CUDA device index), a str or a torch.device but got "
            f"{device_id!r} of type {type(device_id).__name__}{_tag()}; pass e.g. {_suggestion()}"
        )
    if isinstance(device_id, int):
        if device_id < 0:
            raise ValueError(
                f"device_id={device_id} is not a device index (it must be >= 0){_tag()}; "
                f"pass e.g. {_suggestion()}"
            )
        device = torch.device("cuda", device_id)
    else:
        try:
            device = torch.device(device_id)
        except RuntimeError as e:
            raise RuntimeError(
                f"device_id={device_id!r} is not a device torch knows{_tag()} "
                f"({str(e).splitlines()[0]}); devices here: {_here()}. Pass e.g. {_suggestion()}"
            ) from None
    if device.type in ("cpu", "meta"):
        if device.type == "meta":
            raise ValueError(
                f"device_id={device} cannot hold the unit's parameters{_tag()}: FSDP needs a "
                "device that computes; build the module on the meta device and pass "
                f"{_suggestion()} (meta tensors are materialised there)"
            )
        return device
    count = _device_count(device.type)
    if count is None:
        return device  # a backend torch cannot enumerate (e.g. privateuse1): let it try
    if count == 0 or (device.index is not None and device.index >= count):
        if count == 0:
            what = f"no {device.type} device"
            if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
                what += " (this torch is built without CUDA)"
        else:
            what = f"only {count} {device.type} device(s) ({device.type}:0..{device.type}:{count - 1})"
        raise RuntimeError(
            f"device_id={_shown(device_id)} cannot be used on this machine{_tag()}: it has "
            f"{what}; devices here: {_here()}. Pass {_suggestion()}"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ------------------------------------------------------------------ dtypes

# What FSDP does in each dtype on the compute device, as (name, op) pairs.
_OPS: dict[str, tuple[tuple[str, Any], ...]] = {
    "param_dtype": (
        ("casting float32 parameters to it", lambda t: t),
        ("a matmul (the forward's compute)", lambda t: t.view(2, 1) @ t.view(1, 2)),
        ("adding two tensors (gradient accumulation)", lambda t: t + t),
    ),
    "reduce_dtype": (
        ("casting gradients to it", lambda t: t),
        ("adding two tensors (the reduction)", lambda t: t + t),
        ("dividing by the world size (gradient averaging)", lambda t: t.div_(2)),
    ),
    "buffer_dtype": (
        ("casting float32 buffers to it", lambda t: t),
        ("adding two tensors (a buffer update)", lambda t: t + t),
    ),
}


@functools.lru_cache(maxsize=64)
def _failing_op(field: str, device: str, dtype: torch.dtype) -> str | None:
    """The first of ``field``'s operations that fails in ``dtype`` on ``device``, else ``None``."""
    for what, op in _OPS[field]:
        try:
            op(torch.ones(2, device=device).to(dtype))
        except Exception as e:  # noqa: BLE001  (any failure: the dtype cannot be used here)
            return f"{what} fails: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _usable(field: str, device: str) -> str:
    ok = [str(d).replace("torch.", "") for d in _COMMON_FLOATS if _failing_op(field, device, d) is None]
    return ", ".join(ok) or "none"


def check_mixed_precision(mp: Any, device: torch.device) -> None:
    """Each dtype of ``mp`` is ``None`` or a floating dtype ``device`` can compute in."""
    if mp is None:
        return
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(mp, field, None)
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"mixed_precision.{field} expects a torch.dtype or None but got {dtype!r} of type "
                f"{type(dtype).__name__}{_tag()}; pass e.g. {field}=torch.bfloat16"
            )
        if not dtype.is_floating_point:
            raise ValueError(
                f"mixed_precision.{field}={dtype} is not a floating-point dtype{_tag()}: FSDP "
                f"casts floating parameters, gradients and buffers to it; floating dtypes "
                f"{device} computes in: {_usable(field, str(device))}"
            )
        if device.type == "meta":
            continue
        failure = _failing_op(field, str(device), dtype)
        if failure is not None:
            raise ValueError(
                f"mixed_precision.{field}={dtype} cannot be used on {device}{_tag()}: {failure}. "
                f"Floating dtypes {device} computes in: {_usable(field, str(device))}"
            )


# ----------------------------------------------------------- process groups


def _group_device_types(group: Any) -> set[str] | None:
    types = getattr(group, "_device_types", None)
    if not types:
        return None
    return {torch.device(t).type for t in types}


def check_group_device(groups: list[Any], device: torch.device, arg: str) -> None:
    """Every group's backend can carry tensors of ``device``'s type (``arg`` names
    the argument the groups came from, e.g. ``process_group``)."""
    if device.type == "meta":
        return
    for group in groups:
        if group is None:
            continue
        types = _group_device_types(group)
        if types is None or device.type in types:
            continue
        try:
            backend = str(dist.get_backend(group))
        except Exception:  # noqa: BLE001  (a group torch cannot name)
            backend = "?"
        works = "gloo" if device.type == "cpu" else "nccl" if device.type == "cuda" else "a backend for it"
        raise RuntimeError(
            f"{arg}'s backend ({backend!r}) cannot carry {device.type} tensors{_tag()}: it handles "
            f"{', '.join(sorted(types))} only, and the unit computes on {device}. Initialise the "
            f"process group with a backend for {device.type} (e.g. {works!r}, or "
            f"'cpu:gloo,cuda:nccl' for both), or pass a device_id of type "
            f"{' or '.join(sorted(types))}"
        )


def check_mesh_device(device_mesh: Any, device: torch.device) -> None:
    """A device mesh's device type is the compute device's."""
    if device_mesh is None or device.type == "meta":
        return
    kind = getattr(device_mesh, "device_type", None)
    if kind is not None and kind != device.type:
        raise ValueError(
            f"device_mesh is a {kind!r} mesh but the unit computes on {device}{_tag()}: the "
            f"state dicts' DTensors and the collectives live on the mesh's device type. Build "
            f"the mesh with init_device_mesh({device.type!r}, ...), or pass a device_id of type "
            f"{kind!r}"
        )
