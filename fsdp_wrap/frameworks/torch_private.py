"""torch's private FSDP1 names that frameworks touch, answered for fsdp_wrap's units.

RL trainers read and call parts of torch's FSDP1 that are not its public API
(:doc:`/frameworks/private_surface` lists them, framework by framework).
Installed, each is given torch's behaviour on fsdp_wrap's units and handles,
and nothing of it is part of fsdp_wrap's own API (``uninstall()`` takes it
away again):

* ``torch.distributed.fsdp._runtime_utils._lazy_init(state, root_module)``
  (verl's offload helpers): on an fsdp_wrap unit it runs fsdp_wrap's lazy
  initialisation and returns the unit; torch's states still go to torch's;
* a unit's ``_device_handle``: torch's own device handle for the unit's
  compute device (``synchronize``, ``current_stream``, ``is_available``...);
* a handle's ``_offload_params`` (``CPUOffload(offload_params=True)`` in
  force) and ``flat_param_to(*args, **kwargs)``: the flat parameter's data
  moved by ``Tensor.to`` and, with ``use_orig_params``, the original
  parameters' views refreshed, as torch's handle does;
* a flat parameter's ``_local_shard``: this rank's shard (the tensor the
  flat parameter holds between steps), set on the flat parameters of a tree
  when torch's ``_lazy_init`` is called on it (the way verl reaches them)
  and after each ``flat_param_to``, which makes the moved data the shard
  the handle gathers from (verl then sets ``_local_shard`` to it, as it
  does with torch's);
* ``torch.distributed.fsdp._common_utils._get_module_fsdp_state(module)`` and
  ``torch.distributed._composable_state._get_module_state(module)``: for an
  fsdp_wrap unit, the unit itself (a torch FSDP1 module is its own state, and
  the façade answers torch's state names); anything else still goes to
  torch's, so torch's units get torch's states;
* a unit's ``_fsdp_extension``: what torch's FSDP1 sets at construction,
  torch's ``DTensorExtensions`` over the unit's device handle when the unit
  was given a ``device_mesh`` sliced from a larger one (FSDP with tensor
  parallelism, :doc:`/two_d`), else ``None``; one object per unit.

torch functions that take a unit's private state and that fsdp_wrap cannot
honour are refused (:data:`REFUSED`) with an error naming the framework's
call and the public way; torch's own states still go to torch's functions.
"""

from __future__ import annotations

import importlib
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from fsdp_wrap.frameworks._patches import Patch
from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel
from fsdp_wrap.handle.flat_param import FlatParamHandle
from fsdp_wrap.handle.flat_tensor import HandleState
from fsdp_wrap.runtime.state import is_unit
from fsdp_wrap.state_dict.two_d import is_two_d

__all__ = ["REFUSED", "patches"]

_RUNTIME = "torch.distributed.fsdp._runtime_utils"
_COMMON = "torch.distributed.fsdp._common_utils"
_COMPOSABLE = "torch.distributed._composable_state"
_TP_FSDP = "torch.distributed.tensor.parallel.fsdp"

#: torch function -> the public fsdp_wrap way, for the functions refused on
#: fsdp_wrap's units.
REFUSED: dict[tuple[str, str], str] = {
    (_RUNTIME, "_unshard"): "FullyShardedDataParallel.summon_full_params(module)",
    (_RUNTIME, "_reshard"): "unit._handle.reshard(True) (or leave summon_full_params)",
    (_RUNTIME, "_root_pre_forward"): "calling the root unit (model(inputs))",
    (_RUNTIME, "_pre_forward"): "calling the unit (unit(inputs))",
    (_RUNTIME, "_post_backward_final_callback"): "a backward through the root unit",
    ("torch.distributed.fsdp._unshard_param_utils", "_unshard_params"):
        "FullyShardedDataParallel.summon_full_params(module)",
    ("torch.distributed.fsdp._unshard_param_utils", "_unshard_params_for_summon"):
        "FullyShardedDataParallel.summon_full_params(module)",
}


# ---------------------------------------------------------------- lazy init

def _lazy_init_for(torch_lazy_init: Callable[..., Any]) -> Callable[..., Any]:
    def _lazy_init(state: Any, root_module: nn.Module) -> Any:
        if is_unit(state):
            state._lazy_init()
            _publish_local_shards(state)
            return state
        return torch_lazy_init(state, root_module)

    _lazy_init.__doc__ = "torch's private lazy init; fsdp_wrap's own on fsdp_wrap's units."
    return _lazy_init


def _refusing(module_name: str, name: str, torch_fn: Callable[..., Any], way: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        ours = [a for a in (*args, *kwargs.values()) if is_unit(a)]
        if not ours:
            return torch_fn(*args, **kwargs)
        caller = _caller()
        raise NotImplementedError(
            f"{module_name}.{name}() is torch's private FSDP1 function; {caller} called it on "
            f"an fsdp_wrap unit, whose state it cannot read. Use the public {way} instead."
        )

    refuse.__name__ = name
    return refuse


def _caller() -> str:
    """``file:line (function)`` of the first frame outside this module and torch."""
    for frame in inspect.stack()[2:]:
        path = frame.filename
        if "/torch/" not in path and not path.endswith(__file__.rsplit("/", 1)[-1]):
            return f"{frame.function}() at {path}:{frame.lineno}"
    return "a caller"


# ------------------------------------------------------- units and handles

def _device_handle(unit: FullyShardedDataParallel) -> Any:
    common = importlib.import_module(_COMMON)
    return common._FSDPDeviceHandle.from_device(unit.compute_device)


def _offload_params(handle: FlatParamHandle) -> bool:
    return bool(handle.offload_params)


def _flat_param_to(handle: FlatParamHandle, *args: Any, **kwargs: Any) -> None:
    """torch's ``FlatParamHandle.flat_param_to``: ``.to()`` on the flat
    parameter's data; with ``use_orig_params`` the views follow."""
    handle.flat_param.data = handle.flat_param.to(*args, **kwargs)
    _adopt_moved_shard(handle)
    if handle.use_orig_params:
        if handle.state is HandleState.UNSHARDED:
            handle.use_unsharded_views(as_params=True)
        else:
            handle.use_sharded_views()


def _publish_local_shards(state: Any) -> None:
    """Give each flat parameter of ``state``'s tree torch's ``_local_shard``
    attribute: the shard its handle keeps (our flat parameters are plain
    ``nn.Parameter`` objects, so the attribute is set, not computed)."""
    for h in state._all_handles if state._is_root else state._handles:
        h.flat_param._local_shard = h.local_shard


def _adopt_moved_shard(handle: FlatParamHandle) -> None:
    """After ``flat_param_to`` between steps: the moved data is the shard from
    now on (torch's callers set ``_local_shard`` to it next; the handle
    must gather from it, and the old device's copy must be let go)."""
    if (handle.state is HandleState.UNSHARDED
            or handle.flat_param.data.shape != handle.local_shard.shape):
        return
    handle.adopt_flat_param_data()  # (the handle's own take-up of replaced data)
    handle.flat_param._local_shard = handle.local_shard  # type: ignore[attr-defined]


# ------------------------------------------------------------ unit states

def _state_lookup(torch_lookup: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``_get_module_fsdp_state`` / ``_get_module_state``, answering
    the unit itself for an fsdp_wrap unit (torch's FSDP1 module is its state)."""

    def lookup(module: nn.Module) -> Any:
        if isinstance(module, FullyShardedDataParallel):
            return module
        return torch_lookup(module)

    lookup.__name__ = getattr(torch_lookup, "__name__", "lookup")
    lookup.__doc__ = "torch's private state lookup; an fsdp_wrap unit is its own state."
    return lookup


#: unit -> its ``_fsdp_extension`` (made at the first read: one object per unit).
_EXTENSIONS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _extension_property(extension_cls: type) -> property:
    """A unit's ``_fsdp_extension``: torch's ``extension_cls(device handle)``
    when the unit's ``device_mesh`` is a slice of a larger mesh, as torch's
    ``_init_extension`` decides at construction, else ``None``."""

    def get(unit: FullyShardedDataParallel) -> Any:
        if unit not in _EXTENSIONS:
            two_d = is_two_d(unit._fsdp_state)
            _EXTENSIONS[unit] = extension_cls(_device_handle(unit)) if two_d else None
        return _EXTENSIONS[unit]

    def set_(unit: FullyShardedDataParallel, value: Any) -> None:
        _EXTENSIONS[unit] = value

    return property(get, set_, doc="torch's FSDP1 tensor-parallel extension of the unit.")


def _state_patches(patches: list[Any], originals: dict[int, Any]) -> None:
    for module_name, name in ((_COMMON, "_get_module_fsdp_state"),
                              (_COMPOSABLE, "_get_module_state")):
        mod = _import(module_name)
        fn = getattr(mod, name, None)
        if mod is not None and callable(fn):
            ours = _state_lookup(fn)
            originals[id(fn)] = ours
            patches.append(Patch(mod, name, ours))
    extension_cls = getattr(_import(_TP_FSDP), "DTensorExtensions", None)
    if extension_cls is not None and _import(_COMMON) is not None:
        patches.append(Patch(FullyShardedDataParallel, "_fsdp_extension",
                             _extension_property(extension_cls)))


# ------------------------------------------------------------------ install

def _import(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def patches(patches: list[Any], originals: dict[int, Any]) -> None:
    """Append the patches giving torch's private names fsdp_wrap's answers;
    fill ``originals`` (torch's function -> ours) for earlier importers."""
    runtime = _import(_RUNTIME)
    torch_lazy = getattr(runtime, "_lazy_init", None)
    if runtime is not None and torch_lazy is not None:
        ours = _lazy_init_for(torch_lazy)
        originals[id(torch_lazy)] = ours
        patches.append(Patch(runtime, "_lazy_init", ours))
    for (module_name, name), way in REFUSED.items():
        mod = _import(module_name)
        fn = getattr(mod, name, None)
        if mod is not None and callable(fn):
            wrapper = _refusing(module_name, name, fn, way)
            originals[id(fn)] = wrapper
            patches.append(Patch(mod, name, wrapper))
    if _import(_COMMON) is not None:
        patches.append(Patch(FullyShardedDataParallel, "_device_handle", property(_device_handle)))
    patches.append(Patch(FlatParamHandle, "_offload_params", property(_offload_params)))
    patches.append(Patch(FlatParamHandle, "flat_param_to", _flat_param_to))
    _state_patches(patches, originals)
