"""What an adapter checkpoint holds and how PEFT names it.

``save_full_checkpoint(..., trainable_only=True)`` streams only the parameters
that train.  When the wrapped model is a ``peft`` model the files follow
PEFT's own layout, the one ``PeftModel.save_pretrained`` writes and
``PeftModel.from_pretrained`` reads: ``adapter_model.safetensors`` (one file,
no index) and ``adapter_config.json``.

PEFT's checkpoint keys are the ``PeftModel``'s state-dict keys with the
adapter's name taken out:

* ``base_model.model.<layer>.lora_A.default.weight`` ->
  ``base_model.model.<layer>.lora_A.weight`` (a module per adapter: the name is
  the second-last part);
* ``<...>.<name>.default`` -> ``<...>.<name>`` (a parameter per adapter, the
  name last);
* DoRA's magnitude, ``<layer>.lora_magnitude_vector.default.weight`` ->
  ``<layer>.lora_magnitude_vector`` (PEFT keeps the key it had before the
  magnitude became a module);
* ``modules_to_save``: the trained copy
  ``<module>.modules_to_save.default.<param>`` -> ``<module>.<param>``.

Only the LoRA family is mapped (``peft_type`` ``LORA``: LoRA, DoRA, biases,
``modules_to_save``); other PEFT methods rename keys their own way, so they
are refused rather than written under names PEFT would not load.  ``peft``
itself is imported only here, lazily, when a model carries a ``peft_config``.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FINETUNE_HINT = "pip install peft (or, from a checkout, pip install -e \".[finetune]\")"
_MAPPED_TYPES = ("LORA",)


def import_peft(purpose: str) -> Any:
    """The ``peft`` package, or an ``ImportError`` naming ``purpose`` and the extra."""
    try:
        import peft
    except ImportError:
        raise ImportError(f"{purpose} needs peft, which is not installed: {FINETUNE_HINT}") from None
    return peft


@dataclass
class PeftTarget:
    """The PEFT model inside an FSDP root and how its keys become checkpoint keys."""

    prefix: str  # its clean FQN under the root ("" when the root wraps it directly)
    module: nn.Module
    adapter: str
    key_prefix: str  # "" for a PeftModel; "base_model." for a bare tuner (LoraModel)
    configs: dict[str, Any]  # its peft_config: adapter name -> config

    def file_key(self, key: str) -> str | None:
        """The checkpoint key of clean model key ``key``; ``None`` if outside the PEFT model."""
        if self.prefix:
            if not key.startswith(self.prefix + "."):
                return None
            key = key[len(self.prefix) + 1 :]
        return self.key_prefix + peft_key(key, self.adapter)


def peft_key(key: str, adapter: str) -> str:
    """A PEFT model's state-dict key without adapter ``adapter``'s name (PEFT's file key)."""
    parts = key.split(".")
    if len(parts) < 2:
        return key
    if parts[-1] == adapter:  # a parameter per adapter
        return ".".join(parts[:-1])
    for i in range(len(parts) - 2, -1, -1):  # the trained copy of a module to save
        if parts[i] == "modules_to_save" and parts[i + 1] == adapter:
            return ".".join(parts[:i] + parts[i + 2 :])
    if parts[-2] == adapter:  # a module per adapter
        if len(parts) >= 3 and parts[-3] == "lora_magnitude_vector" and parts[-1] == "weight":
            return ".".join(parts[:-2])
        return ".".join(parts[:-2] + parts[-1:])
    return key


def find_peft(named_modules: list[tuple[str, nn.Module]]) -> PeftTarget | None:
    """The outermost module carrying a ``peft_config`` (clean names; the caller leaves
    FSDP units out, whose attribute lookup reaches the module they wrap)."""
    for name, mod in named_modules:
        config = getattr(mod, "peft_config", None)
        if not isinstance(config, dict) or not config:
            continue
        peft = import_peft("saving a PEFT model's adapter (trainable_only=True)")
        is_peft_model = isinstance(mod, peft.PeftModel)
        return PeftTarget(name, mod, _active_adapter(mod, config),
                          "" if is_peft_model else "base_model.", config)
    return None


def _active_adapter(mod: nn.Module, config: dict[str, Any]) -> str:
    active = getattr(mod, "active_adapter", None)
    if isinstance(active, (list, tuple)):
        active = active[0] if len(active) == 1 else None
    if isinstance(active, str) and active in config:
        return active
    return next(iter(config))


def adapter_key_map(target: PeftTarget, keys: list[str], rank: int) -> dict[str, str]:
    """``{clean model key: PEFT file key}`` for the trainable keys; a clear error for
    what PEFT's layout cannot hold."""
    config = target.configs
    where = f"the PEFT model at '{target.prefix}'" if target.prefix else "the PEFT model"
    peft_type = getattr(config[target.adapter], "peft_type", None)
    peft_type = str(getattr(peft_type, "value", peft_type))
    if peft_type not in _MAPPED_TYPES:
        raise NotImplementedError(
            f"[rank {rank}] save_full_checkpoint(trainable_only=True) writes PEFT's layout for "
            f"LoRA adapters (peft_type LORA) but adapter '{target.adapter}' is {peft_type}; gather "
            "a FULL state dict and pass it to PeftModel.save_pretrained(path, state_dict=...)"
        )
    others = [a for a in config if a != target.adapter]
    out: dict[str, str] = {}
    for key in keys:
        foreign = [a for a in others if f".{a}." in key or key.endswith(f".{a}")]
        if foreign:
            raise ValueError(
                f"[rank {rank}] save_full_checkpoint(trainable_only=True): '{key}' of adapter "
                f"'{foreign[0]}' trains beside the active adapter '{target.adapter}'; one adapter "
                f"is saved at a time: freeze the others (model.set_adapter('{target.adapter}'))"
            )
        file_key = target.file_key(key)
        if file_key is None:
            raise ValueError(
                f"[rank {rank}] save_full_checkpoint(trainable_only=True): trainable parameter "
                f"'{key}' lies outside {where}, so PEFT's adapter file cannot hold it; freeze it "
                "or wrap the PEFT model itself"
            )
        out[key] = file_key
    files = list(out.values())
    if len(set(files)) != len(files):
        dup = next(k for k in files if files.count(k) > 1)
        raise ValueError(f"[rank {rank}] two trainable parameters map to PEFT's key '{dup}'")
    return out


def write_adapter_config(directory: str, target: PeftTarget) -> None:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (inference mode
    on, the base model's name filled in), without touching the model's own config."""
    mod: Any = target.module
    config: Any = copy.deepcopy(target.configs[target.adapter])
    base = mod.get_base_model() if hasattr(mod, "get_base_model") else getattr(mod, "model", mod)
    if getattr(config, "base_model_name_or_path", None) is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if getattr(config, "task_type", None) is None:
        cls = type(base)
        auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    # The config's own writer: PEFT's field set and JSON conventions.
    config.save_pretrained(directory, auto_mapping_dict=auto_mapping)
    path = os.path.join(directory, ADAPTER_CONFIG)
    with open(path, "rb+") as f:  # make the file durable like the weights
        f.flush()
        os.fsync(f.fileno())
    with open(path, encoding="utf-8") as f:
        json.load(f)  # (PEFT wrote valid JSON; a damaged write fails here, before commit)
