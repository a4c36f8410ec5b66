"""The transformers ``Trainer`` with ``fsdp=...``, ``fsdp_config={"version": 1}``.

Each run trains a tiny GPT-2 for 4 steps, checkpointing every 2; a second
``Trainer`` resumes from step 2 and must log the same losses for steps 3-4
(on fsdp_wrap; torch's FSDP1 resumes a SHARDED checkpoint without Adam's
moments, see fsdp_wrap/frameworks/accelerate.py).
With ``FULL_STATE_DICT`` the final ``save_model`` output is loaded by
``from_pretrained`` into a plain GPT-2 and compared with the trained model.
torch's FSDP1 runs the sharded configuration (its FULL save crashes on CPU).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _common import (
    OUT,
    accelerate_on_cpu,
    full_params_match,
    record,
    tiny_gpt2,
    tokens,
)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = tokens(i, batch=1)[0]
        return {"input_ids": x, "labels": x}


def trainer(out: str, sdt: str, uop: bool, steps: int = 4) -> object:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=steps, logging_steps=1,
        save_steps=2, save_strategy="steps", learning_rate=1e-3, report_to=[], use_cpu=True,
        ddp_backend="gloo", seed=0, data_seed=0, dataloader_num_workers=0,
        fsdp="full_shard auto_wrap",
        fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                     "state_dict_type": sdt, "use_orig_params": uop,
                     "sync_module_states": False, "cpu_ram_efficient_loading": False})
    accelerate_on_cpu()
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())


def losses(tr: object) -> list[float]:
    return [h["loss"] for h in tr.state.log_history if "loss" in h]  # type: ignore[attr-defined]


def run(impl: str, sdt: str, uop: bool) -> None:
    key = f"{impl}/{sdt}/{uop}"
    out = os.path.join(OUT, f"trainer_{impl}_{sdt}_{uop}")
    tr = trainer(out, sdt, uop)
    tr.train()
    record(key + "/class", type(tr.model_wrapped).__module__)
    record(key + "/losses", losses(tr))
    if sdt == "FULL_STATE_DICT":
        final = os.path.join(out, "final")
        tr.save_model(final)
        dist.barrier()
        from transformers import GPT2LMHeadModel

        plain = GPT2LMHeadModel.from_pretrained(final)
        record(key + "/plain_vs_trained",
               full_params_match(tr.model_wrapped, plain.state_dict()))
        x = tokens(99)
        with torch.no_grad():
            record(key + "/plain_loss", plain(input_ids=x, labels=x).loss.item())
    tr2 = trainer(out, sdt, uop)
    tr2.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    record(key + "/resumed", losses(tr2))
    dist.barrier()


def torch_part() -> None:
    run("torch", "SHARDED_STATE_DICT", True)


def ours_part() -> None:
    run("ours", "SHARDED_STATE_DICT", True)
    run("ours", "SHARDED_STATE_DICT", False)
    run("ours", "FULL_STATE_DICT", False)
