"""The auto-wrap pass the FSDP constructor runs: :func:`_auto_wrap`.

It builds the units a policy selects, bottom-up, in named steps: the unit
kwargs and the classes mixed precision must skip, then either the one-pass
object-policy path (:func:`_wrap_with_object_policy`) or the traversal of a
function policy (:func:`_wrap_with_function_policy`).
"""

from __future__ import annotations

import collections
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import fsdp_wrap.runtime.construct as _init
from fsdp_wrap.runtime.agreement import auto_wrapping
from fsdp_wrap.wrap.mp_overrides import (
    _add_mixed_precision_overrides,
    _override_mixed_precision,
    _warn_mixed_precision_overrides,
)
from fsdp_wrap.wrap.policies import (
    PolicyFn,
    WrapperFn,
    _is_object_policy,
    _or_policy,
    _Policy,
    _wrap_module_cls_individually,
)
from fsdp_wrap.wrap.traversal import (
    _RECURSIVE_WRAP_OWN_ARGS,
    _named_modules_post_order,
    _post_order_apply,
    _recursive_wrap,
)

# Classes that a MixedPrecision config excludes from low precision when the
# config object does not say otherwise (the dataclass default in torch and here).
_DEFAULT_MP_CLASSES_TO_IGNORE: tuple[type[nn.Module], ...] = (_BatchNorm,)

# Warnings of the pass point at the line that called _auto_wrap: counted from
# the helper that warns, through the step function and _auto_wrap itself.
_AT_AUTO_WRAP_CALLER = 4


# ---------------------------------------------------------------------------
# Frozen-parameter check (object policies)
# ---------------------------------------------------------------------------


def _params_owned_by_unit(
    unit_root: nn.Module,
    prefix: str,
    ignored_params: set[nn.Parameter],
    claimed: set[nn.Module],
) -> dict[nn.Parameter, str]:
    """Parameters (with FQNs from the model root) the unit at ``unit_root`` would own.

    Breadth-first over the subtree, not entering modules in ``claimed`` (those
    belong to units handled earlier in post-order).  Marks every module it
    enters as claimed.
    """
    owned: dict[nn.Parameter, str] = {}
    claimed.add(unit_root)
    queue: collections.deque[tuple[nn.Module, str]] = collections.deque(
        [(unit_root, prefix)]
    )
    while queue:
        module, module_prefix = queue.popleft()
        for param_name, param in module.named_parameters(recurse=False):
            if param in ignored_params:
                continue
            owned[param] = (
                f"{module_prefix}.{param_name}" if module_prefix else param_name
            )
        for child_name, child in module.named_children():
            if child is None or child in claimed:
                continue
            claimed.add(child)
            queue.append(
                (
                    child,
                    f"{module_prefix}.{child_name}" if module_prefix else child_name,
                )
            )
    return owned


def _check_frozen_params(
    root_module: nn.Module,
    units: set[nn.Module],
    ignored_params: set[nn.Parameter],
    use_orig_params: bool,
    *,
    stacklevel: int,
) -> None:
    """torch's check: reject (or warn about) a unit mixing trainable and frozen
    parameters.  Kept for code that calls it; :func:`_auto_wrap` no longer
    does, since a unit splits them into separate flat parameters.

    One flat parameter has one ``requires_grad``, so with
    ``use_orig_params=False`` such a unit cannot be built (``ValueError``).
    With ``use_orig_params=True`` it works but keeps a gradient for the frozen
    part as well, so only a ``UserWarning`` is issued (``stacklevel`` as for
    :func:`warnings.warn`, counted from this function).
    """
    claimed: set[nn.Module] = set()
    for name, module in _named_modules_post_order(root_module):
        if module not in units:
            continue
        owned = _params_owned_by_unit(module, name, ignored_params, claimed)
        trainable = [fqn for p, fqn in owned.items() if p.requires_grad]
        frozen = [fqn for p, fqn in owned.items() if not p.requires_grad]
        if not trainable or not frozen:
            continue
        trainable_numel = sum(p.numel() for p in owned if p.requires_grad)
        frozen_numel = sum(p.numel() for p in owned if not p.requires_grad)
        message = f"{name} has both parameters with requires_grad=True and False."
        if use_orig_params:
            message += (
                " We do not recommend wrapping such modules since the gradient memory "
                f"usage will be higher than expected ({trainable_numel + frozen_numel} numel "
                f"instead of {trainable_numel} numel before sharding via reduce-scatter). "
            )
        else:
            message += " FSDP does not support wrapping such modules when use_orig_params=False. "
        message += "If possible, wrap the frozen parameters with FSDP separately.\n"
        message += (
            f"The following parameters have requires_grad=True:\n{trainable}\n"
            f"The following parameters have requires_grad=False:\n{frozen}"
        )
        if not use_orig_params:
            raise ValueError(message)
        warnings.warn(message, stacklevel=stacklevel)


# ---------------------------------------------------------------------------
# Entry point used by the FSDP constructor, and its steps
# ---------------------------------------------------------------------------


def _auto_wrap(
    root_module: nn.Module,
    policy: Callable[..., bool] | _Policy,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
    fsdp_cls: type[nn.Module],
) -> None:
    """Wrap the descendants of ``root_module`` in place according to ``policy``.

    Units are built bottom-up with ``fsdp_cls(child, **kwargs)``; the root is
    never wrapped here.  Every unit's kwargs start from ``root_kwargs`` with
    ``auto_wrap_policy`` set to ``None`` (a child must not auto-wrap again);
    ``root_kwargs`` itself is not modified.

    When ``root_kwargs["mixed_precision"]`` is set, each instance of its
    ``_module_classes_to_ignore`` (BatchNorm by default) becomes a unit of its
    own with ``mixed_precision=None`` and float32 cast hooks, and a warning
    names the classes found.  The config is read by attribute name, so a
    MixedPrecision object from torch is accepted too.

    Raises:
        ValueError: if any module in the tree already is an ``fsdp_cls``
            instance; or, for object policies with ``use_orig_params=False``,
            if a unit would mix frozen and trainable parameters (a warning is
            issued instead when ``use_orig_params=True``).
    """
    if inspect.isclass(fsdp_cls):
        _init.check_not_wrapped(root_module, fsdp_cls, (), "FSDP auto wrapping requires modules "
                                "to not already have FSDP applied but found {first} in {root}")
    unit_kwargs = dict(root_kwargs)
    unit_kwargs["auto_wrap_policy"] = None
    mp_classes = _mp_classes_to_ignore(unit_kwargs.get("mixed_precision"))
    step = _wrap_with_object_policy if _is_object_policy(policy) else _wrap_with_function_policy
    with auto_wrapping():  # (the children compare no settings: they are the root's)
        step(root_module, policy, ignored_modules, ignored_params, unit_kwargs, mp_classes,
             fsdp_cls)
    _warn_if_no_class_matched(root_module, policy, fsdp_cls)


def _policy_classes(policy: Any) -> set[type] | None:
    """The module classes of a class-based policy (``ModuleWrapPolicy``, a
    ``functools.partial`` of ``transformer_auto_wrap_policy``), else ``None``."""
    classes = getattr(policy, "_module_classes", None)
    if classes is None and isinstance(policy, functools.partial):
        name = getattr(policy.func, "__name__", "")
        if name in ("transformer_auto_wrap_policy", "_module_wrap_policy"):
            classes = policy.keywords.get("transformer_layer_cls",
                                          policy.keywords.get("module_classes"))
    return set(classes) if classes is not None else None


def _warn_if_no_class_matched(root_module: nn.Module, policy: Any, fsdp_cls: type[nn.Module]) -> None:
    """A class-based policy that made no unit names classes the model does not
    use (a typo, another model's block class): the model would be one unit,
    gathered whole in every forward, with no word.  Warn, naming both."""
    classes = _policy_classes(policy)
    if not classes:
        return
    if any(isinstance(m, fsdp_cls) for m in root_module.modules() if m is not root_module):
        return
    if any(isinstance(m, tuple(classes)) for m in root_module.modules()):
        return  # (the classes are there: one unit is what the policy chose, e.g. the root's class)
    wanted = sorted(c.__name__ for c in classes)
    present = sorted({type(m).__name__ for m in root_module.modules()})
    shown = ", ".join(present[:12]) + (", ..." if len(present) > 12 else "")
    warnings.warn(
        f"auto_wrap_policy wraps module classes {wanted} but the {type(root_module).__name__} "
        f"being wrapped contains none of them{_init._rank_tag()}, so it becomes one "
        "FSDP unit: all its parameters are gathered at once in every forward and backward. Its "
        f"module classes: {shown}. Name the class of its repeated blocks (e.g. the decoder "
        "layer class).",
        stacklevel=4,  # (this function, _auto_wrap, the constructor, its caller)
    )


def _mp_classes_to_ignore(mixed_precision: Any) -> tuple[type[nn.Module], ...] | None:
    """The classes a mixed-precision config keeps in full precision.

    ``None`` when there is no config (mixed precision off), so that a config
    listing no classes still takes the mixed-precision path.
    """
    if mixed_precision is None:
        return None
    return tuple(
        getattr(mixed_precision, "_module_classes_to_ignore", _DEFAULT_MP_CLASSES_TO_IGNORE)
    )


def _wrap_with_object_policy(
    root_module: nn.Module,
    policy: Any,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    unit_kwargs: dict[str, Any],
    mp_classes: tuple[type[nn.Module], ...] | None,
    fsdp_cls: type[nn.Module],
) -> None:
    """One pass: ask the policy for all targets, check them, wrap them children-first.

    ``policy`` is a :class:`_Policy` or any object with a ``_run_policy`` method.
    """
    targets: dict[nn.Module, dict[str, Any]] = policy._run_policy(
        root_module, ignored_modules, unit_kwargs
    )
    if mp_classes is not None:
        targets = _add_mixed_precision_overrides(
            root_module, mp_classes, ignored_modules, unit_kwargs, targets
        )
        _warn_mixed_precision_overrides(
            _override_mixed_precision(root_module, mp_classes), stacklevel=_AT_AUTO_WRAP_CALLER
        )
    # torch refuses (use_orig_params=False) or warns about (True) a unit mixing
    # frozen and trainable parameters here (``_check_frozen_params``); fsdp_wrap
    # gives such a unit one flat parameter per kind instead (docs/fine_tuning.rst),
    # so there is nothing to refuse and no wasted gradient memory to warn about.

    def wrap_target(module: nn.Module) -> nn.Module | None:
        if module is root_module or module not in targets:
            return None
        return fsdp_cls(module, **targets[module])

    _post_order_apply(root_module, wrap_target)


def _wrap_with_function_policy(
    root_module: nn.Module,
    policy: Any,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    unit_kwargs: dict[str, Any],
    mp_classes: tuple[type[nn.Module], ...] | None,
    fsdp_cls: type[nn.Module],
) -> None:
    """Traverse with a function policy (OR-ed with the mixed-precision split-off).

    ``policy`` must be callable like a function policy; anything else raises
    ``TypeError``.
    """
    if not callable(policy):
        raise TypeError(
            "auto_wrap_policy must be a callable (module, recurse, nonwrapped_numel) -> bool "
            f"or a policy object, but got {type(policy).__name__}"
        )
    function_policy: PolicyFn = policy
    if mp_classes is not None:
        found = _override_mixed_precision(root_module, mp_classes)
        function_policy = functools.partial(
            _or_policy,
            policies=[
                policy,
                functools.partial(_wrap_module_cls_individually, module_classes=mp_classes),
            ],
        )
        _warn_mixed_precision_overrides(found, stacklevel=_AT_AUTO_WRAP_CALLER)
    wrapper, passed = _bind_colliding_kwargs(fsdp_cls, unit_kwargs)
    _recursive_wrap(
        root_module,
        function_policy,
        wrapper,
        ignored_modules,
        ignored_params,
        True,
        **passed,
    )


def _bind_colliding_kwargs(
    fsdp_cls: type[nn.Module], unit_kwargs: dict[str, Any]
) -> tuple[WrapperFn, dict[str, Any]]:
    """Split ``unit_kwargs`` into a wrapper and the kwargs for :func:`_recursive_wrap`.

    Keys that collide with ``_recursive_wrap``'s own parameters (at least
    ``auto_wrap_policy``, and ``ignored_modules`` when the caller includes it)
    cannot travel through its ``**kwargs``; they are bound onto the wrapper
    instead, so every unit still receives exactly ``unit_kwargs``.
    """
    bound = {k: v for k, v in unit_kwargs.items() if k in _RECURSIVE_WRAP_OWN_ARGS}
    passed = {k: v for k, v in unit_kwargs.items() if k not in _RECURSIVE_WRAP_OWN_ARGS}
    wrapper: WrapperFn = functools.partial(fsdp_cls, **bound) if bound else fsdp_cls
    return wrapper, passed
