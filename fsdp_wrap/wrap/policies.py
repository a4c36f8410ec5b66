"""The wrapping policies: function policies and object policies.

Two kinds of policy exist, with the same names and calling protocols as
torch's FSDP1 wrapping module:

* **Function policies** (``always_wrap_policy``, ``size_based_auto_wrap_policy``,
  ``lambda_auto_wrap_policy``, ``transformer_auto_wrap_policy``, ``_or_policy``
  and anything with the same signature).  They are called with keyword
  arguments ``module``, ``recurse`` and ``nonwrapped_numel``.  With
  ``recurse=True`` the question is "should the traversal descend into this
  module's children?"; with ``recurse=False`` it is "should this module become
  a unit?", where ``nonwrapped_numel`` counts the parameters of the subtree that
  the children's units did not take.
  :func:`fsdp_wrap.wrap.traversal._recursive_wrap` drives them.
* **Object policies** (subclasses of :class:`_Policy`: :class:`ModuleWrapPolicy`
  and :class:`CustomPolicy`).  They look at every module once and return a
  mapping from each module to wrap to the constructor keyword arguments it
  should get, so different units may get different settings.

Nothing here wraps a module; the passes that do live in
:mod:`fsdp_wrap.wrap.traversal` and :mod:`fsdp_wrap.wrap.auto_wrap`.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

#: Signature of a function policy: ``(module=..., recurse=..., nonwrapped_numel=...) -> bool``.
PolicyFn = Callable[..., bool]
#: Anything that builds a unit from a module and keyword arguments (an FSDP class).
WrapperFn = Callable[..., nn.Module]


# ---------------------------------------------------------------------------
# Function policies
# ---------------------------------------------------------------------------


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Make every module reached by the traversal a unit of its own.

    Every submodule (not the root, which the outer FSDP call wraps) gets its
    own unit, so each leaf's parameters are gathered and freed separately:
    the lowest memory, and one all-gather and one reduction per module, whose
    fixed latency dominates for small modules.  Pass the function itself:
    ``auto_wrap_policy=always_wrap_policy``.
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
    Example::

        policy = functools.partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: isinstance(m, nn.Linear) and m.in_features >= 1024,
        )
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

    The traversal always descends; a module becomes a unit when it is an
    instance of one of ``transformer_layer_cls``.  Parameters shared between
    layers (tied embeddings) must end up in one unit, which is why the layers,
    not their parents, are wrapped.  The function form of
    :class:`ModuleWrapPolicy`; bind the classes with
    :func:`functools.partial`::

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
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
    its parameters stay with the nearest enclosing unit.  Example, units of
    at least 20M parameters::

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=20_000_000)
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

    The usual policy for transformers: one unit per block, so one block is
    gathered at a time (two with prefetching), and what is left (embeddings,
    final norm, head) stays in the root unit.  Example::

        FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))

    The instance is also usable as a function policy (``__call__``) with the
    same rule.
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

    Any other return value raises ``ValueError``.  Example, blocks as units
    and the head kept gathered from forward to backward::

        CustomPolicy(
            lambda m: isinstance(m, Block)
            or (m is model.head and {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP})
        )
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


def _is_object_policy(policy: object) -> bool:
    """True for :class:`_Policy` instances and look-alikes with a ``_run_policy`` method.

    The duck-typed case lets a policy object from another implementation of
    the same API (for instance torch's own policy classes) take the one-pass
    path instead of being treated as a plain function.
    """
    return isinstance(policy, _Policy) or callable(getattr(policy, "_run_policy", None))
