"""Every difference in what is installed that fsdp_wrap cares about, in one place:
torch's version (its private entry points, names and wordings that changed
between releases) and whether an optional package is there.

Most helpers are called at construction or lazy-init time, or resolve a
name once at import.  The autograd-engine queries run per unit and step:
``in_backward`` and ``current_backward`` are one C call each,
``backward_will_accumulate`` (once per flat parameter and backward) one
autograd view and a lookup, about 6 us.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from packaging.version import Version
from torch.autograd.graph import get_gradient_edge

TORCH_VERSION = Version(torch.__version__.split("+")[0])


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is ``major.minor`` or newer, its pre-releases
    and nightlies included (``2.14.0a0+git...`` counts as 2.14)."""
    return TORCH_VERSION.release[:2] >= (major, minor)

#: ``nn.Module.register_state_dict_post_hook`` (public) appeared in torch 2.5;
#: before that only the private ``_register_state_dict_hook`` exists.  Both call
#: ``hook(module, state_dict, prefix, local_metadata)``.
_HAS_PUBLIC_SD_POST_HOOK = hasattr(nn.Module, "register_state_dict_post_hook")

#: ``torch._C._current_graph_task_id()``: -1 unless the calling thread runs an
#: autograd backward.  Private but long-standing (torch 1.13+, so every torch
#: we support has it); resolved once here.
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)

#: ``torch._C._will_engine_execute_node(node)``: whether the backward the calling
#: thread runs will execute ``node`` (reachable from its roots, or wanted for its
#: ``inputs=``); what ``torch.autograd.graph.register_multi_grad_hook`` asks.
#: Present in every torch we support; ``None`` if a future one drops it (then
#: :func:`backward_will_accumulate` cannot tell, and a gradient part from a
#: reentrant checkpoint's backward waits for the end of backward unless the
#: outer backward's own part comes: still reduced once, held longer).
_will_execute: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)


#: ``torch._C._storage_Use_Count``: how many tensors hold a storage (private,
#: present in every torch we support; ``None`` if a future one drops it, and
#: then nothing is freed early).  ``_ONE_TENSOR``: what it reads for a storage
#: held by one tensor, asked the same way (the Python storage object counts).
_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _one_tensor_count() -> int:
    if _storage_use_count is None:
        return -1
    probe = torch.empty(1)
    storage = probe.untyped_storage()
    return _storage_use_count(storage._cdata)


_ONE_TENSOR = _one_tensor_count()


def sole_tensor_of_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only tensor on its storage (no view of it, nor it
    a view of another), so freeing the storage frees nothing anyone else sees.
    ``False`` where torch cannot say."""
    if _storage_use_count is None:
        return False
    storage = tensor.untyped_storage()
    return storage.resizable() and _storage_use_count(storage._cdata) == _ONE_TENSOR


def current_backward() -> int:
    """An id of the autograd backward this thread runs (-1 outside one); a
    reentrant activation checkpoint's backward inside another has its own."""
    return _graph_task_id()


def backward_will_accumulate(param: torch.Tensor) -> bool | None:
    """Whether the backward this thread runs now will accumulate a gradient
    into leaf ``param`` (its gradient accumulator is reachable); ``None``
    where this torch cannot say."""
    if _will_execute is None:
        return None
    return bool(_will_execute(get_gradient_edge(param).node))


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward: a forward seen then is
    activation checkpointing recomputing it (no gather batching; a checkpointed
    root does not finish a 'forward without backward')."""
    return _graph_task_id() != -1


def _python_profiler_flag() -> bool:
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


#: ``profiler_enabled()``: whether a profiler records this thread's ops now
#: (``torch.profiler.profile``, ``torch.autograd.profiler.profile``, or one
#: started from outside, e.g. on demand through Kineto's daemon).  One C call,
#: ~0.1 us: ``record_function`` itself costs ~50 us a label even when nothing
#: records (a dispatcher op on enter and on exit, measured on torch 2.13 CPU),
#: so fsdp_wrap's labels are made only when this says so.  torch's own C
#: check (thread-aware: autograd's threads inherit the profiler's state),
#: else torch's Python flag.
profiler_enabled: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled",
                                               _python_profiler_flag)


#: torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor``
#: (each call then goes through a warning wrapper) in favour of the
#: ``*_single`` names, which older versions lack.  Names, not functions, so a
#: test that patches ``torch.distributed`` still sees every call.
ALL_GATHER_SINGLE = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
REDUCE_SCATTER_SINGLE = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)



def register_state_dict_post_hook(module: nn.Module, hook: Callable[..., Any]) -> Any:
    if _HAS_PUBLIC_SD_POST_HOOK:
        return module.register_state_dict_post_hook(hook)
    return module._register_state_dict_hook(hook)


def register_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., Any]) -> Any:
    """``hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors)``."""
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


#: ``torch.serialization.skip_data(materialize_fake_tensors=...)`` (torch 2.5+) lets
#: ``torch.save`` lay out a file without tensor data, which the offline checkpoint
#: tool fills in one tensor at a time.
HAS_TORCH_SAVE_SKIP_DATA = hasattr(torch.serialization, "skip_data") and TORCH_VERSION >= Version(
    "2.5"
)


def require_torch_save_skip_data() -> None:
    if not HAS_TORCH_SAVE_SKIP_DATA:
        raise RuntimeError(
            f"writing torch.save files tensor by tensor needs torch >= 2.5 (this is "
            f"{torch.__version__}); write safetensors instead (--format safetensors)"
        )


# ------------------------------------------------------------ torch's sentences
#
# fsdp_wrap starts a message with torch's own sentence where torch has one, so
# that code and tests matching on torch's text keep matching.  Where torch
# rewords a sentence between releases, the installed torch's wording is chosen
# here (torch exposes none of these as a constant).  docs/getting_started.rst
# lists them; tests compare fsdp_wrap's message with the installed torch's.

#: The word for FSDP units in the warning about modules (BatchNorm) that
#: mixed precision leaves in float32: torch before 2.14 misspells it.
FSDP_INSTANCES_WORD = "instances" if torch_at_least(2, 14) else "instacnes"


# ------------------------------------------------------------ checkpoint formats

@functools.cache
def dcp_properties_have_strides() -> bool:
    """Whether DCP's ``TensorProperties`` records strides (torch 2.15 on).

    Such a ``.metadata`` pickles six fields, not five; older torch cannot
    unpickle it, and fsdp_wrap's offline reader then drops the strides
    (``fsdp_wrap.checkpoint._dcp.read_metadata``).  A function, asked when a
    checkpoint is read: importing ``torch.distributed.checkpoint`` (with
    DTensor and, through it, torch's FSDP1 modules) takes about 1.5 s, which
    ``import fsdp_wrap`` does not pay.
    """
    from torch.distributed.checkpoint.metadata import TensorProperties

    return "strides" in {f.name for f in dataclasses.fields(TensorProperties)}


# --------------------------------------------------------------- optional packages

PLOT_EXTRA_HINT = ("pip install matplotlib (or, from a checkout, pip install -e \".[plot]\")")


def matplotlib_figure(purpose: str) -> Any:
    """matplotlib's ``Figure`` class: a figure saved with ``fig.savefig`` needs no
    display and leaves pyplot's global state (and the user's backend) alone.

    Raises:
        ImportError: naming ``purpose`` and how to get matplotlib (an optional
            extra: the library never needs it).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"{purpose} needs matplotlib, which is not installed: "
                          f"{PLOT_EXTRA_HINT}") from None
    return Figure
