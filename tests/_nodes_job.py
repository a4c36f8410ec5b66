"""The training job of tests/test_nodes.py, on every rank of a test-bed cluster.

Run as ``python -m tests._nodes_job CONFIG.json`` by torchrun in each node of
:class:`fsdp_wrap.cli.testbed.Cluster` (2 nodes x 2 ranks); :func:`train_case` also
runs on 4 ranks of one host (the suite's pool) with torch's FSDP1 as the
reference.  Two modes:

* ``sweep``: the link's protocol overhead (a known number of bytes exchanged
  between the nodes), then every case of the config in turn: a few training
  steps of fsdp_wrap, each step's bytes across this node's link (read on
  local rank 0 between barriers), the losses and the final parameter shards.
* ``resume``: HYBRID_SHARD training with a full checkpoint every
  ``ckpt_every`` steps (:func:`fsdp_wrap.checkpoint.save_full_checkpoint`,
  atomic); on a restart by ``torchrun --max-restarts`` it loads the last
  complete checkpoint and goes on.  A rank whose collective fails (the test
  kills the other node's ranks mid-step) writes the error and how long after
  the step's start it came, then exits non-zero so that torchrun restarts it.
  Then the ``disagree`` cases: the nodes were launched with different
  settings (the test gives node 1 another environment); each case's
  construction and first step, and what every rank got.

Each rank writes its results to ``<out>/rank<r>.pt`` (``sweep``) or
``<out>/rank<r>-from<start step>.pt`` (``resume``).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

DIM, HIDDEN, BLOCKS = 256, 1024, 3  # 2.1 MB units: gathers above the broadcast threshold
BATCH, SEQ = 2, 8
PG_TIMEOUT_S = 20  # the process group's timeout: a lost peer must be reported within it
CALIBRATION_BYTES = 8 * 2**20  # per rank, each way


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def batch(step: int, seed: int) -> torch.Tensor:
    """This rank's input at ``step`` (different per rank, the same in every run)."""
    g = torch.Generator().manual_seed(1000 + 7919 * dist.get_rank() + 101 * step + seed)
    return torch.randn(BATCH, SEQ, DIM, generator=g)


def wrap(impl: str, strategy: str, groups: str, seed: int, **extra: Any) -> nn.Module:
    """``Net`` (seeded) under ``impl``'s FSDP1 (``"ours"`` or ``"torch"``), one unit
    per block and the root; ``groups``: ``"default"`` (hybrid groups from the
    launcher's node layout), ``"mesh"`` (a 2-D mesh ``(replicate, shard)``) or
    ``"world"``."""
    if impl == "ours":
        import fsdp_wrap as api
        from fsdp_wrap.wrap import ModuleWrapPolicy
    else:
        import torch.distributed.fsdp as api
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    torch.manual_seed(seed)
    kw: dict[str, Any] = {}
    if groups == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if impl == "torch":
        kw["device_id"] = torch.device("cpu")
    return api.FullyShardedDataParallel(
        Net(), sharding_strategy=api.ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}), **kw, **extra)


def unit_bytes(model: nn.Module, strategy: str) -> tuple[list[int], int]:
    """Every unit's unsharded, padded flat parameter in bytes, and the root's."""
    # each rank holds 1 / (shard group's size) of a flat parameter; NO_SHARD all of it
    shard_ranks = 1 if strategy == "NO_SHARD" else model.world_size
    units, root = [], 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * shard_ranks * p.element_size()
        units.append(nbytes)
        if name.replace("_fsdp_wrapped_module.", "") == "_flat_param":
            root = nbytes
    return units, root


def _sent_between(fn: Any) -> int | None:
    """Bytes this node sent while ``fn()`` ran; ``None`` off local rank 0 or
    outside a cluster."""
    from fsdp_wrap.cli.testbed.link import sent_during

    return sent_during(fn, dist.barrier)[1]


def train_case(case: dict[str, Any], impl: str = "ours",
               on_step: Any = None) -> dict[str, Any]:
    """``case["steps"]`` Adam steps of ``case["strategy"]``; per step the loss and
    this node's bytes; at the end this rank's parameter shards.  ``on_step()``
    after every step (the test pool's progress report); ``case["kw"]``: more
    keywords for fsdp_wrap (they win over the node's environment)."""
    model = wrap(impl, case["strategy"], case["groups"], case["idx"],
                 **(case.get("kw", {}) if impl == "ours" else {}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses: list[float] = []
    sent: list[int | None] = []

    def step(i: int) -> None:
        loss = model(batch(i, case["idx"])).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step()

    for i in range(case["steps"]):
        sent.append(_sent_between(lambda i=i: step(i)))
    units, root = unit_bytes(model, case["strategy"])
    return {"losses": losses, "sent": sent, "units": units, "root": root,
            "shards": [p.detach().clone() for p in model.parameters()]}


def calibrate() -> dict[str, Any]:
    """Each rank exchanges ``CALIBRATION_BYTES`` with its peer on the other node
    (same local rank): the payload crossing each node's link is known exactly."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    peer = (rank + per_node) % ws
    out = torch.ones(CALIBRATION_BYTES // 4)
    inp = torch.empty_like(out)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inp, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    exchange()  # warm: the pair's connection exists before the count
    return {"sent": _sent_between(exchange), "payload": per_node * CALIBRATION_BYTES}


# ---------------------------------------------------------------------------
# resume: checkpoints, a killed node, torchrun's restart
# ---------------------------------------------------------------------------


def _last_complete(ckpt_dir: str) -> tuple[int, str] | None:
    """The checkpoint with the most steps done (``done-<n>``; an interrupted save
    is still ``done-<n>.incomplete`` and does not count)."""
    best = None
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        if name.startswith("done-") and name[5:].isdigit():
            n = int(name[5:])
            best = max(best or (n, ""), (n, os.path.join(ckpt_dir, name)))
    return best


def _term_then_exit() -> None:
    """On torchrun's SIGTERM (it stops a node's ranks to restart them) leave a
    few seconds for a collective that is failing to raise and be recorded."""
    def later(signum: int, frame: Any) -> None:
        threading.Timer(10.0, lambda: os._exit(128 + signum)).start()

    signal.signal(signal.SIGTERM, later)


def resume(cfg: dict[str, Any], out: str) -> dict[str, Any]:
    """Train from the last complete checkpoint (if any) to ``cfg["steps"]``.

    Files are named by the step a run starts from (``from<start>``), not by
    ``TORCHELASTIC_RESTART_COUNT``: torchrun counts only the restarts after a
    failure of the node's own ranks, so after a node died the nodes' counts
    may differ (one restarted for the failure, one for the changed membership).
    """
    from fsdp_wrap.checkpoint import load_full_checkpoint, save_full_checkpoint

    _term_then_exit()
    model = wrap("ours", cfg["strategy"], "default", cfg["seed"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    last = _last_complete(cfg["ckpt_dir"])
    if last is not None:
        start, path = last
        load_full_checkpoint(model, path, opt)
    losses: dict[int, float] = {}
    rank = dist.get_rank()
    for step in range(start, cfg["steps"]):
        t0 = time.monotonic()
        with open(os.path.join(out, f"step{step}-rank{rank}-from{start}"), "w"):
            pass  # the test kills the other node once it sees this
        try:
            loss = model(batch(step, cfg["seed"])).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step] = loss.item()
            if (step + 1) % cfg["ckpt_every"] == 0:
                save_full_checkpoint(model, os.path.join(cfg["ckpt_dir"], f"done-{step + 1}"), opt)
        except Exception as e:
            error = {"step": step, "after_s": time.monotonic() - t0,
                     "error": f"{type(e).__name__}: {e}"}
            torch.save({"losses": losses, "start": start, "error": error},
                       os.path.join(out, f"rank{rank}-from{start}.pt"))
            raise
    return {"losses": losses, "start": start, "error": None}


# ---------------------------------------------------------------------------
# disagree: nodes launched with different settings
# ---------------------------------------------------------------------------


def disagree(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case builds the model with its keywords (the node's environment
    fills in the rest) and runs one step; what every rank got: ``"accepted"``
    or the error, and how long after the construction began."""
    out = []
    for case in cases:
        t0 = time.monotonic()
        try:
            model = wrap("ours", case["strategy"], case["groups"], 0, **case.get("kw", {}))
            model(batch(0, 0)).pow(2).mean().backward()
            got = "accepted"
        except Exception as e:
            got = f"{type(e).__name__}: {e}"
        out.append({"got": got, "after_s": time.monotonic() - t0})
    return out


# ---------------------------------------------------------------------------


def main(config_path: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    with open(config_path) as f:
        cfg = json.load(f)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    out = cfg["out"]
    if cfg["mode"] == "sweep":
        result: dict[str, Any] = {"calibration": calibrate(),
                                  "cases": [train_case(c) for c in cfg["cases"]],
                                  "disagree": disagree(cfg.get("disagree", []))}
        name = f"rank{dist.get_rank()}.pt"
    else:
        result = resume(cfg, out)
        name = f"rank{dist.get_rank()}-from{result['start']}.pt"
    torch.save(result, os.path.join(out, name))
    dist.barrier()
    from fsdp_wrap.comm.teardown import exit_now

    exit_now()


if __name__ == "__main__":
    main(sys.argv[1])
