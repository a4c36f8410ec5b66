"""Real PEFT LoRA and bitsandbytes QLoRA on a tiny Hugging Face LLaMA (issue 20).

Two CPU ranks, FULL_SHARD, one unit per decoder layer.  LoRA: fsdp_wrap with
either ``use_orig_params`` trains like torch's FSDP1 (``use_orig_params=True``,
the only way torch runs LoRA) step by step, and holds the gradients of its
trainable shard only, where torch holds the whole units'.  QLoRA (NF4
``Linear4bit`` on CPU, bitsandbytes >= 0.50): the quantization state survives
sharding and gathering, the losses equal torch's, and a ``param_dtype`` that
would cast the packed weights is refused.  Needs ``pip install .[finetune]``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from tests._dist import DistPool, progress

pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 3


def tiny_llama(quantized: bool = False, bf16_adapters: bool = True) -> nn.Module:
    """2 decoder layers, hidden 64, PEFT LoRA r=8 on q_proj/v_proj; ``quantized``:
    the layers' Linears as NF4 ``Linear4bit`` with bf16 quant storage."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    if quantized:
        model = _quantize(model.to(torch.bfloat16))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights="gaussian")
    model = get_peft_model(model, lora)
    if quantized and bf16_adapters:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def _quantize(model: nn.Module) -> nn.Module:
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if isinstance(lin, nn.Linear):
                    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                                          compute_dtype=torch.bfloat16, quant_type="nf4",
                                          quant_storage=torch.bfloat16)
                    q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False,
                                                 quant_type="nf4", quant_storage=torch.bfloat16,
                                                 module=q)
                    setattr(parent, name, q.to("cpu"))  # quantizes
    return model


def _wrap(impl: str, model: nn.Module, uop: bool, **kw: Any) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as F
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        F = fsdp_wrap.FullyShardedDataParallel  # noqa: N806
        from fsdp_wrap.wrap import ModuleWrapPolicy
    return F(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=uop,
             device_id=torch.device("cpu"), **kw)


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind every gradient the rank holds."""
    tensors = [p.grad for p in model.parameters()]
    for m in model.modules():
        tensors += [h.flat_param.grad for h in m.__dict__.get("_handles", [])]
        fp = m._parameters.get("_flat_param") if hasattr(m, "_parameters") else None
        tensors += [fp.grad] if fp is not None else []
        handle = m.__dict__.get("_handle")  # torch's FSDP1: its one flat parameter
        tensors += [getattr(getattr(handle, "flat_param", None), "grad", None)]
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for g in tensors if g is not None}
    return sum(storages.values())


def _train(impl: str, uop: bool, quantized: bool) -> tuple[list[float], float]:
    """Losses of STEPS AdamW steps (different data per rank) and the gradient
    bytes after the first backward over the rank's share of trainable bytes."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    base = tiny_llama(quantized)
    share = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    share /= dist.get_world_size()
    model = _wrap(impl, copy.deepcopy(base) if not quantized else base, uop)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, ratio = [], 0.0
    for step in range(STEPS):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            ratio = grad_bytes(model) / share
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(float(t))
    return losses, ratio


def _lora_rows() -> list[tuple[list[float], float]]:
    return [_train("torch", True, False), _train("ours", True, False), _train("ours", False, False)]


def test_lora_trains_like_torch_with_only_adapter_gradients(pool2: Any) -> None:
    for (ref, torch_ratio), *ours in pool2.run(_lora_rows):
        for losses, ratio in ours:
            # fp32, the same ops in the same order on the same data (the split only
            # changes which flat parameter a weight lives in): rtol 1e-5
            assert losses == pytest.approx(ref, rel=1e-5), (losses, ref)
            assert ratio <= 1.1, ratio  # the trainable shard, padding aside
        assert torch_ratio > 5, torch_ratio  # torch holds the frozen weights' gradients too


def _qlora_rows() -> list[Any]:
    out: list[Any] = []
    for impl, uop in (("torch", True), ("ours", True), ("ours", False)):
        out.append(_train(impl, uop, True))
        progress()
    try:
        _wrap("ours", tiny_llama(True), False,
              mixed_precision=fsdp_wrap.MixedPrecision(param_dtype=torch.float32))
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    import bitsandbytes as bnb

    int8 = nn.Sequential(bnb.nn.Linear8bitLt(16, 8, has_fp16_weights=False).to("cpu"))
    try:
        fsdp_wrap.FullyShardedDataParallel(int8, device_id=torch.device("cpu"))
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    return out


@pytest.mark.slow
def test_qlora_nf4_on_cpu() -> None:
    pytest.importorskip("bitsandbytes")
    # Importing bitsandbytes alone takes over a minute on a busy 2-core machine:
    # a pool of its own with a longer no-progress timeout.
    pool = DistPool(2, timeout=600)
    try:
        results = pool.run(_qlora_rows)
    finally:
        pool.close()
    for (ref, torch_ratio), *ours, refusal, int8 in results:
        for losses, ratio in ours:
            # bf16 compute, the same kernels on the same packed weights: equal
            assert losses == pytest.approx(ref, rel=2**-8), (losses, ref)
            assert ratio <= 1.1, ratio
        assert torch_ratio > 2, torch_ratio
        assert refusal is not None and "bnb_4bit_quant_storage=torch.float32" in refusal, refusal
        # 8-bit bases (int8 weights, scales on the Parameter object): refused, naming the fixes
        assert int8 is not None and "Cannot flatten integer dtype tensors" in int8, int8
        assert "load_in_4bit" in int8 and "ignored_states" in int8, int8
