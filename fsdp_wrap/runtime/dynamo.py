"""What ``torch.compile`` (TorchDynamo) needs to know of fsdp_wrap's units.

Dynamo treats torch's FSDP1 specially: it runs FSDP's own code eagerly (its
files are torch's, which it skips) and traces the wrapped modules' forward in
between, reading two marks FSDP puts on the modules it manages.  fsdp_wrap
gives its package the same skip (:func:`run_eagerly_under_dynamo`) and its
modules the same marks (:func:`annotate_for_dynamo`); the façade calls both
at construction.  docs/frameworks/torch_compile.rst says what compiles.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

import torch.nn as nn

__all__ = ["annotate_for_dynamo", "run_eagerly_under_dynamo"]

_DYNAMO_RULES = "torch._dynamo.trace_rules"
_dynamo_skip_requested = False


def run_eagerly_under_dynamo() -> None:
    """Make ``torch.compile`` run fsdp_wrap's own frames eagerly.

    TorchDynamo skips torch's FSDP1 code (its files are torch's) and so
    graph-breaks at every unit boundary, compiling the wrapped modules'
    forward in between while the all-gathers, lazy init and hooks stay eager.
    fsdp_wrap's package gets the same treatment through Dynamo's skip list
    (``trace_rules.add``).  Importing Dynamo costs about a second, so if it is
    not loaded yet the registration waits for its import (a one-shot
    post-import hook) instead of forcing it.  Called at every FSDP
    construction; cheap after the first.
    """
    global _dynamo_skip_requested
    if _dynamo_skip_requested:
        return
    _dynamo_skip_requested = True
    rules = sys.modules.get(_DYNAMO_RULES)
    if rules is not None:
        _skip_package(rules)
    else:
        sys.meta_path.insert(0, _AfterImport(_DYNAMO_RULES, _skip_package))


def _skip_package(rules: Any) -> None:
    add = getattr(rules, "add", None)  # torch >= 2.2
    if add is not None:
        add(__name__.split(".")[0])  # (the whole fsdp_wrap package)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run ``callback(module)`` right after ``name`` is first imported."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the lookup below must not find us
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        callback = self.callback

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            callback(module)

        loader.exec_module = exec_then_call
        return spec


def annotate_for_dynamo(module: nn.Module, ignored: set[nn.Module], use_orig_params: bool) -> None:
    """Mark the modules this unit manages the way TorchDynamo expects of FSDP.

    Dynamo reads ``_is_fsdp_managed_module`` to trace such modules as
    unspecialized (parameters passed in afresh each call, since FSDP swaps
    them between views every step) and ``_fsdp_use_orig_params`` to refuse
    ``use_orig_params=False``, where the modules' parameters are not the ones
    the optimizer steps.
    """
    for m in module.modules():
        if m not in ignored:
            m._is_fsdp_managed_module = True  # type: ignore[assignment]
            m._fsdp_use_orig_params = use_orig_params  # type: ignore[assignment]
