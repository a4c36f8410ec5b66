"""The nested structures of tensors that forward inputs and outputs are:
applying a function to every tensor in them (the hooks register on the
outputs, cast and move the inputs), as torch's FSDP1 walks them."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.nn.utils.rnn import PackedSequence


def map_tensors(
    fn: Callable[[torch.Tensor], torch.Tensor], obj: Any, *, in_place_mappings: bool = False
) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists, sets, dicts,
    namedtuples and dataclasses; return the same structure.

    As torch's ``_apply_to_tensors``: a ``PackedSequence`` gets ``fn`` applied
    to its data for the side effect and is returned as it was; plain dicts
    are copied.  Other mappings (``OrderedDict``, Hugging Face's
    ``ModelOutput``) are rebuilt as a new instance of their class, or, with
    ``in_place_mappings`` (forward inputs and outputs), updated in place so
    that whatever else the object carries stays.
    """

    # (a module-level recursion, not a nested function calling itself: such a
    # function is a reference cycle, garbage only the cyclic collector frees,
    # made again at every unit's forward)
    return _map(fn, obj, in_place_mappings)


def _map(fn: Callable[[torch.Tensor], torch.Tensor], x: Any, in_place: bool) -> Any:
    """:func:`map_tensors`'s recursion."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, PackedSequence):
        _map(fn, x.data, in_place)
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {f.name: _map(fn, getattr(x, f.name), in_place)
                   for f in dataclasses.fields(x) if f.init}
        return dataclasses.replace(x, **changes)
    if isinstance(x, dict):
        if type(x) is dict:
            return {k: _map(fn, v, in_place) for k, v in x.items()}
        if in_place:
            for k in list(x.keys()):
                x[k] = _map(fn, x[k], in_place)
            return x
        rebuilt = x.__class__()
        for k, v in x.items():
            rebuilt[k] = _map(fn, v, in_place)
        return rebuilt
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_map(fn, v, in_place) for v in x))
    if isinstance(x, (list, tuple, set)):
        return type(x)(_map(fn, v, in_place) for v in x)
    return x


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in ``obj`` to ``dtype``."""
    return map_tensors(
        lambda t: t.to(dtype) if t.is_floating_point() else t, obj, in_place_mappings=True
    )


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in ``obj`` to ``device`` (the root's forward inputs)."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), obj, in_place_mappings=True)


def grad_tensors(obj: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append to ``found`` every tensor in ``obj`` (the structures
    :func:`map_tensors` walks) that requires grad; return ``found``.  Builds
    nothing else: it runs on every unit's forward inputs."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            found.append(obj)
    elif isinstance(obj, (tuple, list, set)):  # (namedtuples and PackedSequence too)
        for v in obj:
            grad_tensors(v, found)
    elif isinstance(obj, dict):
        for v in obj.values():
            grad_tensors(v, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            grad_tensors(getattr(obj, f.name), found)
    return found
