"""Tutorial 3: bf16 mixed precision with CPU offload.

Run it as it is (it starts 2 CPU ranks itself, gloo on 127.0.0.1)::

    python tutorials/03_mixed_precision_offload.py

or under torchrun::

    torchrun --nproc-per-node 2 tutorials/03_mixed_precision_offload.py

What the two options do (docs/options.rst has the details):

* ``MixedPrecision(param_dtype=torch.bfloat16, ...)``: the optimizer keeps
  float32 *master* shards; each unit's shard is cast to bf16 and all-gathered
  in bf16 just before the unit runs, so forward and backward compute in bf16
  and the all-gathers move half the bytes.  ``reduce_dtype=torch.float32``
  reduces the gradients in float32 (more accurate sums, twice the bytes of a
  bf16 reduction); the optimizer then sees float32 gradients.
* ``CPUOffload(offload_params=True)``: the float32 shards and their
  gradients live in CPU memory and the optimizer steps on CPU.  Each unit's
  shard is copied to the compute device right before its all-gather, and the
  reduced gradient shard is copied back.  On GPUs this frees device memory
  for activations at the cost of host-device copies every step; here the
  compute device is the CPU too, so the copies are cheap and the tutorial
  shows the mechanics.

bf16 has float32's exponent range, so unlike fp16 no loss scaling is needed
(no ``ShardedGradScaler``).  For fp16 see ``fsdp_wrap.sharded_grad_scaler``.

torch's own FSDP1 cannot run this script on a CPU-only machine: its CPU
offload pins memory, which needs an accelerator.  fsdp_wrap can; on a GPU
machine pass ``device_id=local_rank`` and both behave the same.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# The only fsdp_wrap-specific lines (torch: torch.distributed.fsdp / .wrap).
import fsdp_wrap as fsdp
from fsdp_wrap.wrap import transformer_auto_wrap_policy

FSDP = fsdp.FullyShardedDataParallel


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Model(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def build_model() -> FSDP:
    torch.manual_seed(0)  # the same initial weights on every rank
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FSDP(
        Model(),
        auto_wrap_policy=policy,
        # 1. Compute in bf16, reduce gradients in float32, keep buffers in bf16.
        mixed_precision=fsdp.MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            buffer_dtype=torch.bfloat16,
        ),
        # 2. Sharded float32 parameters and gradients live on CPU.
        cpu_offload=fsdp.CPUOffload(offload_params=True),
        device_id=torch.device("cpu"),  # on GPUs: the local device
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank gets its own data: "predict the next token, x + 1"."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 32, (8, 16), generator=g)
    return x, (x + 1) % 32


def train(rank: int) -> None:
    model = build_model()
    # The optimizer sees the float32 master shards (on CPU with offload).
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    masters = {str(p.dtype) for p in model.parameters()}
    devices = {p.device.type for p in model.parameters()}

    # Watch one layer: the weight it computes with is the bf16 unsharded copy.
    seen: list[torch.dtype] = []
    first_linear = model.blocks[0].ff[0]
    first_linear.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))

    losses = []
    for step in range(10):
        x, y = batch(step, rank)
        logits = model(x)  # bf16 activations
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        grad_dtypes = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    # The full state dict is float32 (the master weights), on CPU.
    state = model.state_dict()
    state_dtypes = {str(t.dtype) for t in state.values()}

    checks = {
        "master parameters are float32": masters == {"torch.float32"},
        "master parameters live on CPU": devices == {"cpu"},
        "forward computes with bf16 weights": set(seen) == {torch.bfloat16},
        "gradients reach the optimizer in float32": grad_dtypes == {"torch.float32"},
        "full state dict is float32": state_dtypes == {"torch.float32"},
        "the loss went down": losses[-1] < 0.7 * losses[0],
    }
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise RuntimeError(f"rank {rank}: checks failed: {failed}")
    if rank == 0:
        for name in checks:
            print(f"check: {name}", flush=True)
        print(f"mixed precision with CPU offload, {len(losses)} steps: OK", flush=True)


def worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        train(rank)
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
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank())
            dist.barrier()
        finally:
            dist.destroy_process_group()
    else:
        mp.spawn(worker, args=(2, free_port()), nprocs=2)
