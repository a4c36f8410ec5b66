"""What the TRL scripts share (``trl_sft_run.py``, ``trl_rl_run.py``).

Nothing is downloaded: the tokenizer is a word-level one built in code, the
model a tiny LLaMA built from its config and written once (rank 0) to a
directory that every trainer loads it from (TRL builds its reference model
from the policy's path); QLoRA loads the same directory in NF4 with bf16
quant storage through transformers' ``BitsAndBytesConfig``.  Each run trains
3 steps with a checkpoint at step 2; the checks record what the pytest side
asserts (``tests/test_trl.py``).
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch
import torch.distributed as dist
from _common import RANK, accelerate_on_cpu, record

WORDS = "the a cat dog sat on mat ran to park good bad yes no is it big small red".split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
STEPS = 3
SAVE_EVERY = 2
PROBE = [[1, 4, 6, 8, 9, 4, 10, 2]]  # "<s> the cat sat on the mat </s>"


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = None
    return tok


def base_dir(out: str) -> str:
    """The tiny LLaMA (seed 0), written by rank 0 once; every rank loads it from here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not dist.is_initialized():
        accelerate_on_cpu()  # (Accelerate's state starts the gloo group)
    path = os.path.join(out, "base")
    if RANK == 0 and not os.path.isdir(path):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(cfg)
        model.generation_config.pad_token_id = 0
        model.save_pretrained(path)
        tokenizer().save_pretrained(path)
    dist.barrier()
    return path


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


def lora(kind: str) -> Any:
    from peft import LoraConfig

    if kind == "full":
        return None
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM")


def build(trainer_cls: Any, config_cls: Any, config: dict[str, Any], **kw: Any) -> Any:
    """``trainer_cls(args=config_cls(**config), **kw)``, Accelerate's state set
    for CPU FSDP in between (after the arguments, which reset it)."""
    cfg = config_cls(**config)
    accelerate_on_cpu()
    return trainer_cls(args=cfg, **kw)


def args(out: str, sdt: str, uop: bool, save: bool = True, **extra: Any) -> dict[str, Any]:
    """Trainer arguments: FSDP1 through Accelerate's plugin, on 2 CPU ranks
    (TRL's default ``bf16=True``: FSDP's MixedPrecision in bf16 and CPU autocast)."""
    return dict(output_dir=out, per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1,
                save_steps=SAVE_EVERY, save_strategy="steps" if save else "no", report_to=[],
                use_cpu=True,
                ddp_backend="gloo", seed=0, data_seed=0, dataloader_num_workers=0,
                disable_tqdm=True, save_only_model=False,
                fsdp="full_shard auto_wrap",
                fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                             "state_dict_type": sdt, "use_orig_params": uop,
                             "sync_module_states": False, "cpu_ram_efficient_loading": False},
                **extra)


def sentences(n: int, lo: int, hi: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def losses(tr: Any) -> list[float]:
    return [h["loss"] for h in tr.state.log_history if "loss" in h]


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local pieces of the trainable parameters (flat shards, or
    the original parameters' 1-D pieces with ``use_orig_params=True``)."""
    return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[int]:
    """``[pieces that changed, non-empty pieces]`` of this rank."""
    if set(before) != set(after):
        raise AssertionError(f"{sorted(set(before) - set(after))[:3]} vs {sorted(set(after) - set(before))[:3]}")
    nonempty = [n for n, t in before.items() if t.numel()]
    return [sum(not torch.equal(before[n], after[n]) for n in nonempty), len(nonempty)]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a)[:4], sorted(b)[:4])
    return max([(a[n].float() - b[n].float()).abs().max().item() for n in a if a[n].numel()]
               or [0.0])


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the wrapped model, full, under its clean name (every rank)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def logits(model: torch.nn.Module, bf16: bool = False) -> torch.Tensor:
    """The probe's logits in eval mode; ``bf16``: under CPU bf16 autocast, as
    Accelerate runs a prepared model's forward with TRL's default ``bf16=True``."""
    was = model.training
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(input_ids=torch.tensor(PROBE)).logits.float().clone()
    model.train(was)
    return out


class Snapshot:
    """A ``TrainerCallback`` keeping this rank's trainable pieces when training
    begins (after wrapping, before the first step)."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class _Snap(TrainerCallback):
            first: dict[str, torch.Tensor] | None = None

            def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                               **kw: Any) -> None:
                self.first = trainable(model)

        return _Snap()


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


def check_saved(key: str, kind: str, base: str, saved: str, model: torch.nn.Module,
                bf16: bool) -> None:
    """What ``save_model`` wrote, reloaded in one plain process (rank 0): its
    tensors hold the trained values, and the reloaded model's logits equal a
    plain model holding the wrapped model's gathered parameters, and the
    wrapped model's own when computed the same way (``bf16``: the trainer's
    CPU autocast)."""
    state = gathered(model)
    wrapped_logits = logits(model)
    if RANK != 0:
        return
    from safetensors.torch import load_file

    if kind == "full":
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
        plain = load(base, kind)
        plain.load_state_dict(state, strict=True)
    else:
        from peft import PeftModel, get_peft_model

        adapter = load_file(os.path.join(saved, "adapter_model.safetensors"))
        record(key + "/adapter_tensors", len(adapter))
        record(key + "/adapter_bytes", os.path.getsize(os.path.join(saved, "adapter_model.safetensors")))
        trained = {k: v for k, v in state.items() if "lora_" in k}
        record(key + "/adapter_vs_trained",
               max((adapter[k.replace(".default", "")].float() - v.float()).abs().max().item()
                   for k, v in trained.items()))
        reloaded = PeftModel.from_pretrained(load(base, kind), saved)
        plain = get_peft_model(load(base, kind), lora(kind))
        _, unexpected = plain.load_state_dict(trained, strict=False)
        assert not unexpected, unexpected
    a, b = logits(reloaded), logits(plain)
    record(key + "/reloaded_vs_plain", (a - b).abs().max().item())
    same = logits(as_wrapped_computes(reloaded, model), bf16=bf16)
    record(key + "/reloaded_vs_wrapped", (same - wrapped_logits).abs().max().item())


def check_load_adapter(key: str, saved: str, model: torch.nn.Module) -> None:
    """``load_adapter`` into the wrapped, trained model (every rank): after the
    adapters are zeroed, it brings back every rank's shards exactly."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    want = trainable(model)
    with FSDP.summon_full_params(model, writeback=True):
        for p in model.parameters():
            if p.requires_grad:
                p.data.zero_()
    zeroed = changed(want, trainable(model))
    model.load_adapter(saved, adapter_name="default", is_trainable=True)
    record(key + "/load_adapter", [zeroed, max_diff(want, trainable(model))])
