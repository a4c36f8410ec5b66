"""Auto-wrapping policies and manual wrapping helpers for fsdp_wrap.

A *wrapping policy* decides which submodules of the module handed to the FSDP
constructor become FSDP units of their own.  Each unit owns the parameters of
its subtree that no deeper unit already owns, so the choice of units decides
how parameters are grouped for all-gather, reduce-scatter and freeing.

Two kinds of policy exist, with the same names and calling protocols as
torch's FSDP1 wrapping module:

* **Function policies** (``always_wrap_policy``, ``size_based_auto_wrap_policy``,
  ``lambda_auto_wrap_policy``, ``transformer_auto_wrap_policy``, ``_or_policy``
  and anything with the same signature).  They are called with keyword
  arguments ``module``, ``recurse`` and ``nonwrapped_numel``.  With
  ``recurse=True`` the question is "should the traversal descend into this
  module's children?"; with ``recurse=False`` it is "should this module become
  a unit?", where ``nonwrapped_numel`` counts the parameters of the subtree that
  the children's units did not take.  :func:`_recursive_wrap` drives them.
* **Object policies** (subclasses of :class:`_Policy`: :class:`ModuleWrapPolicy`
  and :class:`CustomPolicy`).  They look at every module once and return a
  mapping from each module to wrap to the constructor keyword arguments it
  should get, so different units may get different settings.

:func:`_auto_wrap` is what the FSDP constructor calls; :func:`enable_wrap` and
:func:`wrap` support wrapping by hand while a model is being built.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import fsdp_wrap.runtime.construct as _init
from fsdp_wrap._mp_overrides import (
    _add_mixed_precision_overrides,
    _override_mixed_precision,
    _warn_mixed_precision_overrides,
)

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

#: Signature of a function policy: ``(module=..., recurse=..., nonwrapped_numel=...) -> bool``.
PolicyFn = Callable[..., bool]
#: Anything that builds a unit from a module and keyword arguments (an FSDP class).
WrapperFn = Callable[..., nn.Module]

# Classes that a MixedPrecision config excludes from low precision when the
# config object does not say otherwise (the dataclass default in torch and here).
_DEFAULT_MP_CLASSES_TO_IGNORE: tuple[type[nn.Module], ...] = (_BatchNorm,)


# ---------------------------------------------------------------------------
# Function policies
# ---------------------------------------------------------------------------


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Make every module reached by the traversal a unit of its own.

    Every submodule (not the root, which the outer FSDP call wraps) gets its
    own unit, so each leaf's parameters are gathered and freed separately.
    """
    return True


def _module_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    module_classes: set[type[nn.Module]],
) -> bool:
    """Wrap exactly the modules that are instances of ``module_classes``.

    The traversal always descends, and a module becomes a unit when it is an
    instance of one of the classes.  Because wrapping is bottom-up, a unit owns
    the parameters of its subtree minus those of nested units.
    ``nonwrapped_numel`` is accepted for protocol compatibility and unused.
    """
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def lambda_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    lambda_fn: Callable[[nn.Module], Any],
) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is truthy.

    Bind ``lambda_fn`` with :func:`functools.partial`.  The traversal always
    descends, so the predicate is asked about every non-ignored submodule.
    """
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """Wrap every instance of the given layer classes (e.g. transformer blocks).

    Same rule as :func:`_module_wrap_policy` with ``transformer_layer_cls`` as
    the class set.  Parameters shared between layers (tied embeddings) must end
    up in one unit, which is why the layers, not their parents, are wrapped.
    """
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def _wrap_module_cls_individually(
    module: nn.Module,
    module_classes: Sequence[type[nn.Module]],
    recurse: bool,
    *args: Any,
    **kwargs: Any,
) -> bool:
    """Give each instance of ``module_classes`` its own unit.

    Used with :func:`_or_policy` so that classes excluded from mixed precision
    (BatchNorm by default) are split off regardless of the user's policy.
    """
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def _or_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    policies: Iterable[PolicyFn],
) -> bool:
    """True when at least one of ``policies`` says True.

    The policies are asked in order and asking stops at the first True, so
    later policies may not be called at all for a given question.
    """
    return any(
        policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
        for policy in policies
    )


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` unwrapped numel.

    Args:
        module: The module being asked about.
        recurse: ``True`` while descending, ``False`` for the wrap decision.
        nonwrapped_numel: With ``recurse=True``, the subtree's total numel;
            with ``recurse=False``, what the children's units left over.
        min_num_params: Threshold in numel (the name is kept from older
            releases; it counts elements, not tensors).
        force_leaf_modules: Classes whose children are never visited.  ``None``
            means ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES``
            (``{nn.MultiheadAttention}``).
        exclude_wrap_modules: Classes never made a unit themselves.  ``None``
            means ``size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES``
            (``{nn.ModuleList, nn.ModuleDict}``, which have no forward).

    A subtree smaller than the threshold is neither descended into nor wrapped;
    its parameters stay with the nearest enclosing unit.
    """
    leaf_classes: set[type[nn.Module]] = (
        size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
        if force_leaf_modules is None
        else force_leaf_modules
    )
    excluded_classes: set[type[nn.Module]] = (
        size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
        if exclude_wrap_modules is None
        else exclude_wrap_modules
    )
    big_enough = nonwrapped_numel >= min_num_params
    if recurse:
        return big_enough and not isinstance(module, tuple(leaf_classes))
    return big_enough and not isinstance(module, tuple(excluded_classes))


# Defaults live on the function so users can read or extend them.
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# Object policies
# ---------------------------------------------------------------------------


class _Policy(ABC):
    """Base class of policies that pick their target modules in one pass."""

    @abstractmethod
    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        """Map each module to wrap onto the constructor kwargs it should get.

        ``root_module`` may appear in the result; the caller never wraps it
        (the outer FSDP call does).  Modules in ``ignored_modules`` must not
        appear.  Each value must be a dict of its own (not ``root_kwargs``).
        """


class ModuleWrapPolicy(_Policy):
    """Wrap every instance of the given classes, each with the root's kwargs.

    The instance is also usable as a function policy (``__call__``), which is
    the same rule as :func:`_module_wrap_policy`.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = set(module_classes)
        self._module_classes: set[type[nn.Module]] = classes
        self._module_classes_str: str = str(classes)

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        wanted = tuple(self._module_classes)
        targets: dict[nn.Module, dict[str, Any]] = {}
        for candidate in root_module.modules():
            if candidate in ignored_modules:
                continue
            if isinstance(candidate, wanted):
                # One dict per unit so that later edits to one unit's kwargs
                # (e.g. disabling mixed precision) do not leak into others.
                targets[candidate] = copy.copy(root_kwargs)
        return targets

    def __call__(
        self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any
    ) -> bool:
        return _module_wrap_policy(
            module, recurse, nonwrapped_numel=-1, module_classes=self._module_classes
        )

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes_str})"


class CustomPolicy(_Policy):
    """Decide per module with a function returning a bool or a kwargs dict.

    ``lambda_fn(module)`` is called for every non-ignored module (root
    included) and must return:

    * ``False`` or ``{}``: the module is not a unit of its own;
    * ``True``: the module becomes a unit with the root's kwargs;
    * a non-empty dict: the module becomes a unit with the root's kwargs
      updated by that dict (e.g. ``{"sharding_strategy": SHARD_GRAD_OP}`` for
      an output head that should stay gathered between forward and backward).

    Any other return value raises ``ValueError``.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        targets: dict[nn.Module, dict[str, Any]] = {}
        for candidate in root_module.modules():
            if candidate in ignored_modules:
                continue
            decision = self._lambda_fn(candidate)
            if not isinstance(decision, (dict, bool)):
                # ValueError (not TypeError) because callers catch what torch raises.
                raise ValueError(  # noqa: TRY004
                    "The lambda_fn passed to CustomPolicy should return "
                    f"False/True or a kwarg dict, but it returned {decision}"
                )
            if not decision:
                continue
            unit_kwargs = copy.copy(root_kwargs)
            if isinstance(decision, dict):
                unit_kwargs.update(decision)
            targets[candidate] = unit_kwargs
        return targets


# ---------------------------------------------------------------------------
# Manual wrapping: enable_wrap / wrap
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _WrapContext:
    """What an active :func:`enable_wrap` block hands to :func:`wrap`."""

    wrapper_cls: WrapperFn
    kwargs: dict[str, Any]


# The active enable_wrap block, if any.  A ContextVar (rather than process-wide
# state) keeps concurrent threads and asyncio tasks from seeing each other's
# blocks.
_WRAP_CONTEXT: contextvars.ContextVar[_WrapContext | None] = contextvars.ContextVar(
    "fsdp_wrap_enable_wrap_context", default=None
)


@contextlib.contextmanager
def enable_wrap(
    *, wrapper_cls: Any, **wrapper_kwargs: Any
) -> Generator[None, None, None]:
    """Make :func:`wrap` active inside the ``with`` block.

    Inside the block ``wrap(module, **overrides)`` returns
    ``wrapper_cls(module, **{**wrapper_kwargs, **overrides})``; outside it,
    ``wrap`` returns the module untouched, so the same model code runs with or
    without sharding.  Wrapping large layers as they are created lets them be
    sharded before the whole model exists in memory.

    Nesting blocks is not supported and raises ``NotImplementedError``.
    """
    if _WRAP_CONTEXT.get() is not None:
        raise NotImplementedError(
            "You are already within an autowrap context and we currently do not "
            "supported nested autowrap."
        )
    token = _WRAP_CONTEXT.set(
        _WrapContext(wrapper_cls=wrapper_cls, kwargs=dict(wrapper_kwargs))
    )
    try:
        yield
    finally:
        _WRAP_CONTEXT.reset(token)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` if called inside :func:`enable_wrap`, else return it.

    Keyword arguments given here win over those given to ``enable_wrap``.  A
    module carrying a ``_wrap_overrides`` dict (set by auto-wrapping with mixed
    precision) has those entries win over both.
    """
    active = _WRAP_CONTEXT.get()
    if active is None:
        return module
    merged = {**active.kwargs, **wrap_overrides}
    return _wrap(module, active.wrapper_cls, **merged)


def _wrap(module: nn.Module, wrapper_cls: WrapperFn, **kwargs: Any) -> nn.Module:
    """Call ``wrapper_cls(module, **kwargs)``, applying ``module._wrap_overrides``."""
    if wrapper_cls is None:
        raise ValueError("A wrapper class is required to wrap a module, but got None.")
    forced = getattr(module, "_wrap_overrides", None)
    if forced is not None:
        return wrapper_cls(module, **{**kwargs, **forced})
    return wrapper_cls(module, **kwargs)


# ---------------------------------------------------------------------------
# Function-policy traversal
# ---------------------------------------------------------------------------


def _recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: PolicyFn,
    wrapper_cls: WrapperFn,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    only_wrap_children: bool = False,
    **kwargs: Any,
) -> tuple[nn.Module, int]:
    """Wrap the submodules of ``module`` that a function policy selects.

    Depth-first: the policy is first asked (``recurse=True``, with the
    subtree's numel, ignored parameters excluded) whether to descend.  If so,
    each non-ignored child is handled recursively and replaced in place by
    what the recursion returns.  Then, unless ``only_wrap_children``, the
    policy is asked (``recurse=False``) whether to wrap ``module`` itself, given
    the numel its children's units left over.  ``kwargs`` go to every
    ``wrapper_cls`` call.

    Returns:
        ``(module or its wrapper, numel now covered by units in this subtree)``.
    """
    if auto_wrap_policy is None:
        raise ValueError("_recursive_wrap needs an auto_wrap_policy, but got None.")
    if wrapper_cls is None:
        raise ValueError("_recursive_wrap needs a wrapper_cls, but got None.")
    if inspect.isclass(wrapper_cls):  # (a function as wrapper_cls cannot be checked)
        _init.check_not_wrapped(
            module, wrapper_cls, ignored_modules, "Child module {names} is already wrapped by {cls}"
        )

    # Counted as if nothing in the subtree were wrapped yet.
    subtree_numel = sum(
        p.numel() for p in module.parameters() if p not in ignored_params
    )
    if not auto_wrap_policy(
        module=module, recurse=True, nonwrapped_numel=subtree_numel
    ):
        return module, 0

    covered = 0
    for child_name, child in module.named_children():
        if child in ignored_modules:
            continue
        new_child, child_covered = _recursive_wrap(
            module=child,
            auto_wrap_policy=auto_wrap_policy,
            wrapper_cls=wrapper_cls,
            ignored_modules=ignored_modules,
            ignored_params=ignored_params,
            **kwargs,
        )
        setattr(module, child_name, new_child)
        covered += child_covered
    leftover = subtree_numel - covered
    if not only_wrap_children and auto_wrap_policy(
        module=module, recurse=False, nonwrapped_numel=leftover
    ):
        return _wrap(module, wrapper_cls, **kwargs), subtree_numel
    return module, covered


# Parameter names of _recursive_wrap, which wrapper kwargs must not reuse.
_RECURSIVE_WRAP_OWN_ARGS = frozenset(inspect.signature(_recursive_wrap).parameters) - {
    "kwargs"
}


# ---------------------------------------------------------------------------
# Object-policy helpers
# ---------------------------------------------------------------------------


def _post_order_apply(
    root_module: nn.Module, fn: Callable[[nn.Module], nn.Module | None]
) -> None:
    """Call ``fn`` on every module of the tree, children before parents.

    When ``fn`` returns a module, it replaces the visited module in its parent
    (``setattr`` under the child's name).  A module reachable through several
    parents is visited once, through the first parent in registration order,
    and only that reference is replaced.
    """
    seen: set[nn.Module] = {root_module}

    def visit(module: nn.Module, name: str, parent: nn.Module | None) -> None:
        for child_name, child in module.named_children():
            if child in seen:
                continue
            seen.add(child)
            visit(child, child_name, module)
        replacement = fn(module)
        if replacement is None:
            return
        if parent is None or not name:
            raise RuntimeError(
                f"Cannot replace the root module {type(module).__name__} in place."
            )
        if not isinstance(replacement, nn.Module):
            raise TypeError(
                f"Expected the wrap step to return an nn.Module or None, got {replacement!r}"
            )
        setattr(parent, name, replacement)

    visit(root_module, "", None)


def _named_modules_post_order(root_module: nn.Module) -> list[tuple[str, nn.Module]]:
    """All modules with FQNs, every module after its descendants.

    Siblings come in registration order (the reverse of an explicit-stack DFS),
    so errors point at the first registered offender.
    """
    seen: set[nn.Module] = {root_module}
    stack: list[tuple[str, nn.Module]] = [("", root_module)]
    pre_order_reversed: list[tuple[str, nn.Module]] = []
    while stack:
        name, module = stack.pop()
        pre_order_reversed.append((name, module))
        for child_name, child in module.named_children():
            if child is None or child in seen:
                continue
            seen.add(child)
            stack.append((f"{name}.{child_name}" if name else child_name, child))
    pre_order_reversed.reverse()
    return pre_order_reversed


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
) -> None:
    """Reject (or warn about) a unit mixing trainable and frozen parameters.

    One flat parameter has one ``requires_grad``, so with
    ``use_orig_params=False`` such a unit cannot be built (``ValueError``).
    With ``use_orig_params=True`` it works but keeps a gradient for the frozen
    part as well, so only a ``UserWarning`` is issued.
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
        warnings.warn(message, stacklevel=3)


def _is_object_policy(policy: object) -> bool:
    """True for :class:`_Policy` instances and look-alikes with a ``_run_policy`` method.

    The duck-typed case lets a policy object from another implementation of
    the same API (for instance torch's own policy classes) take the one-pass
    path instead of being treated as a plain function.
    """
    return isinstance(policy, _Policy) or callable(getattr(policy, "_run_policy", None))


# ---------------------------------------------------------------------------
# Entry point used by the FSDP constructor
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
                                "to not already have FSDP applied but found {names} ({cls})")

    unit_kwargs = dict(root_kwargs)
    unit_kwargs["auto_wrap_policy"] = None
    mixed_precision = unit_kwargs.get("mixed_precision")
    mp_classes: Sequence[type[nn.Module]] = ()
    if mixed_precision is not None:
        mp_classes = tuple(
            getattr(
                mixed_precision,
                "_module_classes_to_ignore",
                _DEFAULT_MP_CLASSES_TO_IGNORE,
            )
        )

    if _is_object_policy(policy):
        targets: dict[nn.Module, dict[str, Any]] = policy._run_policy(  # type: ignore[union-attr]
            root_module, ignored_modules, unit_kwargs
        )
        if mixed_precision is not None:
            targets = _add_mixed_precision_overrides(
                root_module, mp_classes, ignored_modules, unit_kwargs, targets
            )
            _warn_mixed_precision_overrides(
                _override_mixed_precision(root_module, mp_classes)
            )
        _check_frozen_params(
            root_module,
            set(targets),
            ignored_params,
            bool(unit_kwargs.get("use_orig_params", False)),
        )

        def wrap_target(module: nn.Module) -> nn.Module | None:
            if module is root_module or module not in targets:
                return None
            return fsdp_cls(module, **targets[module])

        _post_order_apply(root_module, wrap_target)
        return

    if not callable(policy):
        raise TypeError(
            "auto_wrap_policy must be a callable (module, recurse, nonwrapped_numel) -> bool "
            f"or a policy object, but got {type(policy).__name__}"
        )
    function_policy: PolicyFn = policy
    if mixed_precision is not None:
        found = _override_mixed_precision(root_module, mp_classes)
        function_policy = functools.partial(
            _or_policy,
            policies=[
                policy,
                functools.partial(
                    _wrap_module_cls_individually, module_classes=mp_classes
                ),
            ],
        )
        _warn_mixed_precision_overrides(found)
    # Keys that collide with _recursive_wrap's own parameters (at least
    # ``auto_wrap_policy``, and ``ignored_modules`` when the caller includes it)
    # cannot travel through its **kwargs; bind them onto the wrapper instead so
    # every unit still receives exactly ``unit_kwargs``.
    bound = {k: v for k, v in unit_kwargs.items() if k in _RECURSIVE_WRAP_OWN_ARGS}
    passed = {k: v for k, v in unit_kwargs.items() if k not in _RECURSIVE_WRAP_OWN_ARGS}
    wrapper: WrapperFn = functools.partial(fsdp_cls, **bound) if bound else fsdp_cls
    _recursive_wrap(
        root_module,
        function_policy,
        wrapper,
        ignored_modules,
        ignored_params,
        True,
        **passed,
    )
