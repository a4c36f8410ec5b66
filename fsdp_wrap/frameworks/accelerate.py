"""What :func:`fsdp_wrap.install` adds to Hugging Face Accelerate: an exact
sharded optimizer resume.

Accelerate's ``load_fsdp_optimizer`` (used by ``Accelerator.load_state`` and
by the transformers ``Trainer``'s ``resume_from_checkpoint``) loads a
``SHARDED_STATE_DICT`` optimizer checkpoint into the template
``FSDP.optim_state_dict(model, optimizer)`` of the optimizer it is handed,
which is freshly built and has no state: Adam's moments are not read, and the
resumed run drifts from the uninterrupted one (with torch's FSDP1 as well;
:mod:`fsdp_wrap.checkpoint.optim_template` explains).  Installed, the function
is wrapped: when the model is an fsdp_wrap unit, the state-dict type is not
FULL, DCP is used and the optimizer has no state, the optimizer is first given
zero state shaped by the checkpoint's metadata
(:func:`~fsdp_wrap.checkpoint.optim_template.init_optim_state_from_checkpoint`),
then Accelerate's own function runs unchanged.  Anything else goes straight
to Accelerate's function.

Accelerate binds the function by name in several modules when they are
imported (``accelerate.utils``, ``accelerate.accelerator``,
``transformers.trainer``), so the wrapper is set in ``accelerate.utils.fsdp_utils``
before those imports run: at once when Accelerate is already imported, else by
a finder on ``sys.meta_path`` that sets it the moment that module has run
(:class:`~fsdp_wrap.frameworks._patches.FunctionWraps`).
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Callable
from typing import Any

from fsdp_wrap.checkpoint.optim_template import init_optim_state_from_checkpoint
from fsdp_wrap.frameworks._patches import MARK, FunctionWraps, marked
from fsdp_wrap.frameworks._patches import original_in as _original_in
from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["FUNCTION", "MODULE", "WRAPS", "original_in", "wrap"]

MODULE = "accelerate.utils.fsdp_utils"
FUNCTION = "load_fsdp_optimizer"
_MARK = MARK


def _checkpoint_dir(original: Callable[..., Any], input_dir: Any, index: int) -> str:
    """The directory Accelerate reads a sharded optimizer state from (its own rule)."""
    name = f"{original.__globals__.get('OPTIMIZER_NAME', 'optimizer')}_{index}"
    path = os.fspath(input_dir)
    return path if os.path.basename(os.path.normpath(path)) == name else os.path.join(path, name)


def _should_seed(args: dict[str, Any]) -> bool:
    plugin, model, optimizer = args.get("fsdp_plugin"), args.get("model"), args.get("optimizer")
    sdt = getattr(plugin, "state_dict_type", None)
    return (
        getattr(plugin, "fsdp_version", 1) == 1
        and sdt is not None
        and "FULL" not in str(getattr(sdt, "name", sdt)).upper()
        and bool(args.get("use_dcp", True))
        and isinstance(model, FullyShardedDataParallel)
        and optimizer is not None
        and not any(optimizer.state.values())
    )


def original_in(module: types.ModuleType) -> Callable[..., Any] | None:
    """Accelerate's function in ``module``, or ``None`` if it is missing or
    already wrapped."""
    return _original_in(module, FUNCTION)


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``load_fsdp_optimizer`` that first readies a stateless optimizer for the load."""
    signature = inspect.signature(original)

    def load_fsdp_optimizer(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # (Accelerate reports its own misuse)
        bound.apply_defaults()
        named = bound.arguments
        seeded = False
        if _should_seed(named):
            ckpt = _checkpoint_dir(original, named["input_dir"], named.get("optimizer_index", 0))
            if os.path.isfile(os.path.join(ckpt, ".metadata")):
                seeded = init_optim_state_from_checkpoint(
                    named["model"], named["optimizer"], ckpt, key="optimizer") > 0
        try:
            return original(*args, **kwargs)
        except BaseException:
            if seeded:  # no placeholder outlives a failed load
                named["optimizer"].state.clear()
            raise

    return marked(load_fsdp_optimizer, original)


#: What install() wraps in Accelerate.
WRAPS = FunctionWraps(MODULE, {FUNCTION: wrap})
