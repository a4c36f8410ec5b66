"""Tutorial 5: LoRA fine-tuning with PEFT on 2 ranks, the adapter saved and reloaded.

Run it as it is (it starts 2 CPU ranks itself, gloo on 127.0.0.1; needs
``peft`` and ``transformers``, ``pip install -e ".[finetune]"``)::

    python tutorials/05_lora_finetune.py

What it shows (docs/fine_tuning.rst, "LoRA with PEFT" and "Adapter
checkpoints"):

1. A small Hugging Face model (a tiny LLaMA built from a config, so nothing
   is downloaded) gets PEFT LoRA adapters on ``q_proj`` and ``v_proj`` and is
   wrapped with one FSDP unit per decoder layer.  Each unit splits into a
   trainable flat parameter (the adapters) and a frozen one (the base), so
   gradients and optimizer state exist for the adapters only.
2. A few steps teach the adapters a toy task (each sequence counts upwards).
3. ``save_full_checkpoint(model, path, trainable_only=True)`` writes only the
   adapters, in PEFT's own layout (``adapter_model.safetensors`` +
   ``adapter_config.json``): each rank sends its shard of the adapters to rank
   0; the frozen base never moves.
4. After the job, one plain process (no FSDP, no process group) builds the
   base model again, loads the adapter with ``PeftModel.from_pretrained`` and
   must compute the FSDP model's evaluation loss exactly.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fsdp_wrap as fsdp
from fsdp_wrap.checkpoint import save_full_checkpoint
from fsdp_wrap.wrap import ModuleWrapPolicy

FSDP = fsdp.FullyShardedDataParallel
VOCAB = 64
STEPS = 12


def base_model() -> LlamaForCausalLM:
    """Stand-in for a pretrained model: the same weights in every process (seed 0)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def counting(seed: int, batch: int = 8, length: int = 16) -> torch.Tensor:
    """Sequences that count upwards from a random start (mod VOCAB): the task to learn."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(length)) % VOCAB


EVAL = counting(seed=1000)


def train(rank: int, out: str) -> None:
    # 1. LoRA on the attention projections, then FSDP: one unit per decoder layer.
    model = get_peft_model(base_model(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                    target_modules=["q_proj", "v_proj"]))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                 device_id=torch.device("cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=2e-2)

    # 2. Train: each rank its own batches, gradients averaged across ranks.
    for step in range(STEPS):
        x = counting(seed=100 * step + rank)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0 and step % 4 == 3:
            print(f"step {step + 1:2d}  loss {loss.item():.4f}", flush=True)

    # 3. Save the adapter only (a collective: every rank calls it).
    path = os.path.join(out, "adapter")
    save_full_checkpoint(model, path, trainable_only=True)

    model.eval()
    with torch.no_grad():
        eval_loss = model(input_ids=EVAL, labels=EVAL).loss.item()
    if rank == 0:
        size = os.path.getsize(os.path.join(path, "adapter_model.safetensors"))
        frozen = sum(p.numel() for p in base_model().parameters()) * 4
        print(f"adapter saved to {path}: {sorted(os.listdir(path))}", flush=True)
        print(f"adapter_model.safetensors {size / 2**10:.1f} KiB; the frozen base would be "
              f"{frozen / 2**10:.0f} KiB", flush=True)
        with open(os.path.join(out, "fsdp_eval.json"), "w") as f:
            json.dump({"eval_loss": eval_loss}, f)


def worker(rank: int, world_size: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        torch.set_num_threads(1)
        train(rank, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def reload_and_check(out: str) -> None:
    """4. One plain process: the base model again, PEFT loads the adapter."""
    base = base_model()
    with torch.no_grad():
        before = base(input_ids=EVAL, labels=EVAL).loss.item()
    model = PeftModel.from_pretrained(base, os.path.join(out, "adapter")).eval()
    with torch.no_grad():
        after = model(input_ids=EVAL, labels=EVAL).loss.item()
    with open(os.path.join(out, "fsdp_eval.json")) as f:
        want = json.load(f)["eval_loss"]
    print(f"evaluation loss: base {before:.4f}, base + reloaded adapter {after:.4f}, "
          f"FSDP model {want:.4f}", flush=True)
    if after != want:
        raise SystemExit("the reloaded adapter does not compute the FSDP model's loss")
    if not after < before:
        raise SystemExit("the adapter did not learn the task")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, free_port(), tmp), nprocs=2)
        reload_and_check(tmp)
    print("LoRA fine-tune, adapter saved and reloaded with PEFT: OK", flush=True)
