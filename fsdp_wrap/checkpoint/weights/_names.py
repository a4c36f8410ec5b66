"""How a model's names meet the names in a Hugging Face checkpoint.

A checkpoint written by ``save_pretrained`` names tensors as the saved model's
``state_dict()`` does.  The model being filled may be wrapped differently from
the one that was saved; the rules, applied to every key of the model's FULL
state dict (clean names, no FSDP prefixes), are:

* **PEFT.**  A ``peft`` model (``PeftModel`` -> ``LoraModel`` -> the Hugging Face
  model) names the base weights ``base_model.model.<name>`` and a layer it
  adapts keeps its original weight as ``<layer>.base_layer.weight``.  When the
  model's keys carry that prefix and the checkpoint's do not, both are dropped:
  ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` reads
  ``model.layers.0.self_attn.q_proj.weight``.  The adapters themselves
  (``lora_A``, ``lora_B``, ...: names with a part starting with the tuner's
  prefix) are not in a base checkpoint: they are expected to be missing, not
  refused (``pretrained_init`` gives them PEFT's own init).
* **The base model's prefix.**  A Hugging Face model with a head keeps its
  body under ``base_model_prefix`` (``model`` for LLaMA, ``transformer`` for
  GPT-2, ``bert`` for BERT).  Loading the body alone (``LlamaModel``) from a
  checkpoint of the model with a head prepends the prefix, and the head's
  tensors, outside the body, are not read (nor counted as unexpected); loading
  a model with a head from a checkpoint of the body alone drops it.  The rule
  (none, prepend or drop, for the model's ``base_model_prefix`` and ``model``)
  is chosen once for the whole checkpoint: the one under which the most of
  the model's keys are found, no rule winning a tie.
* **Tied weights.**  ``save_pretrained`` stores a tied group (the GPT-2 head
  and the token embedding) once; every name of the group then reads that
  tensor.
* **Computed buffers.**  Stored tensors named like one of the model's
  non-persistent buffers (old checkpoints' ``rotary_emb.inv_freq``,
  ``position_ids``), or matching the model's
  ``_keys_to_ignore_on_load_unexpected``, are not read and not unexpected.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch.nn as nn

__all__ = ["NameMap", "PEFT_PREFIX", "adapter_prefix", "hf_hints", "match_names"]

PEFT_PREFIX = "base_model.model."
_PEFT_LAYER = ".base_layer."


@dataclass
class NameMap:
    """The outcome of matching: where each model key reads from, and what is left."""

    stored_for: dict[str, str]  # model key -> stored name
    missing: list[str]  # model keys found nowhere (in the model's order)
    unexpected: list[str]  # stored names nothing reads
    rule: str  # the rule chosen, in words (for messages)
    ignored: list[str] = field(default_factory=list)  # stored names left aside on purpose
    adapters: list[str] = field(default_factory=list)  # missing PEFT adapter keys (expected)


def adapter_prefix(module: nn.Module) -> str | None:
    """The name prefix of a ``peft`` model's adapter tensors (``lora_`` for LoRA)."""
    if getattr(module, "peft_config", None) is None:
        return None
    prefix = getattr(getattr(module, "base_model", None), "prefix", None)
    return prefix if isinstance(prefix, str) and prefix else None


def hf_hints(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(base prefixes to try, unexpected-key patterns)`` of the Hugging Face model
    inside ``module`` (itself, or the one a ``peft`` model wraps)."""
    hf = module
    inner = getattr(getattr(module, "base_model", None), "model", None)
    if not hasattr(hf, "base_model_prefix") and isinstance(inner, nn.Module):
        hf = inner
    prefixes = []
    prefix = getattr(hf, "base_model_prefix", "")
    if isinstance(prefix, str) and prefix:
        prefixes.append(prefix)
    if "model" not in prefixes:
        prefixes.append("model")
    patterns = list(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])
    return prefixes, [p for p in patterns if isinstance(p, str)]


def _peft_base_name(key: str) -> str:
    key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    return key.replace(_PEFT_LAYER, ".")


def match_names(
    model_keys: Sequence[str],
    stored: Collection[str],
    *,
    prefixes: Sequence[str] = ("model",),
    tied: Sequence[Sequence[str]] = (),
    computed: Collection[str] = (),
    ignore_unexpected: Sequence[str] = (),
    adapters: str | None = None,
) -> NameMap:
    """Match ``model_keys`` (the FULL state dict's, clean) to ``stored`` names.

    ``tied``: groups of model keys naming one tensor; ``computed``: the model's
    non-persistent buffers; ``ignore_unexpected``: regular expressions of stored
    names to leave aside (the model's ``_keys_to_ignore_on_load_unexpected``);
    ``adapters``: a PEFT model's adapter prefix (``lora_``): its keys missing
    from a base checkpoint are listed apart, as expected.
    """
    stored_set = set(stored)
    peft = bool(model_keys) and all(k.startswith(PEFT_PREFIX) for k in model_keys) and not any(
        s.startswith(PEFT_PREFIX) for s in stored_set
    )
    base = {k: _peft_base_name(k) if peft else k for k in model_keys}

    rules: list[tuple[str, str, str]] = [("", "", "names as they are")]
    for p in prefixes:
        rules.append(("add", p, f"'{p}.' prepended to the model's names (the model is the base "
                                f"model of the checkpoint's)"))
        rules.append(("drop", p, f"'{p}.' dropped from the model's names (the checkpoint is of "
                                 f"the base model)"))

    def apply(rule: tuple[str, str, str], key: str) -> str:
        kind, p, _ = rule
        if kind == "add":
            return f"{p}.{key}"
        if kind == "drop" and key.startswith(p + "."):
            return key[len(p) + 1:]
        return key

    best, best_hits = rules[0], -1
    for rule in rules:
        hits = sum(apply(rule, b) in stored_set for b in base.values())
        if hits > best_hits:
            best, best_hits = rule, hits
    stored_for = {k: apply(best, b) for k, b in base.items() if apply(best, b) in stored_set}
    for group in tied:  # stored once: every name of the group reads it
        found = [stored_for[k] for k in group if k in stored_for]
        if found:
            for k in group:
                stored_for.setdefault(k, found[0])
    missing = [k for k in model_keys if k not in stored_for]
    adapter_keys = [k for k in missing if peft and adapters is not None
                    and any(part.startswith(adapters) for part in k.split("."))]

    used = set(stored_for.values())
    outside = best[1] + "." if best[0] == "add" else None
    computed_names = {apply(best, _peft_base_name(k) if peft else k) for k in computed}
    patterns = [re.compile(p) for p in ignore_unexpected]
    unexpected, ignored = [], []
    for s in sorted(stored_set - used):
        if (outside is not None and not s.startswith(outside)) or s in computed_names or any(
            p.search(s) for p in patterns
        ):
            ignored.append(s)
        else:
            unexpected.append(s)
    words = best[2] + ("; PEFT's 'base_model.model.' and '.base_layer' dropped" if peft else "")
    return NameMap(stored_for, missing, unexpected, words, ignored, adapter_keys)
