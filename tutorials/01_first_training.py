"""Tutorial 1: a first training run with fsdp_wrap, and a full checkpoint.

Run it as it is (it starts 2 CPU ranks itself, gloo on 127.0.0.1)::

    python tutorials/01_first_training.py

or under torchrun, which starts the ranks for it::

    torchrun --nproc-per-node 2 tutorials/01_first_training.py

The script is plain FSDP1 code.  Written against torch's FSDP it would
differ only in the two imports marked "the only fsdp_wrap-specific lines".
"""

from __future__ import annotations

import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# The only fsdp_wrap-specific lines.  With torch's FSDP they would read
#   import torch.distributed.fsdp as fsdp
#   from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
import fsdp_wrap as fsdp
from fsdp_wrap.wrap import transformer_auto_wrap_policy

FSDP = fsdp.FullyShardedDataParallel


# 1. A model.  Each ``Block`` will become an FSDP unit of its own: its
#    parameters are gathered just before it runs and freed right after.
#    Everything else (embedding, head) lands in the root unit.
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
        sharding_strategy=fsdp.ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),  # CPU ranks; on GPUs pass the local device
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank gets its own data: the task is "predict the next token, x + 1"."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 32, (8, 16), generator=g)
    return x, (x + 1) % 32


def train(rank: int, world_size: int, checkpoint: str) -> None:
    # 2. Wrap, then create the optimizer: it must see the wrapped (sharded) parameters.
    model = build_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # 3. An ordinary training loop.  FSDP all-gathers, frees and
    #    reduce-scatters inside forward and backward.
    for step in range(8):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    # 4. A full checkpoint: every rank takes part in gathering, rank 0
    #    receives the whole state dict (on CPU) and writes it.  The keys are
    #    those of the unwrapped model, so a plain ``Model()`` can load it.
    cfg = fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        torch.save(state, checkpoint)
        print(f"saved {len(state)} tensors to {checkpoint}", flush=True)
    dist.barrier()  # the file exists before anyone reads it

    # 5. Load it into a fresh FSDP model: every rank reads the full dict and
    #    keeps its own shard.  (Optimizer state is not saved here.)
    restored = build_model()
    with FSDP.state_dict_type(restored, fsdp.StateDictType.FULL_STATE_DICT):
        restored.load_state_dict(torch.load(checkpoint, weights_only=True))

    # 6. Check: the restored model computes exactly what the trained one does.
    x, _ = batch(100, rank)
    with torch.no_grad():
        same = torch.equal(model(x), restored(x))
    if not same:
        raise RuntimeError(f"rank {rank}: the restored model differs from the trained one")
    if rank == 0:
        print("restored model matches the trained model: OK", flush=True)


def worker(rank: int, world_size: int, port: int, checkpoint: str) -> None:
    """One spawned rank: join a gloo group on this machine, train, leave."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        train(rank, world_size, checkpoint)
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
        path = os.path.join(tmp, "model.pt")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
            dist.init_process_group("gloo")
            # torchrun ranks on one machine share /tmp; rank 0's path is used by all.
            shared = [path]
            dist.broadcast_object_list(shared, src=0)
            try:
                train(dist.get_rank(), dist.get_world_size(), shared[0])
                dist.barrier()
            finally:
                dist.destroy_process_group()
        else:
            mp.spawn(worker, args=(2, free_port(), path), nprocs=2)
