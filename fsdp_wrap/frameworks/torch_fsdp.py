"""What :func:`fsdp_wrap.install` changes in torch: FSDP1's names and DCP's lookup.

* On ``torch.distributed.fsdp`` and its public submodules
  (``fully_sharded_data_parallel``, ``api``, ``wrap``, ``sharded_grad_scaler``),
  the FSDP1 names (the class, enums, configs, wrap policies, ``wrap`` /
  ``enable_wrap``, ``ShardedGradScaler``) become fsdp_wrap's; a submodule
  missing from the installed torch (FSDP1 removed) is created.
* DCP's ``torch.distributed.checkpoint.state_dict`` helpers ask torch's
  private FSDP state lookup, which only knows torch's units, and test hybrid
  strategies against torch's own enum members: both are given fsdp_wrap's
  answers as well.

This module is the one place in fsdp_wrap that imports torch's FSDP1, and
only to replace its names.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch.nn as nn

import fsdp_wrap.api as api
import fsdp_wrap.wrap as wrap
from fsdp_wrap.api import HYBRID_STRATEGIES
from fsdp_wrap.frameworks._patches import Patch
from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
from fsdp_wrap.sharded_grad_scaler import ShardedGradScaler

__all__ = ["PKG", "dcp_patches", "module_patches"]

PKG = "torch.distributed.fsdp"
_API_NAMES = (
    "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType",
    "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig", "ShardedStateDictConfig",
    "OptimStateDictConfig", "FullOptimStateDictConfig", "LocalOptimStateDictConfig",
    "ShardedOptimStateDictConfig", "StateDictSettings",
)
_WRAP_PUBLIC = (
    "always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy", "enable_wrap", "wrap", "CustomPolicy", "ModuleWrapPolicy",
)
# Torch's private wrap helpers that other torch code imports from ``wrap``
# (activation checkpointing's ``apply_activation_checkpointing``).  Torch's own
# work with fsdp_wrap's policies, so they are only provided where torch has none.
_WRAP_PRIVATE = ("_Policy", "_recursive_wrap", "_or_policy", "_module_wrap_policy",
                 "_wrap_module_cls_individually")


def _ours() -> dict[str, dict[str, Any]]:
    """Module name -> {attribute: fsdp_wrap's object} for torch's FSDP1 surface."""
    api_objs = {n: getattr(api, n) for n in _API_NAMES}
    core = {**api_objs, "FullyShardedDataParallel": FullyShardedDataParallel,
            "OptimStateKeyType": OptimStateKeyType}
    return {
        PKG: dict(core),
        f"{PKG}.fully_sharded_data_parallel": dict(core),
        f"{PKG}.api": dict(api_objs),
        f"{PKG}.wrap": {n: getattr(wrap, n) for n in _WRAP_PUBLIC},
        f"{PKG}.sharded_grad_scaler": {"ShardedGradScaler": ShardedGradScaler},
    }


def _import(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def module_patches(patches: list[Any], originals: dict[int, Any]) -> dict[str, Any]:
    """Patches setting fsdp_wrap's names on torch's FSDP1 modules (creating any
    that are missing); fills ``originals`` (id of torch's object -> ours).
    Returns the modules patched, by name."""
    pkg = _import(PKG)
    if pkg is None:  # no FSDP at all in this torch: make the package too
        pkg = types.ModuleType(PKG)
        pkg.__path__ = []  # a package, so submodules can be imported from it
        patches.append(Patch(sys.modules, PKG, pkg))
        parent = importlib.import_module("torch.distributed")
        patches.append(Patch(parent, "fsdp", pkg))
    modules: dict[str, Any] = {PKG: pkg}
    for mod_name, names in _ours().items():
        mod = pkg if mod_name == PKG else _import(mod_name)
        if mod is None:
            mod = types.ModuleType(mod_name, f"torch's FSDP1 {mod_name} names, provided by fsdp_wrap")
            if mod_name.endswith(".wrap"):
                names = dict(names, **{n: getattr(wrap, n) for n in _WRAP_PRIVATE})
            patches.append(Patch(sys.modules, mod_name, mod))
            patches.append(Patch(pkg, mod_name.rsplit(".", 1)[1], mod))
        modules[mod_name] = mod
        for attr, new in names.items():
            old = getattr(mod, attr, None)
            if old is not None and old is not new:
                originals[id(old)] = new
            patches.append(Patch(mod, attr, new))
    return modules


def dcp_patches(patches: list[Any], originals: dict[int, Any]) -> None:
    """Let ``torch.distributed.checkpoint.state_dict`` see fsdp_wrap's units."""
    common = _import(f"{PKG}._common_utils")
    lookup = getattr(common, "_get_module_fsdp_state_if_fully_sharded_module", None)
    if common is not None and lookup is not None:
        torch_lookup = lookup

        def fsdp_state_of(module: nn.Module) -> Any:
            if isinstance(module, FullyShardedDataParallel):
                return module
            return torch_lookup(module)

        originals[id(torch_lookup)] = fsdp_state_of
        patches.append(Patch(common, "_get_module_fsdp_state_if_fully_sharded_module",
                             fsdp_state_of))
    init_utils = _import(f"{PKG}._init_utils")
    hybrid = getattr(init_utils, "HYBRID_SHARDING_STRATEGIES", None)
    if hybrid is not None:
        both = set(hybrid) | set(HYBRID_STRATEGIES)
        originals[id(hybrid)] = both
        patches.append(Patch(init_utils, "HYBRID_SHARDING_STRATEGIES", both))
