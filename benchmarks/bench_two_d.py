"""2-D (FSDP1 over ``mesh["dp"]`` + tensor parallelism over ``mesh["tp"]``) on CPU ranks.

Four gloo ranks, one thread each.  A stack of MLP blocks (``ColwiseParallel``
up-projection, ``RowwiseParallel`` down-projection, one FSDP unit per block)
trains with Adam; per configuration and rank:

* step time: the median of ``--steps`` timed steps (forward, backward,
  optimizer step) after two warm-up steps, wall clock and the rank's own CPU
  time; the configurations run in one job, a step of each in turn;
* held: the bytes of the parameters, gradients and optimizer state a rank
  keeps between steps (its shards);
* peak: the most live heap bytes during one step (glibc ``mallinfo2`` after
  every op, ``benchmarks/_live_bytes.py``), above those before the step.

Configurations: ``dp=2 x tp=2`` with fsdp_wrap and with torch's FSDP1 (the
same model, mesh and data), and ``dp=4`` without TP with both.  Run from the
repository root::

    python benchmarks/bench_two_d.py            # the table in docs/two_d.rst
    python benchmarks/bench_two_d.py --steps 3 --dim 64    # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._bench_launch import launch, rst_table  # noqa: E402
from benchmarks._live_bytes import LivePeak, live_bytes  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _build(impl: str, tp: int, cfg: dict[str, Any]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Net(cfg["dim"], cfg["layers"])
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        extra: dict[str, Any] = {"device_id": torch.device("cpu")}
    else:
        from fsdp_wrap import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        from fsdp_wrap.wrap import ModuleWrapPolicy  # type: ignore[assignment]
        extra = {}
    ws = dist.get_world_size()
    if tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (ws // tp, tp), mesh_dim_names=("dp", "tp"))
        plan: dict[str, Any] = {}
        for i in range(cfg["layers"]):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        fsdp_mesh = mesh["dp"]
    else:
        fsdp_mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    return FSDP(model, device_mesh=fsdp_mesh, auto_wrap_policy=ModuleWrapPolicy({Block}),
                use_orig_params=cfg["uop"], **extra)


def _held(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None:
                t = t.to_local() if hasattr(t, "to_local") else t
                tensors[t.untyped_storage().data_ptr()] = t
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                tensors[v.untyped_storage().data_ptr()] = v
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


CONFIGS = [(2, "fsdp_wrap"), (2, "torch"), (1, "fsdp_wrap"), (1, "torch")]


def _job(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every configuration in one job, their timed steps interleaved (a step of
    each in turn), so a busy machine slows them alike."""
    warnings.filterwarnings("ignore")
    runs = []
    for tp, impl in CONFIGS:
        model = _build(impl, tp, cfg)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank // tp)  # the same batch within a TP group
        x = torch.randn(cfg["batch"], cfg["seq"], cfg["dim"], generator=gen)
        runs.append((model, opt, x))

    def step(run: tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]) -> None:
        model, opt, x = run
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for run in runs:
        for _ in range(2):
            step(run)
    wall: list[list[float]] = [[] for _ in runs]
    cpu: list[list[float]] = [[] for _ in runs]
    for _ in range(cfg["steps"]):
        for i, run in enumerate(runs):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(run)
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    out = []
    for i, run in enumerate(runs):
        held = _held(run[0], run[1])
        dist.barrier()
        before = live_bytes()
        with LivePeak() as peak:
            step(run)
        out.append({"time": statistics.median(wall[i]), "cpu": statistics.median(cpu[i]),
                    "held": held, "peak": peak.peak - before})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--use-orig-params", action="store_true")
    args = ap.parse_args(argv)
    cfg = dict(nproc=4, threads=1, dim=args.dim, layers=args.layers, batch=args.batch,
               seq=args.seq, steps=args.steps, uop=args.use_orig_params)
    res = launch(_job, cfg)
    rows = []
    for i, (tp, impl) in enumerate(CONFIGS):
        per_rank = [r[i] for r in res]
        rows.append([
            "dp=2 x tp=2" if tp == 2 else "dp=4", impl,
            f"{1000 * max(r['time'] for r in per_rank):.1f}",
            f"{1000 * max(r['cpu'] for r in per_rank):.1f}",
            f"{max(r['held'] for r in per_rank) / 2**20:.2f}",
            f"{max(r['peak'] for r in per_rank) / 2**20:.2f}",
        ])
    n = sum(p.numel() for p in Net(args.dim, args.layers).parameters())
    print(f"\n{n / 1e6:.2f}M parameters, {args.layers} blocks of dim {args.dim}, batch "
          f"{args.batch}x{args.seq}, use_orig_params={args.use_orig_params}, 4 gloo ranks, "
          f"1 thread each, {args.steps} interleaved steps; the slowest rank's median step "
          "(wall and this process's CPU time), the largest rank's bytes\n")
    print(rst_table(["mesh", "implementation", "step ms", "CPU ms", "held MiB", "peak MiB"],
                    rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
