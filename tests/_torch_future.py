"""torch's FSDP1 as an announced change would leave it, simulated in this process.

PyTorch PR #191712 ("Complete expired FSDP deprecations", open, in no release
up to 2.15) makes FSDP1's legacy optimizer-state functions raise
``NotImplementedError`` (``full_optim_state_dict``, ``sharded_optim_state_dict``,
``shard_full_optim_state_dict``, ``flatten_sharded_optim_state_dict``,
``scatter_full_optim_state_dict``), makes ``rekey_optim_state_dict`` refuse
``optim_input`` with ``ValueError`` and deletes two private helpers of
``torch.distributed.fsdp._optim_utils`` that served ``optim_input``.

:func:`legacy_optim_apis_removed` does that to the installed torch's FSDP1
class and module (and undoes it on exit); :func:`apply` does it for the rest
of the process (the framework scripts).  fsdp_wrap's own functions are
untouched: the tests show that code calling them, directly or through torch's
names under ``fsdp_wrap.install()``, works either way.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

#: The static methods PR #191712 turns into ``NotImplementedError``.
LEGACY_OPTIM_APIS = (
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
)
#: The private helpers it deletes from ``torch.distributed.fsdp._optim_utils``.
REMOVED_HELPERS = (
    "_get_param_id_to_param_from_optim_input",
    "_get_param_to_param_id_from_optim_input",
)


def torch_fsdp1_class() -> Any:
    """torch's own ``FullyShardedDataParallel`` (refused while ``install()`` is in
    effect: its names then point at fsdp_wrap's class)."""
    fsdp_wrap = sys.modules.get("fsdp_wrap")  # not imported here if not yet imported
    if fsdp_wrap is not None and fsdp_wrap.installed():
        raise RuntimeError("simulate torch's change before fsdp_wrap.install(), not after")
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _gone(name: str) -> Any:
    def raise_gone(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"FullyShardedDataParallel.{name} has been removed (simulated PyTorch PR #191712); "
            "use optim_state_dict / optim_state_dict_to_load"
        )

    return staticmethod(raise_gone)


def _rekey_without_optim_input(original: Any) -> Any:
    @functools.wraps(original)
    def rekey(optim_state_dict: Any, optim_state_key_type: Any, model: Any,
              optim_input: Any = None, optim: Any = None) -> Any:
        if optim_input is not None:
            raise ValueError("optim_input has been removed (simulated PyTorch PR #191712)")
        return original(optim_state_dict, optim_state_key_type, model, optim=optim)

    return staticmethod(rekey)


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, name, new value or None to delete) for every change."""
    import torch.distributed.fsdp._optim_utils as optim_utils

    cls = torch_fsdp1_class()
    out: list[tuple[Any, str, Any]] = [(cls, n, _gone(n)) for n in LEGACY_OPTIM_APIS]
    out.append((cls, "rekey_optim_state_dict",
                _rekey_without_optim_input(cls.rekey_optim_state_dict)))
    out += [(optim_utils, n, None) for n in REMOVED_HELPERS if hasattr(optim_utils, n)]
    return out


_MISSING = object()


def _set(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING or value is None:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def apply() -> None:
    """Make the change for the rest of this process."""
    for owner, name, new in _patches():
        _set(owner, name, new)


@contextlib.contextmanager
def legacy_optim_apis_removed() -> Iterator[None]:
    """Make the change inside the block; restore torch's FSDP1 as it was after."""
    patches = _patches()
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            _set(owner, name, new)
        yield
    finally:
        for owner, name, old in reversed(saved):
            _set(owner, name, old)
