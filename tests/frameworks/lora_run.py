"""PEFT LoRA through Accelerate's FSDP plugin and the ``Trainer``, unchanged (issue 20 item 3).

A tiny LLaMA with LoRA on ``q_proj``/``v_proj`` trains 3 steps, first on
torch's FSDP1 (``use_orig_params=True``, the only way torch runs LoRA), then
on fsdp_wrap through ``fsdp_wrap.install()`` with both ``use_orig_params``.
On fsdp_wrap the adapter is then saved the framework's own way (Accelerate:
``get_state_dict`` + PEFT's ``save_pretrained``; the Trainer: ``save_model``,
which does the same; PEFT's side patched by ``install()``,
fsdp_wrap/frameworks/peft.py) and with
``save_full_checkpoint(trainable_only=True)``; rank 0 compares both
``adapter_model.safetensors`` with PEFT's own state dict of the trained
weights and loads the streamed one into a plain base with
``PeftModel.from_pretrained``, whose loss must be the FSDP model's.  torch's FSDP1 only trains here: its FULL save with
``offload_to_cpu`` (what both frameworks ask for) crashes on CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _common import (
    OUT,
    RANK,
    accelerate_on_cpu,
    record,
    tokens,
)


def base_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def tiny_lora() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                   lora_dropout=0.0))


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = tokens(i, batch=1)[0]
        return {"input_ids": x, "labels": x}


def peft_keys_of_wrapped(model: torch.nn.Module, unwrapped: torch.nn.Module) -> int:
    """How many tensors PEFT's ``get_peft_model_state_dict`` finds in the wrapped model's
    FULL state dict (no CPU offload, which torch's FSDP1 cannot do on CPU): what the
    frameworks' adapter saves write.  Rank 0's count; -1 elsewhere."""
    import torch.distributed.fsdp as fsdp  # (fsdp_wrap's names after install())
    from peft import get_peft_model_state_dict

    cfg = fsdp.FullStateDictConfig(rank0_only=True)
    with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    return len(get_peft_model_state_dict(unwrapped, state_dict=state)) if RANK == 0 else -1


def compare_adapters(key: str, state: dict[str, torch.Tensor], framework_dir: str,
                     streamed_dir: str, fsdp_loss: float) -> None:
    """Rank 0: the streamed adapter against PEFT's own state dict of a plain model holding
    the FULL state dict, the framework's file, and PEFT reloading the streamed one."""
    if RANK != 0:
        return
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    plain = tiny_lora()
    plain.load_state_dict(state, strict=True)
    want = get_peft_model_state_dict(plain)
    got = load_file(os.path.join(streamed_dir, "adapter_model.safetensors"))
    record(key + "/adapter_keys", [sorted(want), sorted(got)])
    record(key + "/adapter_differ", [k for k in want if k not in got or not torch.equal(want[k], got[k])])
    framework = load_file(os.path.join(framework_dir, "adapter_model.safetensors"))
    record(key + "/framework_file_keys", len(framework))
    record(key + "/framework_differ",
           [k for k in want if k not in framework or not torch.equal(want[k], framework[k])])
    reloaded = PeftModel.from_pretrained(base_llama(), streamed_dir).eval()
    x = tokens(99)
    with torch.no_grad():
        record(key + "/reloaded_loss", [reloaded(input_ids=x, labels=x).loss.item(), fsdp_loss])


def eval_loss(model: torch.nn.Module) -> float:
    x = tokens(99)
    model.eval()
    with torch.no_grad():
        loss = float(model(input_ids=x, labels=x).loss.item())
    model.train()
    return loss


def accelerate_run(impl: str, uop: bool) -> None:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    accelerate_on_cpu()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="FULL_STATE_DICT",
        use_orig_params=uop, sync_module_states=False, cpu_ram_efficient_loading=False)
    acc = Accelerator(fsdp_plugin=plugin)
    model = acc.prepare(tiny_lora())
    opt = acc.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    key = f"accelerate/{impl}/{uop}"
    record(key + "/class", type(model).__module__)
    losses = []
    for i in range(3):
        x = tokens(i)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
    record(key + "/losses", losses)
    record(key + "/peft_keys_of_wrapped", peft_keys_of_wrapped(model, acc.unwrap_model(model)))
    if impl == "torch":
        return
    from fsdp_wrap.checkpoint import save_full_checkpoint

    framework_dir = os.path.join(OUT, f"acc_{uop}_peft")
    state = acc.get_state_dict(model)  # FULL, on rank 0
    if acc.is_main_process:
        acc.unwrap_model(model).save_pretrained(framework_dir, state_dict=state)
    streamed_dir = os.path.join(OUT, f"acc_{uop}_streamed")
    save_full_checkpoint(model, streamed_dir, trainable_only=True)
    dist.barrier()
    compare_adapters(key, state, framework_dir, streamed_dir, eval_loss(model))
    dist.barrier()


def trainer_run(impl: str, uop: bool) -> None:
    from transformers import Trainer, TrainingArguments

    out = os.path.join(OUT, f"trainer_{impl}_{uop}")
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=3, logging_steps=1,
        save_strategy="no", learning_rate=1e-2, report_to=[], use_cpu=True, ddp_backend="gloo",
        seed=0, data_seed=0, dataloader_num_workers=0, fsdp="full_shard auto_wrap",
        fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": "FULL_STATE_DICT", "use_orig_params": uop,
                     "sync_module_states": False, "cpu_ram_efficient_loading": False})
    accelerate_on_cpu()
    tr = Trainer(model=tiny_lora(), args=args, train_dataset=Tokens())
    tr.train()
    key = f"trainer/{impl}/{uop}"
    record(key + "/class", type(tr.model_wrapped).__module__)
    record(key + "/losses", [h["loss"] for h in tr.state.log_history if "loss" in h])
    record(key + "/peft_keys_of_wrapped", peft_keys_of_wrapped(tr.model_wrapped, tr.model))
    if impl == "torch":
        return
    from fsdp_wrap.checkpoint import save_full_checkpoint

    framework_dir = os.path.join(out, "final")
    tr.save_model(framework_dir)  # PEFT's save_pretrained of the gathered FULL state dict
    state = tr.accelerator.get_state_dict(tr.model_wrapped)
    streamed_dir = os.path.join(out, "streamed")
    save_full_checkpoint(tr.model_wrapped, streamed_dir, trainable_only=True)
    dist.barrier()
    compare_adapters(key, state, framework_dir, streamed_dir, eval_loss(tr.model_wrapped))
    dist.barrier()


def torch_part() -> None:
    accelerate_run("torch", True)
    trainer_run("torch", True)


def ours_part() -> None:
    for uop in (True, False):
        accelerate_run("ours", uop)
        trainer_run("ours", uop)
