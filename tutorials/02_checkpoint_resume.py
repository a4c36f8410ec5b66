"""Tutorial 2: save a sharded checkpoint, kill the job, resume exactly.

Run it as it is (it starts 2 CPU ranks itself, gloo on 127.0.0.1)::

    python tutorials/02_checkpoint_resume.py

It runs two separate jobs, each a fresh set of processes with its own process
group, as a real restart would be:

1. **Job 1** trains for 4 steps, writes a checkpoint of the model *and* the
   optimizer with ``torch.distributed.checkpoint`` (DCP) under
   ``SHARDED_STATE_DICT``, then keeps training to step 8 without a break.
   Its losses for steps 4..7 are the reference.
2. **Job 2** starts from scratch (other random weights, an empty optimizer),
   loads the checkpoint and trains steps 4..7.  Its losses must equal job 1's
   exactly; the script exits with status 1 if they do not.

``--skip-optimizer-state`` restores only the model in job 2: Adam's moments
restart from zero and the losses drift away from the reference, which the
script reports as a failure.  That is the most common resume bug.

Every rank writes only its own shards (no rank gathers the whole model), and
the checkpoint can be loaded by a different number of ranks: DCP reshards it.
Written against torch's FSDP the script would differ only in the lines marked
"the only fsdp_wrap-specific lines".
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# The only fsdp_wrap-specific lines.  With torch's FSDP the first two would read
#   import torch.distributed.fsdp as fsdp
#   from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
# and torch has no init_optim_state_from_checkpoint (there, take one optimizer
# step at learning rate 0 on zero gradients before building the template).
import fsdp_wrap as fsdp
from fsdp_wrap.checkpoint import init_optim_state_from_checkpoint
from fsdp_wrap.wrap import transformer_auto_wrap_policy

FSDP = fsdp.FullyShardedDataParallel
SAVE_AT = 4  # job 1 checkpoints after this many steps
TOTAL = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Model(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def build(seed: int) -> tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # the same initial weights on every rank of a job
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(Model(), auto_wrap_policy=policy, device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data depends only on (step, rank): a resumed job sees the same batches."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 32, (8, 16), generator=g)
    return x, (x + 1) % 32


def train_step(model: FSDP, optim: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step, dist.get_rank())
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # the loss over all ranks' data
    return mean.item() / dist.get_world_size()


# ------------------------------------------------------------- checkpoint


def save_checkpoint(model: FSDP, optim: torch.optim.Optimizer, step: int, path: str) -> None:
    """Every rank writes its own shards of the model and optimizer state.

    Under SHARDED_STATE_DICT, ``model.state_dict()`` holds ShardedTensors
    (each rank's dim-0 chunk of every parameter) and ``optim_state_dict``
    the optimizer state in the same layout, keyed by parameter names.
    Plain values (the step counter) are saved once.
    """
    with FSDP.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
        state = {
            "model": model.state_dict(),
            "optim": FSDP.optim_state_dict(model, optim),
            "trainer": {"step": step},
        }
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(model: FSDP, optim: torch.optim.Optimizer, path: str, with_optim: bool = True) -> int:
    """Load model and optimizer state into this job's (possibly differently sized) FSDP model.

    DCP loads *in place* into a template state dict, so the optimizer's
    template must already hold every state tensor (``exp_avg`` ...) in its
    sharded shape; a fresh optimizer has none (Adam makes them at its first
    step), and its template would read back the learning rate but not the
    moments.  ``init_optim_state_from_checkpoint`` gives it zero placeholders
    shaped by what the checkpoint stores (from its metadata, on each rank, no
    collective); the load then overwrites them.
    """
    if with_optim:
        init_optim_state_from_checkpoint(model, optim, path, key="optim")
    with FSDP.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
        state = {
            "model": model.state_dict(),  # templates: this job's shards
            "trainer": {"step": -1},
        }
        if with_optim:
            state["optim"] = FSDP.optim_state_dict(model, optim)
        dcp.load(state, checkpoint_id=path)  # fills the templates in place
        model.load_state_dict(state["model"])
        if with_optim:
            # FQN-keyed, sharded -> what this rank's optimizer.load_state_dict expects
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    return int(state["trainer"]["step"])


# ------------------------------------------------------------------- jobs


def job_one(workdir: str) -> None:
    rank = dist.get_rank()
    model, optim = build(seed=0)
    reference = {}
    for step in range(TOTAL):
        if step == SAVE_AT:
            save_checkpoint(model, optim, step, os.path.join(workdir, "ckpt"))
            if rank == 0:
                print(f"job 1: saved a sharded checkpoint at step {step}", flush=True)
        loss = train_step(model, optim, step)
        if rank == 0:
            print(f"job 1 step {step}: loss {loss:.6f}", flush=True)
        if step >= SAVE_AT:
            reference[step] = loss
    if rank == 0:  # the uninterrupted run's losses, for job 2 to compare with
        with open(os.path.join(workdir, "reference.json"), "w") as f:
            json.dump(reference, f)


def job_two(workdir: str, with_optim: bool) -> bool:
    rank = dist.get_rank()
    model, optim = build(seed=1234)  # other weights: the checkpoint must replace them
    start = load_checkpoint(model, optim, os.path.join(workdir, "ckpt"), with_optim)
    if rank == 0:
        what = "model and optimizer" if with_optim else "model only"
        print(f"job 2: resumed ({what}) at step {start}", flush=True)
    with open(os.path.join(workdir, "reference.json")) as f:
        reference = {int(k): v for k, v in json.load(f).items()}
    same = True
    for step in range(start, TOTAL):
        loss = train_step(model, optim, step)
        if rank == 0:
            print(f"job 2 step {step}: loss {loss:.6f} (uninterrupted: {reference[step]:.6f})", flush=True)
        same = same and loss == reference[step]
    return same


def worker(rank: int, world_size: int, port: int, job: str, workdir: str, with_optim: bool) -> None:
    """One spawned rank of one job: join a fresh gloo group, run the job, leave."""
    # FSDP1's sharded state dicts are ShardedTensors (torch's format, which DCP
    # and torch's FSDP read); torch now recommends DTensor and says so on every use.
    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        if job == "one":
            job_one(workdir)
        elif not job_two(workdir, with_optim):
            sys.exit(1)  # mp.spawn reports the failing rank; the script exits non-zero
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job: str, workdir: str, with_optim: bool) -> None:
    """Start a job: 2 new processes, a new process group on a new port."""
    # Like mp.spawn, but the processes fork from a server that has already
    # imported torch and fsdp_wrap: seconds faster per job on a small machine.
    mp.start_processes(
        worker, args=(2, free_port(), job, workdir, with_optim), nprocs=2,
        start_method="forkserver",
    )


def main() -> int:
    torch.set_num_threads(1)
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "fsdp_wrap"])
    with_optim = "--skip-optimizer-state" not in sys.argv[1:]
    with tempfile.TemporaryDirectory() as workdir:
        launch("one", workdir, with_optim)
        # job 1's processes are gone; job 2 is a new set of processes and a new group
        try:
            launch("two", workdir, with_optim)
        except mp.ProcessExitedException:
            print("resumed losses differ from the uninterrupted run: FAILED", flush=True)
            return 1
    print("resumed losses match the uninterrupted run exactly: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
