"""The LLaMA + PEFT LoRA / QLoRA models of the fine-tuning benchmark and tests,
built from configs (nothing downloaded); one builder for both.

Used by ``benchmarks/bench_lora.py`` (``from _lora_models import ...``, the
benchmarks folder on ``sys.path``), ``benchmarks/_hf_models.py`` and the tests
(``from benchmarks._lora_models import ...``, the repository root on
``sys.path``).  Needs ``transformers`` and ``peft``; the quantized models need
``bitsandbytes >= 0.50`` (NF4 ``Linear4bit`` runs on CPU from that release).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

# name -> LlamaConfig keywords.  "tiny": the tests' 2-layer model; "300m": the
# LLaMA shape of benchmarks/bench_pretrained.py (hidden 1024, ffn 2816, 20
# layers, 16 heads, 8 key/value heads, vocab 32000, untied head): 302M parameters.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64),
    "300m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                 tie_word_embeddings=False),
}


def quantize_nf4(model: nn.Module) -> nn.Module:
    """Every decoder-layer Linear of a LLaMA as a bitsandbytes NF4 ``Linear4bit``
    with bf16 quantization storage (what ``load_in_4bit`` with
    ``bnb_4bit_quant_storage=torch.bfloat16`` builds, the QLoRA recipe for FSDP).
    Embeddings, norms and the head stay as they are."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4",
                                      quant_storage=torch.bfloat16)
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                             quant_storage=torch.bfloat16, module=q)
                if lin.bias is not None:
                    q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
                setattr(parent, name, q.to("cpu"))  # quantizes: NF4 packed into bf16 storage
    return model


def lora_llama(size: str = "tiny", quantized: bool = False, bf16_adapters: bool = True,
               r: int = 8) -> nn.Module:
    """A LLaMA of :data:`SIZES` ``size`` (seed 0: the same weights on every rank)
    with PEFT LoRA (``r``, alpha 2r, on ``q_proj`` and ``v_proj``, Gaussian
    init so that A and B both get gradients from the first step).

    ``quantized``: the base in bf16 with its decoder layers' Linears NF4
    (:func:`quantize_nf4`); with ``bf16_adapters`` the adapters are cast to
    bf16 too (one dtype per unit's trainable part, what torch's FSDP1 needs),
    otherwise they stay PEFT's fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES[size]))
    if quantized:
        model = quantize_nf4(model.to(torch.bfloat16))
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                      lora_dropout=0.0, init_lora_weights="gaussian")
    model = get_peft_model(model, lora)
    if quantized and bf16_adapters:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def decoder_layer_class() -> type[nn.Module]:
    """The class that makes one FSDP unit per decoder layer."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def trainable_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that train (each once), before wrapping."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind every gradient the rank holds: the
    original parameters' and every flat parameter's (fsdp_wrap's ``_handles``,
    torch's FSDP1 ``_handle``), views of one flat gradient counted once."""
    tensors: list[Any] = [p.grad for p in model.parameters()]
    for m in model.modules():
        # (fsdp_wrap's handles are a property of the unit; torch's FSDP1 sets _handle)
        fsdp_wrap_handles = getattr(type(m), "_handles", None)
        if fsdp_wrap_handles is not None:
            tensors += [h.flat_param.grad for h in m._handles]
        handle = m.__dict__.get("_handle")
        tensors.append(getattr(getattr(handle, "flat_param", None), "grad", None))
        tensors += [p.grad for p in m._parameters.values() if p is not None]
    return _storage_bytes(tensors)


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the optimizer's state tensors."""
    return _storage_bytes(t for state in opt.state.values() for t in state.values())
