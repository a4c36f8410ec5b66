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

What it does, in one step that either completes or leaves nothing changed,
one module of this package per framework:

* torch (:mod:`fsdp_wrap.frameworks.torch_fsdp`): sets FSDP1's names on
  ``torch.distributed.fsdp`` and its public submodules to fsdp_wrap's
  (creating the submodules a torch without FSDP1 lacks), and teaches DCP's
  ``state_dict`` helpers to recognise fsdp_wrap's units;
* every already-imported module attribute that *is* one of the objects
  replaced (``from torch.distributed.fsdp import FullyShardedDataParallel as
  FSDP`` done before ``install()``) is rebound to fsdp_wrap's, torch's own
  FSDP1 internals (``torch.distributed.fsdp._*``) excepted, so torch's FSDP1
  keeps working for anyone holding it directly;
* torch's private FSDP1 names that RL trainers use
  (:mod:`fsdp_wrap.frameworks.torch_private`): ``_lazy_init``, a unit's
  ``_device_handle``, a handle's ``_offload_params`` and ``flat_param_to``,
  a flat parameter's ``_local_shard``, with torch's behaviour;
* Accelerate (:mod:`fsdp_wrap.frameworks.accelerate`): its sharded optimizer
  load is made exact for fsdp_wrap's units;
* PEFT (:mod:`fsdp_wrap.frameworks.peft`): its adapter state-dict functions
  find, save and load every rank's adapters in a model holding fsdp_wrap's
  units;

each now if the framework is imported, else when it is.

:func:`uninstall` undoes exactly what :func:`install` did.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import fsdp_wrap.frameworks.accelerate as _accelerate
import fsdp_wrap.frameworks.peft as _peft
import fsdp_wrap.frameworks.torch_fsdp as _torch_fsdp
import fsdp_wrap.frameworks.torch_private as _torch_private
from fsdp_wrap import __version__
from fsdp_wrap.frameworks._patches import FunctionWraps, importers, unwrap_everywhere

__all__ = ["ENV_VAR", "PTH_NAME", "install", "install_from_env", "installed",
           "startup_hook_path", "uninstall"]

#: ``FSDP_WRAP_INSTALL=1`` (or ``true``/``yes``/``on``) installs at start-up.
ENV_VAR = "FSDP_WRAP_INSTALL"
#: The start-up hook pip puts in site-packages (written by setup.py).
PTH_NAME = "fsdp_wrap-install.pth"

logger = logging.getLogger("fsdp_wrap.installer")

#: The framework functions install() wraps, one entry per framework module.
_FUNCTION_WRAPS: tuple[FunctionWraps, ...] = (_accelerate.WRAPS, _peft.WRAPS)

_lock = threading.Lock()
_applied: list[Any] = []  # (Patch or MetaPathEntry, in the order applied)


def installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    return bool(_applied)


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
        modules = _torch_fsdp.module_patches(patches, originals)
        _torch_fsdp.dcp_patches(patches, originals)
        _torch_private.patches(patches, originals)
        for wraps in _FUNCTION_WRAPS:
            wraps.plan(patches, originals, applied_later=_applied.append)
        skip = set(modules) | {w.module_name for w in _FUNCTION_WRAPS}
        rebinds = list(importers(originals, skip, ("fsdp_wrap", f"{_torch_fsdp.PKG}._")))
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
        unwrap_everywhere()
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
