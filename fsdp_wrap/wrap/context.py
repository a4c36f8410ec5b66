"""Manual wrapping: :func:`enable_wrap` and :func:`wrap`.

Inside an ``enable_wrap`` block, ``wrap(module)`` builds a unit with the
block's wrapper class and keyword arguments; outside, it returns the module
untouched.  :func:`_wrap` is also how the function-policy traversal builds
each unit, so a module's ``_wrap_overrides`` (set by the mixed-precision
overrides) applies both ways.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Generator
from typing import Any

from torch import nn

from fsdp_wrap.wrap.policies import WrapperFn


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
    Example::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, device_id=device):
            blocks = [wrap(Block()) for _ in range(depth)]   # each sharded at once
            model = FullyShardedDataParallel(Model(blocks))  # the root unit
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
