"""What TRL runs on, built in code: a word-level tokenizer, LLaMA bases written
to a directory (TRL builds its reference model from the policy's path), QLoRA
loads through transformers' ``BitsAndBytesConfig``, and the ways past
Accelerate's GPU-only FSDP gate on CPU.

Shared by ``benchmarks/bench_trl.py`` and the TRL test scripts
(``tests/frameworks/_trl.py``).  Nothing is downloaded.  Importing this module
imports no framework; each function imports what it needs.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

WORDS = "the a cat dog sat on mat ran to park good bad yes no is it big small red".split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]

# name -> LlamaConfig keywords.  "tiny": the tests' 2-layer model; "300m": the
# LLaMA shape of bench_pretrained.py and bench_lora.py (302M parameters; its
# vocabulary is larger than the tokenizer's, the extra rows are never looked up).
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64),
    "300m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                 tie_word_embeddings=False),
}


def accelerate_on_cpu() -> None:
    """Accelerate enables FSDP only for GPU process groups: flip the shared
    state's distributed type before ``Accelerator`` reads it (and keep the
    device plain ``cpu``, which torch's FSDP1 wants as its ``device_id``)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    ps = PartialState(backend="gloo")
    ps.distributed_type = DistributedType.MULTI_GPU
    ps.device = torch.device("cpu")


def tokenizer() -> Any:
    """A word-level tokenizer over :data:`WORDS` (ids: pad 0, bos 1, eos 2, unk 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def write_base(path: str, size: str) -> None:
    """The LLaMA of :data:`CONFIGS` ``size`` (random init, seed 0) and the
    tokenizer, saved to ``path`` (call on one rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIGS[size], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)


def load(path: str, kind: str) -> torch.nn.Module:
    """The base model as a trainer gets it: fp32 (``full``, ``lora``) or NF4 with
    bf16 storage and compute (``qlora``, the QLoRA recipe for FSDP)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if kind != "qlora":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_compute_dtype=torch.bfloat16,
                           bnb_4bit_quant_storage=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16)


def lora(kind: str, r: int = 4) -> Any:
    """PEFT LoRA on ``q_proj`` and ``v_proj`` (``None`` for a full fine-tune)."""
    from peft import LoraConfig

    if kind == "full":
        return None
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                      lora_dropout=0.0, task_type="CAUSAL_LM")


def sentences(n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def as_wrapped_computes(model: torch.nn.Module, wrapped: torch.nn.Module) -> torch.nn.Module:
    """``model`` cast as the wrapped model computes: FSDP's ``MixedPrecision``
    (Accelerate's, from ``bf16=True``, or the QLoRA quant storage's) casts every
    floating parameter and buffer for the forward."""
    mp = getattr(wrapped, "mixed_precision", None)
    for dtype, tensors in ((getattr(mp, "param_dtype", None), model.parameters()),
                           (getattr(mp, "buffer_dtype", None), model.buffers())):
        for t in tensors:
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)
    return model


def logits(model: torch.nn.Module, ids: list[list[int]], bf16: bool = False) -> torch.Tensor:
    """``ids``' logits in eval mode; ``bf16``: under CPU bf16 autocast, as
    Accelerate runs a prepared model's forward with TRL's default ``bf16=True``."""
    was = model.training
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=torch.tensor(ids)).logits.float().clone()
    model.train(was)
    return out


def adapter_file(path: str) -> str:
    return os.path.join(path, "adapter_model.safetensors")
