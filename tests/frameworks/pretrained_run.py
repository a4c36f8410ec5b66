"""``load_pretrained`` inside Accelerate and the transformers ``Trainer``, under ``fsdp_wrap.install()``.

A tiny GPT-2 (head tied to the embedding) saved with ``save_pretrained`` in
bf16.  Each framework trains 3 steps twice: from a model built on the meta
device and filled by ``load_pretrained``, and from ``from_pretrained(path,
dtype=float32)`` as usual; the losses must be the same, bit for bit.

* Accelerate: the plugin's ``param_init_fn`` is ``pretrained_init(model,
  path)``; ``accelerator.prepare`` wraps the meta model (fsdp_wrap's class,
  through the installed names) and ``load_pretrained`` fills it after.
* Trainer: the model is wrapped and loaded before the ``Trainer`` is built;
  Accelerate's ``prepare`` sees an FSDP module and leaves it as it is.
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


def save(path: str) -> None:
    from _common import tiny_gpt2

    if RANK == 0:
        tiny_gpt2(torch.bfloat16).save_pretrained(path)
    dist.barrier()


def meta_gpt2(path: str) -> torch.nn.Module:
    from transformers import AutoConfig, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel._from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)


def train_accelerate(path: str, meta: bool) -> list[float]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from transformers import GPT2LMHeadModel

    import fsdp_wrap

    accelerate_on_cpu()
    model = meta_gpt2(path) if meta else GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPT2Block"], use_orig_params=True,
        sync_module_states=False, cpu_ram_efficient_loading=False,
        param_init_fn=fsdp_wrap.pretrained_init(model, path) if meta else None)
    acc = Accelerator(fsdp_plugin=plugin)
    model = acc.prepare(model)
    if meta:
        record("accelerate/class", type(model).__module__)
        record("accelerate/load", list(fsdp_wrap.load_pretrained(model, path)))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for step in range(3):
        x = tokens(step)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = tokens(i, batch=1)[0]
        return {"input_ids": x, "labels": x}


def train_trainer(path: str, meta: bool) -> list[float]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # fsdp_wrap's, installed
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    args = TrainingArguments(
        output_dir=os.path.join(OUT, f"trainer_{meta}"), per_device_train_batch_size=2,
        max_steps=3, logging_steps=1, save_strategy="no", learning_rate=1e-3, report_to=[],
        use_cpu=True, ddp_backend="gloo", seed=0, data_seed=0, dataloader_num_workers=0,
        # the Trainer drops the batch's columns that model.forward does not name, and
        # FSDP's forward takes (*args, **kwargs): keep them (both runs alike)
        remove_unused_columns=False,
        fsdp="full_shard auto_wrap",
        fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                     "use_orig_params": True, "sync_module_states": False,
                     "cpu_ram_efficient_loading": False})
    accelerate_on_cpu()
    if meta:
        model = meta_gpt2(path)
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                     device_id=torch.device("cpu"), use_orig_params=True,
                     param_init_fn=fsdp_wrap.pretrained_init(model, path))
        record("trainer/load", list(fsdp_wrap.load_pretrained(model, path)))
    else:
        model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32)
    tr = Trainer(model=model, args=args, train_dataset=Tokens())
    tr.train()
    if meta:
        record("trainer/class", type(tr.model_wrapped).__module__)
        record("trainer/same_object", tr.model_wrapped is model)
    return [h["loss"] for h in tr.state.log_history if "loss" in h]


def ours_part() -> None:
    accelerate_on_cpu()
    path = os.path.join(OUT, "gpt2-bf16")
    save(path)
    for name, fn in (("accelerate", train_accelerate), ("trainer", train_trainer)):
        record(f"{name}/meta", fn(path, meta=True))
        record(f"{name}/from_pretrained", fn(path, meta=False))
        dist.barrier()
