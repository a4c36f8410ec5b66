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
from typing import Any

import torch
import torch.distributed as dist
from _common import RANK, record

from benchmarks._trl_models import (
    accelerate_on_cpu,
    adapter_file,
    as_wrapped_computes,
    load,
    lora,
    tokenizer,
    write_base,
)
from benchmarks._trl_models import logits as probe_logits
from benchmarks._trl_models import sentences as sentences

__all__ = ["load", "lora", "sentences", "tokenizer"]

STEPS = 3
SAVE_EVERY = 2
PROBE = [[1, 4, 6, 8, 9, 4, 10, 2]]  # "<s> the cat sat on the mat </s>"


def base_dir(out: str) -> str:
    """The tiny LLaMA (seed 0), written by rank 0 once; every rank loads it from here."""
    if not dist.is_initialized():
        accelerate_on_cpu()  # (Accelerate's state starts the gloo group)
    path = os.path.join(out, "base")
    if RANK == 0 and not os.path.isdir(path):
        write_base(path, "tiny")
    dist.barrier()
    return path


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
    return probe_logits(model, PROBE, bf16)


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

        adapter = load_file(adapter_file(saved))
        record(key + "/adapter_tensors", len(adapter))
        record(key + "/adapter_bytes", os.path.getsize(adapter_file(saved)))
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
