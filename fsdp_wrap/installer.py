"""Run code written for torch's FSDP1 on fsdp_wrap without changing it.

:func:`install` points torch's FSDP1 public names at fsdp_wrap's, so that
Hugging Face Accelerate (and the transformers ``Trainer``), Lightning (Fabric
and Trainer), ``torch.distributed.checkpoint.state_dict`` and any script
importing ``torch.distributed.fsdp.FullyShardedDataParallel`` build and
recognise fsdp_wrap's units::

    import fsdp_wrap
    fsdp_wrap.install()          # before the framework wraps the model

or, with no code change at all, ``FSDP_WRAP_INSTALL=1`` in the environment of
every process (read at interpreter start-up by the ``fsdp_wrap-install.pth``
hook this package installs; ``fsdp-wrap run -- CMD`` sets it for you).

What it does, in one step that either completes or leaves nothing changed:

* sets, on ``torch.distributed.fsdp`` and its public submodules
  (``fully_sharded_data_parallel``, ``api``, ``wrap``, ``sharded_grad_scaler``),
  the FSDP1 names (the class, enums, configs, wrap policies, ``wrap`` /
  ``enable_wrap``, ``ShardedGradScaler``) to fsdp_wrap's; a submodule missing
  from the installed torch (FSDP1 removed) is created;
* rebinds every already-imported module attribute that *is* one of torch's
  FSDP1 objects (``from torch.distributed.fsdp import FullyShardedDataParallel
  as FSDP`` done before ``install()``) to fsdp_wrap's, torch's own FSDP1
  internals (``torch.distributed.fsdp._*``) excepted, so torch's FSDP1 keeps
  working for anyone holding it directly;
* teaches DCP's ``state_dict`` helpers to recognise fsdp_wrap's units (they
  ask torch's private FSDP state lookup, which only knows torch's units);
* makes Accelerate's sharded optimizer load exact for fsdp_wrap's units
  (:mod:`fsdp_wrap.installer_accelerate`: a fresh optimizer is given state
  shaped by the checkpoint before Accelerate builds its load template), now if
  Accelerate is imported, else when it is.

:func:`uninstall` undoes exactly what :func:`install` did.  This module is the
one place in fsdp_wrap that imports torch's FSDP1, and only to replace it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

import fsdp_wrap.api as api
import fsdp_wrap.installer_accelerate as _acc
import fsdp_wrap.wrap as wrap
from fsdp_wrap._compat import __version__
from fsdp_wrap.api import HYBRID_STRATEGIES
from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
from fsdp_wrap.sharded_grad_scaler import ShardedGradScaler

__all__ = ["ENV_VAR", "PTH_NAME", "install", "installed", "startup_hook_path", "uninstall"]

#: ``FSDP_WRAP_INSTALL=1`` (or ``true``/``yes``/``on``) installs at start-up.
ENV_VAR = "FSDP_WRAP_INSTALL"
#: The start-up hook pip puts in site-packages (written by setup.py).
PTH_NAME = "fsdp_wrap-install.pth"

logger = logging.getLogger("fsdp_wrap.installer")

_PKG = "torch.distributed.fsdp"
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
        _PKG: dict(core),
        f"{_PKG}.fully_sharded_data_parallel": dict(core),
        f"{_PKG}.api": dict(api_objs),
        f"{_PKG}.wrap": {n: getattr(wrap, n) for n in _WRAP_PUBLIC},
        f"{_PKG}.sharded_grad_scaler": {"ShardedGradScaler": ShardedGradScaler},
    }


class _Patch:
    """One attribute set (or one module created); knows how to undo itself."""

    _MISSING = object()

    def __init__(self, owner: Any, name: str, new: Any) -> None:
        self.owner, self.name, self.new = owner, name, new
        self.old = getattr(owner, name, self._MISSING) if not isinstance(owner, dict) \
            else owner.get(name, self._MISSING)

    def apply(self) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.name] = self.new
        else:
            setattr(self.owner, self.name, self.new)

    def undo(self) -> None:
        missing = self.old is self._MISSING
        if isinstance(self.owner, dict):
            if missing:
                self.owner.pop(self.name, None)
            else:
                self.owner[self.name] = self.old
        elif missing:
            if hasattr(self.owner, self.name):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.old)


_lock = threading.Lock()
_applied: list[Any] = []  # (_Patch or _MetaPathEntry, in the order applied)


def installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    return bool(_applied)


def _import(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _plan_module_patches(patches: list[_Patch], originals: dict[int, Any]) -> dict[str, Any]:
    """Patches setting fsdp_wrap's names on torch's FSDP1 modules (creating any
    that are missing); fills ``originals`` (id of torch's object -> ours)."""
    pkg = _import(_PKG)
    if pkg is None:  # no FSDP at all in this torch: make the package too
        pkg = types.ModuleType(_PKG)
        pkg.__path__ = []  # a package, so submodules can be imported from it
        patches.append(_Patch(sys.modules, _PKG, pkg))
        parent = importlib.import_module("torch.distributed")
        patches.append(_Patch(parent, "fsdp", pkg))
    modules: dict[str, Any] = {_PKG: pkg}
    for mod_name, names in _ours().items():
        mod = pkg if mod_name == _PKG else _import(mod_name)
        if mod is None:
            mod = types.ModuleType(mod_name, f"torch's FSDP1 {mod_name} names, provided by fsdp_wrap")
            if mod_name.endswith(".wrap"):
                names = dict(names, **{n: getattr(wrap, n) for n in _WRAP_PRIVATE})
            patches.append(_Patch(sys.modules, mod_name, mod))
            patches.append(_Patch(pkg, mod_name.rsplit(".", 1)[1], mod))
        modules[mod_name] = mod
        for attr, new in names.items():
            old = getattr(mod, attr, None)
            if old is not None and old is not new:
                originals[id(old)] = new
            patches.append(_Patch(mod, attr, new))
    return modules


def _dcp_patches(patches: list[_Patch], originals: dict[int, Any]) -> None:
    """Let ``torch.distributed.checkpoint.state_dict`` see fsdp_wrap's units.

    It asks torch's private ``_get_module_fsdp_state_if_fully_sharded_module``
    whether each FSDP module has FSDP state, and tests hybrid strategies against
    torch's own enum members; both are given fsdp_wrap's answers as well.
    """
    common = _import(f"{_PKG}._common_utils")
    lookup = getattr(common, "_get_module_fsdp_state_if_fully_sharded_module", None)
    if common is not None and lookup is not None:
        torch_lookup = lookup

        def fsdp_state_of(module: nn.Module) -> Any:
            if isinstance(module, FullyShardedDataParallel):
                return module
            return torch_lookup(module)

        originals[id(torch_lookup)] = fsdp_state_of
        patches.append(_Patch(common, "_get_module_fsdp_state_if_fully_sharded_module",
                              fsdp_state_of))
    init_utils = _import(f"{_PKG}._init_utils")
    hybrid = getattr(init_utils, "HYBRID_SHARDING_STRATEGIES", None)
    if hybrid is not None:
        both = set(hybrid) | set(HYBRID_STRATEGIES)
        originals[id(hybrid)] = both
        patches.append(_Patch(init_utils, "HYBRID_SHARDING_STRATEGIES", both))


class _MetaPathEntry:
    """A finder put first on ``sys.meta_path``; undone by taking it off."""

    def __init__(self, finder: Any) -> None:
        self.finder = finder

    def apply(self) -> None:
        sys.meta_path.insert(0, self.finder)

    def undo(self) -> None:
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)


def _accelerate_patches(patches: list[Any], originals: dict[int, Any]) -> None:
    """Wrap Accelerate's ``load_fsdp_optimizer`` (see :mod:`fsdp_wrap.installer_accelerate`)."""
    module = sys.modules.get(_acc.MODULE)
    if module is None:
        def patch_when_imported(mod: types.ModuleType) -> None:
            original = _acc.original_in(mod)
            if original is not None:
                p = _Patch(mod, _acc.FUNCTION, _acc.wrap(original))
                p.apply()
                _applied.append(p)

        patches.append(_MetaPathEntry(_acc._AfterImport(_acc.MODULE, patch_when_imported)))
        return
    original = _acc.original_in(module)
    if original is not None:
        wrapped = _acc.wrap(original)
        originals[id(original)] = wrapped  # (accelerate.utils, the Trainer: rebound below)
        patches.append(_Patch(module, _acc.FUNCTION, wrapped))


def _importers(originals: dict[int, Any], skip: set[str]) -> Iterator[_Patch]:
    """Attributes of already-imported modules bound to one of torch's objects."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name in skip or mod_name.startswith(("fsdp_wrap", f"{_PKG}._")):
            continue
        try:
            namespace = vars(mod)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            new = originals.get(id(value))
            if new is not None:
                yield _Patch(mod, attr, new)


def install(verbose: bool = True) -> None:
    """Point torch's FSDP1 names at fsdp_wrap's (see the module docstring).

    Idempotent; call it any time before the framework wraps the model.  Models
    wrapped by torch's FSDP1 before the call stay torch's.  Logs one line
    (logger ``fsdp_wrap.installer``, and stderr when logging is not configured)
    unless ``verbose=False``.
    """
    with _lock:
        if _applied:
            return
        patches: list[Any] = []
        originals: dict[int, Any] = {}
        modules = _plan_module_patches(patches, originals)
        _dcp_patches(patches, originals)
        _accelerate_patches(patches, originals)
        rebinds = list(_importers(originals, skip=set(modules) | {_acc.MODULE}))
        patches.extend(rebinds)
        done: list[Any] = []
        try:
            for p in patches:
                p.apply()
                done.append(p)
        except BaseException:
            for p in reversed(done):
                p.undo()
            raise
        _applied.extend(done)
    if verbose:
        rebound = len(rebinds)
        created = [p.name for p in done if isinstance(getattr(p, "owner", None), dict)]
        _say(f"fsdp_wrap.install(): torch.distributed.fsdp's FSDP1 names now point at fsdp_wrap "
             f"{_version()} ({rebound} earlier imports rebound"
             + (f"; created {', '.join(created)}" if created else "") + ")")


def uninstall(verbose: bool = False) -> None:
    """Undo :func:`install`: torch's FSDP1 names are torch's again.

    Units already built by fsdp_wrap stay fsdp_wrap's.
    """
    with _lock:
        while _applied:
            _applied.pop().undo()
        _acc.unwrap_everywhere()
    if verbose:
        _say("fsdp_wrap.uninstall(): torch.distributed.fsdp's names are torch's again")


def _version() -> str:
    return __version__


def _say(line: str) -> None:
    rank = os.environ.get("RANK")
    line = f"[rank {rank}] {line}" if rank is not None else line
    if logging.getLogger().handlers or logger.handlers:
        logger.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def startup_hook_path() -> str | None:
    """Where this Python finds the start-up hook, or ``None`` if it is not installed."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for d in dirs:
        path = os.path.join(d, PTH_NAME)
        if os.path.isfile(path):
            return path
    return None


def _env_requests_install() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def install_from_env() -> None:
    """The start-up hook's entry point: install if :data:`ENV_VAR` asks for it.

    Errors are reported, never raised: a broken hook must not stop Python.
    """
    if not _env_requests_install():
        return
    try:
        install()
    except Exception as e:  # pragma: no cover - reported, not raised
        print(f"fsdp_wrap: {ENV_VAR} is set but install() failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
