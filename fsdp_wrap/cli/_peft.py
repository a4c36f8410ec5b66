"""``fsdp-wrap plan --peft lora:r=8,targets=q_proj,v_proj``: a PEFT adapter on the model.

The spec is parsed before anything is built (a bad spec is a usage error);
PEFT is imported only when the adapter is applied, so the planner itself never
needs it.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fsdp_wrap.cli._common import usage_error

#: ``--peft`` keys: the LoraConfig argument each sets and how its value is read.
LORA_KEYS: dict[str, tuple[str, Any]] = {
    "r": ("r", int),
    "alpha": ("lora_alpha", float),
    "dropout": ("lora_dropout", float),
    "targets": ("target_modules", str),
}

SPEC_HELP = ("a PEFT adapter on the model: lora:r=8,targets=q_proj,v_proj[,alpha=16]"
             "[,dropout=0.05] (targets: module names; without them PEFT's defaults for the "
             "architecture); needs peft (the 'finetune' extra)")


def parse_peft(spec: str) -> dict[str, Any]:
    """The ``LoraConfig`` keyword arguments ``spec`` names.

    ``lora:KEY=VALUE,...``; a value of ``targets`` runs on over the commas that
    follow until the next ``KEY=`` (``targets=q_proj,v_proj``).
    """
    kind, sep, rest = spec.partition(":")
    if kind != "lora":
        usage_error(f"--peft supports lora (lora:r=8,targets=q_proj,v_proj), got {spec!r}")
    out: dict[str, Any] = {}
    key = None
    for token in (t.strip() for t in rest.split(",") if sep and t.strip()):
        name, eq, value = token.partition("=")
        if not eq:
            if key != "targets":
                usage_error(f"--peft {spec!r}: {token!r} is not KEY=VALUE "
                            f"(keys: {', '.join(LORA_KEYS)})")
            out["target_modules"].append(token)
            continue
        if name not in LORA_KEYS:
            usage_error(f"--peft {spec!r}: unknown key {name!r} (keys: {', '.join(LORA_KEYS)})")
        key = name
        arg, kind_of = LORA_KEYS[name]
        try:
            out[arg] = [value] if name == "targets" else kind_of(value)
        except ValueError:
            usage_error(f"--peft {spec!r}: {name}={value!r} is not {kind_of.__name__}")
    if "r" in out and out["r"] < 1:
        usage_error(f"--peft {spec!r}: r must be at least 1, got {out['r']}")
    return out


def apply_peft(model: nn.Module, lora_kwargs: dict[str, Any]) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(**lora_kwargs))``: a frozen base,
    trainable adapters (what the plan then counts)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("--peft needs peft: pip install 'fsdp_wrap[finetune]'") from None
    return get_peft_model(model, LoraConfig(**lora_kwargs))
