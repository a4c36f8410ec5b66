#!/usr/bin/env python
"""Gradient bytes a rank holds after backward, PEFT LoRA / QLoRA on a tiny LLaMA
(CPU, 2 gloo ranks, FULL_SHARD, one unit per decoder layer).

    python benchmarks/lora_grad_bytes.py            # LoRA (fp32) and QLoRA rows, both implementations
    python benchmarks/lora_grad_bytes.py --json     # one JSON object per row

For each row: the bytes of the distinct storages behind every gradient the
rank holds after one forward and backward (flat and original parameters),
divided by the rank's share of the trainable parameters (trainable elements
x their itemsize / world size).  1.0 is the ideal; padding of the trainable
flat parameters adds a little.  torch's FSDP1 runs these models only with
``use_orig_params=True`` (one flat parameter per unit, frozen weights
included); fsdp_wrap splits each unit into trainable and frozen flat
parameters.  Needs ``peft`` and, for the QLoRA rows, ``bitsandbytes >= 0.50``
(NF4 ``Linear4bit`` runs on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = [
    # (name, implementation, use_orig_params); "qlora-fp32": PEFT's default
    # fp32 adapters beside the bf16-stored NF4 base (torch refuses the dtypes)
    ("lora", "torch", True),
    ("lora", "fsdp_wrap", True),
    ("lora", "fsdp_wrap", False),
    ("qlora", "torch", True),
    ("qlora", "fsdp_wrap", True),
    ("qlora", "fsdp_wrap", False),
    ("qlora-fp32", "torch", True),
    ("qlora-fp32", "fsdp_wrap", False),
]


def tiny_llama(quantized: bool, cast_adapters: bool = True) -> torch.nn.Module:
    """A 2-layer LLaMA (hidden 64) with PEFT LoRA r=8 on q_proj and v_proj; with
    ``quantized`` its linear layers are bitsandbytes NF4 (quant storage bf16,
    LoRA weights bf16, the QLoRA recipe for FSDP)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    if quantized:
        model = _quantize(model.to(torch.bfloat16))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(model, lora)
    if quantized and cast_adapters:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def _quantize(model: torch.nn.Module) -> torch.nn.Module:
    """Every decoder-layer Linear as an NF4 ``Linear4bit`` with bf16 quant storage."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4",
                                      quant_storage=torch.bfloat16)
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                             quant_storage=torch.bfloat16, module=q)
                if lin.bias is not None:
                    q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
                setattr(parent, name, q.to("cpu"))  # (quantizes: NF4 packed into bf16 storage)
    return model


def grad_bytes(model: torch.nn.Module) -> int:
    storages: dict[int, int] = {}
    tensors = [p.grad for p in model.parameters()]
    for m in model.modules():
        for h in getattr(m, "__dict__", {}).get("_handles", []) or []:
            tensors.append(h.flat_param.grad)
        handle = m.__dict__.get("_handle")  # torch's FSDP1: its one flat parameter
        tensors.append(getattr(getattr(handle, "flat_param", None), "grad", None))
        for p in m._parameters.values():
            if p is not None:
                tensors.append(p.grad)
    for g in tensors:
        if g is not None:
            storages[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    return sum(storages.values())


def _row(rank: int, ws: int, port: int, row: tuple[str, str, bool], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    warnings.simplefilter("ignore")
    name, impl, uop = row
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as F
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from fsdp_wrap import FullyShardedDataParallel as F
        from fsdp_wrap.wrap import ModuleWrapPolicy
    model = tiny_llama(name.startswith("qlora"), cast_adapters=name == "qlora")
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    fsdp = F(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=uop,
             device_id=torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = fsdp(input_ids=ids, labels=ids).loss
    loss.backward()
    held = grad_bytes(fsdp)
    share = trainable / ws
    if rank == 0:
        out.put(dict(model=name, impl=impl, use_orig_params=uop, grad_bytes=held,
                     trainable_share_bytes=share, ratio=round(held / share, 2),
                     loss=round(float(loss), 4)))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="", help="lora or qlora")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = []
    for row in ROWS:
        if args.only and row[0] not in args.only.split(","):
            continue
        q = ctx.SimpleQueue()
        try:
            mp.start_processes(_row, args=(2, _free_port(), row, q), nprocs=2, start_method="spawn")
            results.append(q.get())
        except Exception as e:  # noqa: BLE001
            results.append(dict(model=row[0], impl=row[1], use_orig_params=row[2],
                                error=str(e).strip().splitlines()[-1][:200]))
    for r in results:
        print(json.dumps(r) if args.json else
              "  ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
