"""Auto-wrapping policies and manual wrapping helpers for fsdp_wrap.

A *wrapping policy* decides which submodules of the module handed to the FSDP
constructor become FSDP units of their own.  Each unit owns the parameters of
its subtree that no deeper unit already owns, so the choice of units decides
how parameters are grouped for all-gather, reduce-scatter and freeing.

Two kinds of policy exist, with the same names and calling protocols as
torch's FSDP1 wrapping module (see :mod:`fsdp_wrap.wrap.policies`): function
policies, asked about each module by the traversal :func:`_recursive_wrap`,
and object policies (:class:`ModuleWrapPolicy`, :class:`CustomPolicy`), which
pick all their targets in one pass.

:func:`_auto_wrap` is what the FSDP constructor calls; :func:`enable_wrap` and
:func:`wrap` support wrapping by hand while a model is being built.

The package's modules, each importing only those listed before it:

* ``policies``: the function and object policies;
* ``context``: :func:`enable_wrap` / :func:`wrap`;
* ``traversal``: :func:`_recursive_wrap` and the children-first tree walks;
* ``mp_overrides``: the units and float32 hooks of the classes mixed precision skips;
* ``auto_wrap``: :func:`_auto_wrap`.

Every name used to live in one module ``fsdp_wrap.wrap``; they are all
importable from here, and report ``fsdp_wrap.wrap`` as their module.
"""

from fsdp_wrap.wrap.auto_wrap import (
    _DEFAULT_MP_CLASSES_TO_IGNORE,  # noqa: F401 (re-exported)
    _auto_wrap,
    _check_frozen_params,
    _params_owned_by_unit,
)
from fsdp_wrap.wrap.context import (
    _WRAP_CONTEXT,  # noqa: F401 (re-exported)
    _wrap,
    _WrapContext,
    enable_wrap,
    wrap,
)
from fsdp_wrap.wrap.policies import (
    CustomPolicy,
    ModuleWrapPolicy,
    PolicyFn,  # noqa: F401 (re-exported)
    WrapperFn,  # noqa: F401 (re-exported)
    _is_object_policy,
    _module_wrap_policy,
    _or_policy,
    _Policy,
    _wrap_module_cls_individually,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from fsdp_wrap.wrap.traversal import (
    _RECURSIVE_WRAP_OWN_ARGS,  # noqa: F401 (re-exported)
    _named_modules_post_order,
    _post_order_apply,
    _recursive_wrap,
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

# The classes and functions keep the module they were defined in before the
# split, so reprs (``<fsdp_wrap.wrap.ModuleWrapPolicy object at ...>``) and
# pickles by reference name ``fsdp_wrap.wrap`` as they always did.
for _obj in (
    CustomPolicy, ModuleWrapPolicy, _Policy, _WrapContext,
    always_wrap_policy, lambda_auto_wrap_policy, size_based_auto_wrap_policy,
    transformer_auto_wrap_policy, _module_wrap_policy, _wrap_module_cls_individually,
    _or_policy, _is_object_policy, enable_wrap, wrap, _wrap, _recursive_wrap,
    _post_order_apply, _named_modules_post_order, _params_owned_by_unit,
    _check_frozen_params, _auto_wrap,
):
    _obj.__module__ = __name__
del _obj
