"""Mixed-precision overrides of the auto-wrap pass.

Module classes that must run in full precision (``MixedPrecision._module_classes_to_ignore``,
e.g. batch norm) become FSDP units of their own with mixed precision off, and get
forward hooks that run them in float32 inside a low-precision model.  Used by
:mod:`fsdp_wrap.wrap.auto_wrap`; nothing here builds a unit.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from fsdp_wrap._compat import FSDP_INSTANCES_WORD
from fsdp_wrap.runtime.tensors import map_tensors


def _add_mixed_precision_overrides(
    root_module: nn.Module,
    module_classes: Iterable[type[nn.Module]],
    ignored_modules: set[nn.Module],
    root_kwargs: dict[str, Any],
    targets: dict[nn.Module, dict[str, Any]],
) -> dict[nn.Module, dict[str, Any]]:
    """Make every instance of ``module_classes`` a unit with mixed precision off.

    Modules already chosen by the policy keep their kwargs except for
    ``mixed_precision``; others are added with the root's kwargs.
    """
    classes = tuple(set(module_classes))
    for candidate in root_module.modules():
        if candidate in ignored_modules or not isinstance(candidate, classes):
            continue
        if candidate not in targets:
            targets[candidate] = copy.copy(root_kwargs)
        targets[candidate]["mixed_precision"] = None
    return targets


def _register_full_precision_hooks(module: nn.Module) -> None:
    """Run ``module`` in float32 while the rest of the model may run in low precision.

    A forward pre-hook casts floating-point positional inputs to float32 and
    remembers the dtype they arrived in; a forward hook casts floating-point
    outputs back to that dtype.  Both are appended after existing hooks.
    """
    arrived_dtype: list[torch.dtype | None] = [None]

    def to_dtype(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
        if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
            return tensor
        arrived_dtype[0] = tensor.dtype
        return tensor.to(dtype)

    def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> Any:
        arrived_dtype[0] = None
        return map_tensors(functools.partial(to_dtype, torch.float32), args)

    def post_hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        original = arrived_dtype[0]
        if original is None:
            return None
        return map_tensors(functools.partial(to_dtype, original), output)

    module.register_forward_pre_hook(pre_hook, prepend=False)
    module.register_forward_hook(post_hook, prepend=False)


def _override_mixed_precision(
    root_module: nn.Module, module_classes: Iterable[type[nn.Module]]
) -> set[type[nn.Module]]:
    """Tag every instance of ``module_classes`` to be wrapped without mixed precision.

    Sets ``_wrap_overrides = {"mixed_precision": None}`` (which :func:`_wrap`
    applies) and the float32 cast hooks on each instance in the whole tree,
    ignored modules included.  Returns the concrete classes found.
    """
    classes = tuple(set(module_classes))
    found: set[type[nn.Module]] = set()
    for candidate in root_module.modules():
        if not isinstance(candidate, classes):
            continue
        found.add(type(candidate))
        candidate._wrap_overrides = {"mixed_precision": None}  # type: ignore[assignment]
        _register_full_precision_hooks(candidate)
    return found


def _warn_mixed_precision_overrides(found: set[type[nn.Module]], *, stacklevel: int) -> None:
    """Warn that the classes ``found`` become units with mixed precision off.

    ``stacklevel`` as for :func:`warnings.warn`, counted from this function.
    """
    if not found:
        return
    # The installed torch's words: before 2.14 torch misspells "instances".
    warnings.warn(
        "Both mixed precision and an auto_wrap_policy were specified to FSDP, "
        f"where the wrapped module has submodules of type:\n{found}\n"
        f"These modules will be wrapped as separate FSDP {FSDP_INSTANCES_WORD} with mixed "
        "precision disabled.",
        stacklevel=stacklevel,
    )
