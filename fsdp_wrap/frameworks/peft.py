"""What :func:`fsdp_wrap.install` adds to PEFT: adapters that save and load
right in a wrapped model.

Every PEFT adapter save and load goes through two functions of
``peft.utils.save_and_load``: ``get_peft_model_state_dict`` (``save_pretrained``,
Accelerate's ``save_fsdp_model(adapter_only=True)`` behind the ``Trainer``'s
checkpoints, TRL) and ``set_peft_model_state_dict`` (``load_adapter``,
Accelerate's ``load_fsdp_model`` behind ``resume_from_checkpoint``).  Both
match the model's module names against state-dict keys, and an FSDP1 model
defeats them three ways (peft 0.21, torch's FSDP1 exactly as fsdp_wrap):

* module names carry ``_fsdp_wrapped_module.`` once per unit on the way down,
  and PEFT strips only a leading one: with nested units (a unit per decoder
  layer, per LoRA ``Linear``) no adapter matches, and ``save_model`` writes an
  ``adapter_model.safetensors`` of 40 bytes, a checkpoint holds no adapter,
  a resume restores none;
* loading decides whether keys keep PEFT's ``base_model.model.`` prefix from
  ``named_parameters()``, which under ``use_orig_params=False`` names the flat
  parameters (``_flat_param``): a model wrapped at the root alone loads nothing;
* loading maps the file's keys onto ``model.state_dict()``, which under
  ``FullStateDictConfig(rank0_only=True)`` (what Accelerate sets) is empty on
  every rank but 0: those ranks load nothing and keep their shard of each
  adapter at its old values.  (It also gathers the whole model to read key
  names.)

A unit cannot present other module names to PEFT without presenting them to
everybody else (torch's names are part of FSDP1's contract), so the two
functions are wrapped.  The wrappers act only when the model handed to them
is an fsdp_wrap unit or holds one; then PEFT's own function runs unchanged on a
:class:`PeftView` of the model, which shows it:

* ``named_modules()`` / ``modules()`` with clean names (no wrapper prefixes,
  units replaced by the modules they wrap), so every PEFT rule (LoRA,
  ``modules_to_save``, biases, embeddings, transformers' weight conversions)
  finds its modules;
* for a load, ``state_dict()`` and ``named_parameters()`` as names, shapes and
  dtypes on the meta device, from the units' own records: the same on every
  rank, nothing gathered;
* ``load_state_dict()`` through the outermost unit, so fsdp_wrap's hooks load
  every rank's shard whatever state-dict type is set (a ``PeftModel`` inside
  the root is loaded through the root, with its keys prefixed);
* anything else as the model itself.

Any other model (torch's FSDP1 included) goes straight to PEFT's function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from fsdp_wrap.frameworks._patches import FunctionWraps, marked
from fsdp_wrap.handle.flat_tensor import FlatParameter
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.runtime.state import is_unit, live_units

__all__ = ["GET", "MODULE", "SET", "WRAPS", "PeftView", "wrap_get", "wrap_set"]

MODULE = "peft.utils.save_and_load"
GET = "get_peft_model_state_dict"
SET = "set_peft_model_state_dict"


def _clean(name: str) -> str:
    """A module name without the wrappers' parts (``a._fsdp_wrapped_module`` -> ``a``)."""
    return clean_fqn(name + ".")[:-1]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _placement(module: nn.Module) -> tuple[nn.Module, str] | None:
    """``(through, prefix)``: the module whose state-dict calls reach every unit
    ``module`` touches, and ``module``'s clean name under it; ``None`` when no
    fsdp_wrap unit is involved (or a torch FSDP1 one is).

    ``through`` is the outermost unit whose tree holds ``module`` (a
    ``PeftModel`` inside the root is loaded through the root), else ``module``
    itself when units live inside it.
    """
    holds_units = False
    for m in module.modules():
        if is_unit(m):
            holds_units = True
        elif "_fsdp_wrapped_module" in m._modules:  # torch's FSDP1: not ours to change
            return None
    best: tuple[nn.Module, str] | None = None
    for state in live_units():
        unit = state.module
        if state._is_root is False or unit is module:
            continue  # (a nested unit: its root is searched instead)
        for name, m in unit.named_modules():
            if m is module and (best is None or len(name) > len(best[1])):
                best = (unit, name)  # the outermost tree holding it (before lazy init: any)
                break
    if best is not None:
        return best[0], _clean(best[1])
    return (module, "") if holds_units else None


class PeftView:
    """A wrapped model as PEFT's state-dict functions need to see it (module docstring).

    ``keys_only``: ``state_dict()`` gives meta tensors (a load maps names
    only); otherwise the real state dict under the model's state-dict type.
    """

    def __init__(self, module: nn.Module, through: nn.Module, prefix: str, keys_only: bool) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_through", through)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_keys_only", keys_only)

    @classmethod
    def of(cls, module: Any, keys_only: bool) -> PeftView | None:
        """The view of ``module``, or ``None`` if no fsdp_wrap unit is involved."""
        if isinstance(module, PeftView) or not isinstance(module, nn.Module):
            return None
        placed = _placement(module)
        return None if placed is None else cls(module, placed[0], placed[1], keys_only)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)

    def __repr__(self) -> str:
        return f"PeftView({type(self._module).__name__}, prefix={self._prefix!r})"

    # ----------------------------------------------------------- module names

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """``(clean name, module)`` pre-order; a unit is skipped, the module it
        wraps stands in its place under the unit's name."""
        for name, m in self._module.named_modules(memo, prefix, remove_duplicate):
            if not is_unit(m):
                yield _clean(name), m

    def modules(self) -> Iterator[nn.Module]:
        for _, m in self.named_modules():
            yield m

    def get_base_model(self) -> Any:
        base = self._module.get_base_model()
        for name, m in self.named_modules():
            if m is base:
                return PeftView(base, self._through, _join(self._prefix, name), self._keys_only)
        return base

    # ------------------------------------------------------------- state dict

    def _layout(self) -> dict[str, tuple[torch.Size, torch.dtype, bool]]:
        """Clean key -> (full shape, dtype, is a parameter) for everything the
        module's state dict holds, read from the modules and the units'
        records of their flattened parameters (nothing gathered)."""
        flattened: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        for m in self._through.modules():  # (the root's own parameters too)
            if is_unit(m):
                for h in m._handles:
                    for info in h.infos:
                        flattened.setdefault(id(info.module), {})[info.name] = (info.shape, h.orig_dtype)
                    for s in h.shared:
                        info = h.infos[s.index]
                        flattened.setdefault(id(s.module), {})[s.name] = (info.shape, h.orig_dtype)
        out: dict[str, tuple[torch.Size, torch.dtype, bool]] = {}
        for name, m in self.named_modules(remove_duplicate=False):
            own = flattened.get(id(m), {})
            for pname, (shape, dtype) in own.items():
                out[_join(name, pname)] = (shape, dtype, True)
            for pname, p in m._parameters.items():
                if p is not None and pname not in own and not isinstance(p, FlatParameter):
                    out[_join(name, pname)] = (p.shape, p.dtype, True)
            for bname, b in m._buffers.items():
                if b is not None and bname not in m._non_persistent_buffers_set:
                    out[_join(name, bname)] = (b.shape, b.dtype, False)
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every original parameter under its clean name, as a meta tensor."""
        for key, (shape, dtype, is_param) in self._layout().items():
            if is_param:
                yield _join(prefix, key), torch.empty(shape, dtype=dtype, device="meta")

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self._keys_only:
            return {k: torch.empty(shape, dtype=dtype, device="meta")
                    for k, (shape, dtype, _) in self._layout().items()}
        if self._through is self._module:
            return self._module.state_dict(*args, **kwargs)
        full = self._through.state_dict()
        head = self._prefix + "." if self._prefix else ""
        return {k[len(head):]: v for k, v in full.items() if k.startswith(head)}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load through the outermost unit (``assign`` is ignored: the values are
        copied into the shards)."""
        if self._through is self._module:
            return self._module.load_state_dict(state_dict, strict=strict)
        head = self._prefix + "." if self._prefix else ""
        result = self._through.load_state_dict({head + k: v for k, v in state_dict.items()},
                                               strict=strict)
        mine = [k[len(head):] for k in result.missing_keys if k.startswith(head)]
        return _IncompatibleKeys(mine, [k[len(head):] for k in result.unexpected_keys])


def _with_view(original: Callable[..., Any], keys_only: bool) -> Callable[..., Any]:
    """``original`` called with a :class:`PeftView` of its ``model`` argument
    when that model involves fsdp_wrap units; unchanged otherwise."""
    signature = inspect.signature(original)

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # (PEFT reports its own misuse)
        view = PeftView.of(bound.arguments.get("model"), keys_only)
        if view is None:
            return original(*args, **kwargs)
        bound.arguments["model"] = view
        return original(*bound.args, **bound.kwargs)

    return call


def wrap_get(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_peft_model_state_dict`` that finds the adapters of a wrapped model."""
    return marked(_with_view(original, keys_only=False), original)


def wrap_set(original: Callable[..., Any]) -> Callable[..., Any]:
    """``set_peft_model_state_dict`` that loads every rank's shard of a wrapped model."""
    return marked(_with_view(original, keys_only=True), original)


#: What install() wraps in PEFT.
WRAPS = FunctionWraps(MODULE, {GET: wrap_get, SET: wrap_set})
