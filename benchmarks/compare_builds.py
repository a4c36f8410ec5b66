#!/usr/bin/env python
"""Do two builds of fsdp_wrap train bit for bit alike?

    python benchmarks/compare_builds.py                 # the working tree against main
    python benchmarks/compare_builds.py --against HEAD~3 --steps 6

For a change meant to leave the numerics alone (fewer Python calls, reused
buffers): the library of ``--against`` (a git revision, exported with ``git
archive`` to a temporary directory) and the working tree's each train the
same configurations on 2 gloo ranks, from the same weights on the same data,
``--steps`` steps of forward, backward and ``AdamW.step`` (with a
``no_sync`` micro-batch and a gradient clip every other step), and every
parameter, gradient and optimizer state of every rank is compared with
``torch.equal``.  Prints one line per configuration; exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)

# (strategy, use_orig_params, extra constructor keywords)
CONFIGS: list[tuple[str, bool, dict[str, object]]] = [
    (s, o, kw)
    for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for o in (False, True)
    for kw in ({}, {"bucket_cap_mb": 0}, {"mixed_precision": "bf16"}, {"cpu_offload": True},
               {"forward_prefetch": True, "limit_all_gathers": False})
]


def _train(rank: int, port: int, out: str, steps: int) -> None:
    import contextlib
    import dataclasses
    import warnings

    import torch
    import torch.distributed as dist

    sys.path.insert(0, _HERE)
    from _bench_models import WORKLOADS, Block, loss_fn, make_batches, make_model

    import fsdp_wrap as fsdp
    from fsdp_wrap.comm.teardown import exit_now
    from fsdp_wrap.wrap import ModuleWrapPolicy

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        print(f"training with {os.path.dirname(fsdp.__file__)}", flush=True)
    w = dataclasses.replace(WORKLOADS["small"], layers=6)
    batches = make_batches(w, rank, 4, torch.device("cpu"))
    results: dict[str, dict[str, torch.Tensor]] = {}
    for strategy, orig, extra in CONFIGS:
        kw = dict(extra)
        if kw.pop("mixed_precision", None):
            kw["mixed_precision"] = fsdp.MixedPrecision(torch.bfloat16, torch.bfloat16)
        if kw.pop("cpu_offload", None):
            kw["cpu_offload"] = fsdp.CPUOffload(offload_params=True)
        model = fsdp.FullyShardedDataParallel(
            make_model(w), sharding_strategy=fsdp.ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        for i in range(steps):
            opt.zero_grad(set_to_none=i % 2 == 0)
            ctx = model.no_sync() if i % 2 else contextlib.nullcontext()
            with ctx:
                loss_fn(model(batches[i % 4])).backward()
            loss_fn(model(batches[(i + 1) % 4])).backward()
            if i % 2:
                model.clip_grad_norm_(1.0)
            opt.step()
        key = f"{strategy}/{'T' if orig else 'F'}/{sorted(extra)}"
        state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
        state.update({f"grad {n}": p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        for j, (_p, s) in enumerate(opt.state.items()):
            state.update({f"optim {j} {k}": v.clone() for k, v in s.items()
                          if isinstance(v, torch.Tensor)})
        results[key] = state
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


def _run(pythonpath: str, out: str, steps: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=pythonpath + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                               "--out", out, "--steps", str(steps)], env=env) for r in (0, 1)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"training with {pythonpath} failed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default="main", help="git revision to compare with")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        _train(args.rank, args.port, args.out, args.steps)
        return 0
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        snap = os.path.join(tmp, "snap")
        os.makedirs(snap)
        archive = subprocess.run(["git", "-C", _ROOT, "archive", args.against, "fsdp_wrap"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", snap], input=archive, check=True)
        _run(snap, os.path.join(tmp, "theirs"), args.steps)
        _run(_ROOT, os.path.join(tmp, "ours"), args.steps)
        differ = 0
        for rank in (0, 1):
            theirs = torch.load(os.path.join(tmp, f"theirs.{rank}"))
            ours = torch.load(os.path.join(tmp, f"ours.{rank}"))
            for key in theirs:
                a, b = theirs[key], ours.get(key, {})
                bad = [n for n in a if n not in b or not torch.equal(a[n], b[n])]
                bad += [n for n in b if n not in a]
                differ += bool(bad)
                status = "equal" if not bad else f"DIFFER in {len(bad)}: {bad[:3]}"
                print(f"rank {rank} {key}: {len(a)} tensors {status}")
    print(f"{args.against} vs working tree: {'bit-identical' if not differ else 'DIFFERENT'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
