"""``param_init_fn`` for a meta-device model that a checkpoint will fill.

fsdp_wrap materialises a meta-device model unit by unit while wrapping it
(each module of the unit is passed to ``param_init_fn``, then the unit is
flattened and only this rank's shard kept), so no rank ever holds the whole
model.  Its default, ``to_empty()`` and ``reset_parameters()``, spends time
drawing random weights that :func:`~fsdp_wrap.checkpoint.weights.load_pretrained` then
overwrites, breaks tied weights (each module gets a tensor of its own), and
fails on modules without ``reset_parameters()`` (a rotary embedding, an
RMSNorm).  :func:`pretrained_init` instead:

* gives each meta parameter the checkpoint holds uninitialised memory, once
  per tensor, so tied parameters stay one parameter;
* computes every meta buffer (rotary ``inv_freq``, BERT's ``position_ids``),
  and every parameter the checkpoint lacks (a new head), with the model's own
  init: the Hugging Face model's ``_init_weights(module)`` for a module of a
  ``transformers`` model, else the module's ``reset_parameters()``; for a
  ``peft`` LoRA layer, its ``reset_lora_parameters`` with the adapter's
  ``init_lora_weights``.  Buffers built on a real device (a model made under
  ``accelerate.init_empty_weights()``, which puts only parameters on meta) are
  kept as the module's ``__init__`` computed them.

Random draws for parameters the checkpoint lacks use each rank's generator:
seed every rank the same, as for any FSDP initialisation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fsdp_wrap.checkpoint.weights._files import stored_tensors
from fsdp_wrap.checkpoint.weights._names import hf_hints, match_names
from fsdp_wrap.handle.layout import VALUES_PENDING

__all__ = ["pretrained_init"]


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hf_owners(model: nn.Module) -> dict[int, Any]:
    """``id(module) -> the nearest enclosing module with _init_weights`` (a
    ``transformers`` PreTrainedModel; a composite model's sub-models own theirs)."""
    owner_of_name: dict[str, Any] = {}
    out: dict[int, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        parent = owner_of_name.get(name.rpartition(".")[0]) if name else None
        own = m if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config") else parent
        owner_of_name[name] = own
        out.setdefault(id(m), own)
    return out


def _loaded_param_ids(model: nn.Module, path: str | os.PathLike[str] | None) -> set[int] | None:
    """Parameters ``path`` will fill (``None``: all of them)."""
    if path is None:
        return None
    stored = stored_tensors(os.fspath(path))
    named = list(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for n, p in named:
        groups.setdefault(id(p), []).append(n)
    keys = [n for n, _ in named] + [
        n for n, _ in _persistent_buffers(model)
    ]
    prefixes, patterns = hf_hints(model)
    found = match_names(keys, stored, prefixes=prefixes,
                        tied=[g for g in groups.values() if len(g) > 1],
                        ignore_unexpected=patterns).stored_for
    return {id(p) for n, p in named if n in found}


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                out.append((f"{mod_name}.{n}" if mod_name else n, b))
    return out


def pretrained_init(
    model: nn.Module,
    path: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str | None = None,
) -> Callable[[nn.Module], nn.Module]:
    """A ``param_init_fn`` for wrapping the meta-device ``model`` before
    :func:`~fsdp_wrap.load_pretrained` fills it (see the module docstring).

    Call it on the unwrapped model, before ``FullyShardedDataParallel(model,
    param_init_fn=...)``.  ``path``, the checkpoint, tells which parameters it
    holds (only its headers are read); without it every parameter is taken as
    held by the checkpoint.  ``device``: where to materialise (default the
    current CUDA device if there is one, else CPU; the unit then moves to its
    compute device as usual).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"pretrained_init expects the model (an nn.Module) but got "
                        f"{type(model).__name__}")
    dev = torch.device(device) if device is not None else _default_device()
    return _PretrainedInit(model, _loaded_param_ids(model, path), dev)


class _PretrainedInit:
    """The ``param_init_fn`` :func:`pretrained_init` returns (called once per module)."""

    def __init__(self, model: nn.Module, loaded: set[int] | None, device: torch.device) -> None:
        self.device = device
        self.loaded = loaded  # ids of the parameters the checkpoint holds (None: all)
        self.owners = _hf_owners(model)
        self.names = {id(m): n for n, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        self.peft_config = getattr(model, "peft_config", None)
        self.made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, real)

    def __call__(self, m: nn.Module) -> nn.Module:
        with torch.no_grad():
            if callable(getattr(m, "reset_lora_parameters", None)) and _has_meta(m, "base_layer"):
                self._lora_init(m)
            if self._materialize(m):
                self._own_init(m)
        return m  # (as to_empty does: Accelerate's re-tying wrapper uses the return value)

    def _real(self, t: torch.Tensor, param: bool) -> torch.Tensor:
        """One real tensor per meta tensor (tied parameters stay one)."""
        hit = self.made.get(id(t))
        if hit is not None:
            return hit[1]
        new: torch.Tensor = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        if param:
            new = nn.Parameter(new, requires_grad=t.requires_grad)
            if not self._unloaded(t):
                # the checkpoint fills it: the unit's shard need not copy these bytes
                setattr(new, VALUES_PENDING, True)
        self.made[id(t)] = (t, new)  # (keeps the meta tensor alive: ids stay unique)
        return new

    def _unloaded(self, p: torch.Tensor) -> bool:
        return self.loaded is not None and id(p) not in self.loaded

    def _materialize(self, m: nn.Module) -> bool:
        """Real tensors for ``m``'s own meta tensors; whether any needs computing."""
        needs_init = False
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                fresh = id(p) not in self.made
                m._parameters[name] = self._real(p, param=True)  # type: ignore[assignment]
                needs_init |= fresh and self._unloaded(p)
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = self._real(b, param=False)
                needs_init = True
        return needs_init

    def _own_init(self, m: nn.Module) -> None:
        """The model's own init for ``m``: transformers' ``_init_weights``, else
        ``reset_parameters()``."""
        owner = self.owners.get(id(m))
        if owner is not None:
            owner._init_weights(m)
            return
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
            return
        meta_of = {id(real): meta for meta, real in self.made.values()}
        what = [n for n, b in m._buffers.items() if b is not None] + [
            n for n, p in m._parameters.items()
            if p is not None and self._unloaded(meta_of.get(id(p), p))
        ]
        raise ValueError(
            f"pretrained_init: module '{self.names.get(id(m), '?')}' ({type(m).__name__}) has "
            f"meta-device tensors {what} that the checkpoint does not hold, and no "
            "reset_parameters() nor a transformers model around it to compute them. Build the "
            "model with its buffers on a real device (only parameters on meta, e.g. "
            "accelerate.init_empty_weights()), or give the module a reset_parameters()"
        )

    def _lora_init(self, m: nn.Module) -> None:
        """A ``peft`` LoRA layer: its adapters (every submodule but the base layer)
        materialised, then PEFT's own init for each adapter."""
        base = getattr(m, "base_layer", None)
        for sub in m.modules():
            if sub is m or sub is base or (base is not None and _inside(sub, base)):
                continue
            self._materialize(sub)
        config = self.peft_config
        for adapter in list(getattr(m, "lora_A", {}).keys()):
            cfg = config.get(adapter) if isinstance(config, dict) else None
            m.reset_lora_parameters(  # type: ignore[operator]
                adapter, getattr(cfg, "init_lora_weights", True))


def _has_meta(m: nn.Module, skip: str) -> bool:
    """Whether ``m`` or a submodule (not under ``m.<skip>``) holds a meta tensor."""
    base = getattr(m, skip, None)
    for sub in m.modules():
        if base is not None and (sub is base or _inside(sub, base)):
            continue
        if any(t is not None and t.is_meta for t in (*sub._parameters.values(), *sub._buffers.values())):
            return True
    return False


def _inside(sub: nn.Module, root: nn.Module) -> bool:
    return any(sub is x for x in root.modules())
