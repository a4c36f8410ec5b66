"""Tutorial 4: a pretrained model straight into shards, and its weights pushed to another process.

Run it as it is (it starts 2 CPU training ranks and 1 inference process)::

    python tutorials/04_pretrained_weight_sync.py

What it shows (docs/checkpointing.rst, "Loading a pretrained model" and
"Streaming the full weights out"):

1. A Hugging Face checkpoint as ``save_pretrained`` writes it (here a tiny
   LLaMA saved in bf16, sharded into several files, standing in for a
   downloaded model) is loaded into float32 FSDP units without any process
   ever holding the model: each rank builds it on the meta device, wraps it
   (``pretrained_init`` materialises one unit at a time, without drawing
   random weights, and computes the rotary buffers with the model's own
   init), then ``load_pretrained`` reads from the files only the bytes of the
   rank's own shards, converting bf16 to float32 as it reads.
2. After a training step, ``iter_full_weights(rank0_only=True)`` streams the
   full weights out unit by unit (one unit unsharded at a time) and rank 0
   puts each tensor on a ``multiprocessing`` queue read by an inference
   process that is not part of the FSDP job (as in RL weight sync).  The
   inference process builds a plain model from the streamed tensors and checks
   its logits against the trained FSDP model's.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fsdp_wrap as fsdp
from fsdp_wrap.wrap import ModuleWrapPolicy

FSDP = fsdp.FullyShardedDataParallel
PROMPT = torch.arange(12).reshape(2, 6) % 64


def make_checkpoint(path: str) -> None:
    """Stand-in for a downloaded model: a tiny LLaMA saved in bf16, several files."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="20KB")


def train(rank: int, path: str, queue: mp.Queue, ack: mp.Queue) -> None:
    # 1. Build on the meta device: no memory, no initialisation.
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    # 2. Wrap: each unit is materialised (uninitialised memory for what the
    #    checkpoint holds, the model's own init for the rotary buffers),
    #    flattened and sharded before the next one.
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                 device_id=torch.device("cpu"), param_init_fn=fsdp.pretrained_init(model, path))
    # 3. Fill each rank's shards from the files (bf16 -> float32 while reading).
    result = fsdp.load_pretrained(model, path)
    print(f"[rank {rank}] loaded {path}: nothing missing ({result})", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    print(f"[rank {rank}] one training step, loss {loss.item():.4f}", flush=True)

    # 4. Stream the full weights to the inference process, one unit at a time.
    sent = 0
    for name, tensor in fsdp.iter_full_weights(model, rank0_only=True):
        queue.put((name, tensor))  # only rank 0 receives anything to put
        sent += tensor.numel() * tensor.element_size()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
    if rank == 0:
        queue.put(("logits", logits))
        queue.put((None, None))
        # The queue passes tensors through shared memory that this process hands
        # over on request: stay alive until the reader has taken everything.
        ack.get(timeout=120)
        print(f"[rank 0] streamed {sent / 2**10:.0f} KiB of weights to the inference process",
              flush=True)


def inference(path: str, queue: mp.Queue, ack: mp.Queue, done: mp.Queue) -> None:
    """A process outside the FSDP job: builds a plain model from the streamed weights."""
    weights = {}
    while True:
        name, tensor = queue.get()
        if name is None:
            break
        weights[name] = tensor.clone()  # (the queue's shared memory is the sender's)
    ack.put(True)
    want = weights.pop("logits")
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        plain = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    plain.load_state_dict(weights, strict=True, assign=True)  # every name, nothing left over
    plain.model.rotary_emb = type(plain.model.rotary_emb)(config)  # (a buffer no state dict holds)
    plain.eval()
    with torch.no_grad():
        got = plain(input_ids=PROMPT).logits
    same = torch.equal(got, want)
    print(f"[inference] {len(weights)} tensors received; logits equal to the trained FSDP "
          f"model's: {same}", flush=True)
    done.put(same)


def worker(rank: int, world_size: int, port: int, path: str, queue: mp.Queue,
           ack: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        train(rank, path, queue, ack)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny-llama")
        make_checkpoint(path)
        ctx = mp.get_context("spawn")
        queue, ack, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
        reader = ctx.Process(target=inference, args=(path, queue, ack, done))
        reader.start()
        mp.spawn(worker, args=(2, free_port(), path, queue, ack), nprocs=2)
        ok = done.get(timeout=120)
        reader.join(timeout=60)
    if not ok:
        raise SystemExit("the inference process's logits differ from the trained model's")
    print("pretrained load and weight sync: OK", flush=True)
