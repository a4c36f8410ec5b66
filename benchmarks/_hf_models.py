"""Small Hugging Face models for the plan's accuracy benchmark, built from configs
(nothing downloaded), each with the block class that makes its units and one
short input.

* ``llama``: LLaMA with an untied output head (``tie_word_embeddings=False``);
* ``bert``: BERT for masked LM, whose decoder is tied to the word embeddings;
* ``t5``: T5 encoder-decoder, whose encoder and decoder share one embedding
  (tied to the LM head too);
* ``llama-lora``: the LLaMA with PEFT LoRA (r=8 on q_proj, v_proj): a frozen
  base beside trainable adapters in every unit;
* ``llama-qlora``: the same (twice as wide) with the decoder layers' Linears as bitsandbytes
  NF4 ``Linear4bit`` (bf16 quantization storage, bf16 adapters), on CPU
  (bitsandbytes >= 0.50).

Sizes are chosen so that every unit holds more than 1 MiB (the CPU heap
measurement is dominated by Python's own objects below that) and a row trains
in seconds on a shared 2-core machine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from _lora_models import quantize_nf4 as _quantize

VOCAB = 2048
HF_MODELS = ("llama", "bert", "t5", "llama-lora", "llama-qlora")


def _llama(hidden: int = 256) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 43 // 16,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights="gaussian")
    return get_peft_model(model, lora)


def hf_model(name: str) -> tuple[nn.Module, set[type[nn.Module]], dict[str, torch.Tensor]]:
    """``(model, block classes, forward kwargs)`` for one of :data:`HF_MODELS`."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 2))
    if name.startswith("llama"):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        # 4-bit weights take an eighth of fp32's bytes: twice the width keeps
        # the QLoRA layers over 1 MiB each.
        model = _llama(512 if name == "llama-qlora" else 256)
        if name == "llama-qlora":
            model = _quantize(model.to(torch.bfloat16))
        if name != "llama":
            model = _lora(model)
        if name == "llama-qlora":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
        return model, {LlamaDecoderLayer}, {"input_ids": ids}
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM
        from transformers.models.bert.modeling_bert import BertLayer

        cfg = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
                         num_attention_heads=4, intermediate_size=1024,
                         max_position_embeddings=64)
        return BertForMaskedLM(cfg), {BertLayer}, {"input_ids": ids}
    if name == "t5":
        from transformers import T5Config, T5ForConditionalGeneration
        from transformers.models.t5.modeling_t5 import T5Block

        cfg = T5Config(vocab_size=VOCAB, d_model=256, d_kv=64, d_ff=1024, num_layers=2,
                       num_decoder_layers=2, num_heads=4, tie_word_embeddings=True)
        return (T5ForConditionalGeneration(cfg), {T5Block},
                {"input_ids": ids, "decoder_input_ids": ids})
    raise ValueError(f"unknown model {name!r} (one of {HF_MODELS})")


def output_tensor(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out
