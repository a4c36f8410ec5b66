"""Tree walks of the auto-wrap pass.

:func:`_recursive_wrap` is the depth-first traversal that asks a function
policy about every module and wraps what it selects; :func:`_post_order_apply`
and :func:`_named_modules_post_order` visit a tree children-first for the
object-policy path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

import fsdp_wrap.runtime.construct as _init
from fsdp_wrap.wrap.context import _wrap
from fsdp_wrap.wrap.policies import PolicyFn, WrapperFn


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
            module, wrapper_cls, ignored_modules, "Child module {first} is already wrapped by {cls}"
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
