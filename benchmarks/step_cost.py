#!/usr/bin/env python
"""What one training step costs the host, in measures that machine load does not move.

    python benchmarks/step_cost.py                        # small: DDP and fsdp_wrap FULL_SHARD
    python benchmarks/step_cost.py --variants ddp,fsdp_wrap/FULL_SHARD/T,torch_fsdp1/FULL_SHARD/F
    python benchmarks/step_cost.py --callgrind            # + instructions per step (valgrind)

Two gloo ranks (one thread each) build every configuration named in
``--variants`` (``framework/STRATEGY/F|T``, ``ddp``) from the same weights and
run the same step as ``bench_fsdp.py`` (``zero_grad``, forward, loss, backward,
``AdamW.step``).  After warm-up, rank 0 measures each configuration's steps,
the configurations interleaved round by round:

* ``cpu ms``: the main thread's CPU time per step (``time.thread_time``), the
  median over rounds.  Waiting for the other rank or for gloo's threads costs
  no CPU time, so this is the host work of the step: compute plus the
  framework's own Python and tensor ops.  Load still moves it a little (caches,
  frequency), much less than wall time;
* ``proc ms``: the same for every thread of the process: adds gloo's threads
  (copies, transport) and autograd's;
* ``wall ms``: for reference only on a shared machine;
* ``calls``: Python function calls per step (``cProfile``, one extra step per
  configuration; deterministic);
* ``Minstr/step``: with ``--callgrind`` (instead of the above), rank 0 runs
  under valgrind's callgrind with instrumentation on only around each
  configuration's ``--cg-steps`` steps: the user-space instructions per step
  of every thread of the process (not the kernel's: loopback TCP copies are
  not counted), repeatable to a fraction of a percent whatever else the
  machine runs.  Slow (minutes); the per-function profiles are kept with
  ``--keep DIR`` for ``callgrind_annotate``.

With ``--no-comm`` each configuration also runs as ``KEY/nocomm``: the same
step with its collectives replaced by local stand-ins (DDP under
``no_sync()``), interleaved with the others, so a step's time splits into the
framework's own work and its collectives.  Checked for DDP and fsdp_wrap
(their ``nocomm`` rows leave gloo's threads idle: ``proc ms`` equals ``cpu
ms``); torch's FSDP1 still keeps other threads busy there, so its split is
not complete.

With ``--phases`` the table is followed by each configuration's CPU ms per
phase on each rank: ``zero_grad`` with the forward and the loss, the
backward, the optimizer's step (the ranks hold different pieces: with
``use_orig_params=True`` their optimizers step over different numbers of
tensors).

With ``--waiting`` each fsdp_wrap configuration also runs as ``KEY/waiting``:
a batched gather that a prefetch starts is waited for as soon as it is issued
(``fsdp_wrap.runtime.hooks.gather_ahead`` patched to ``async_op=False`` while
the step runs), as before such batches stayed in flight behind compute; the
table is followed by the median of the per-round wall-time ratios of each
configuration to its waiting form.

The difference between a configuration and ``ddp`` (the same compute, two
all-reduces, no Python per layer) is the framework's own per-step cost.
To measure a given commit rather than the working tree, put a snapshot first
on ``PYTHONPATH`` (``git archive HEAD fsdp_wrap | tar -x -C /tmp/snap``).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.append(os.path.dirname(_HERE))

_CALLGRIND_C = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(const char *name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
"""


def _callgrind_lib(tmp: str) -> str:
    """A tiny shared library issuing callgrind's client requests (needs gcc and
    valgrind's headers)."""
    src, lib = os.path.join(tmp, "cg.c"), os.path.join(tmp, "libcg.so")
    with open(src, "w") as f:
        f.write(_CALLGRIND_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def _parse_variant(text: str) -> dict[str, Any]:
    parts = text.split("/")
    if parts[0] == "ddp":
        return {"framework": "ddp", "strategy": "-", "orig": None}
    fw, strategy, orig = parts
    return {"framework": fw, "strategy": strategy, "orig": orig.upper().startswith("T")}


class _Done:
    """A finished collective's handle for :func:`_local_collectives`."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _local_collectives() -> Any:
    """Stand-ins for the collectives an FSDP step issues from Python, each doing
    only its local part: a gather writes this rank's row and zeros the others
    (finite values: the step's arithmetic stays the same), a received
    broadcast or message zeros its buffer, an all-reduce leaves it as it is.  Patched over
    ``torch.distributed``'s functions for the ``/nocomm`` rows only (DDP's
    reducer calls its process group from C++ and is not affected)."""
    import contextlib
    from unittest import mock

    import torch.distributed as dist

    def _ret(async_op: bool) -> Any:
        return _Done() if async_op else None

    def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Any:
        if dist.get_rank() != src:
            tensor.zero_()
        return _ret(async_op)

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        return _ret(async_op)

    def all_gather_into_tensor(out: Any, inp: Any, group: Any = None, async_op: bool = False) -> Any:
        rows = out.view(dist.get_world_size(group), -1)
        rows.zero_()
        rows[dist.get_rank(group)].copy_(inp.reshape(-1))
        return _ret(async_op)

    def reduce_scatter_tensor(out: Any, inp: Any, op: Any = None, group: Any = None,
                              async_op: bool = False) -> Any:
        out.view(-1).copy_(inp.view(-1).chunk(dist.get_world_size(group))[dist.get_rank(group)])
        return _ret(async_op)

    def isend(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
        return _Done()

    def irecv(tensor: Any, src: Any = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
        tensor.zero_()
        return _Done()

    stack = contextlib.ExitStack()
    for name, fn in [("broadcast", broadcast), ("all_reduce", all_reduce),
                     ("all_gather_into_tensor", all_gather_into_tensor),
                     ("_all_gather_base", all_gather_into_tensor),
                     ("all_gather_single", all_gather_into_tensor),  # (torch >= 2.13's names)
                     ("reduce_scatter_tensor", reduce_scatter_tensor),
                     ("_reduce_scatter_base", reduce_scatter_tensor),
                     ("reduce_scatter_single", reduce_scatter_tensor),
                     ("isend", isend), ("irecv", irecv)]:
        if hasattr(dist, name):
            stack.enter_context(mock.patch.object(dist, name, fn))
    return stack


def _without_comm(framework: str, model: Any, step: Callable[[int], None]) -> Callable[[int], None]:
    """The same step with no collective: DDP under ``no_sync()``, an FSDP with
    :func:`_local_collectives`.  Its parameters drift from the other rank's
    (each steps on its own gradients); its time is the step's cost less the
    collectives'."""

    def run(i: int) -> None:
        with model.no_sync() if framework == "ddp" else _local_collectives():
            step(i)

    return run


def _waiting(step: Callable[[int], None]) -> Callable[[int], None]:
    """The same step with a prefetch's batched gather waited for at once."""
    from unittest import mock

    import fsdp_wrap.runtime.hooks as hooks

    real = hooks.gather_ahead

    def gather_ahead(handle: Any, cap: int, chain: Any, async_op: bool = False,
                     **kw: Any) -> None:
        real(handle, cap, chain, **kw)  # (synchronous: waited for at once)

    def run(i: int) -> None:
        with mock.patch.object(hooks, "gather_ahead", gather_ahead):
            step(i)

    return run


# Each step's main-thread CPU seconds in three phases (zero_grad, forward and
# loss; backward; the optimizer's step), since the last clear().
_PHASE_LOG: list[tuple[float, float, float]] = []


def _rank_main(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from _bench_models import WORKLOADS, Variant, build, loss_fn, make_batches, make_model

    from fsdp_wrap.comm.teardown import exit_now

    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    import datetime

    # (under callgrind rank 0 is 50-100x slower: the other rank waits in collectives)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(hours=6))
    cg = None
    if rank == 0 and cfg["callgrind_lib"]:
        cg = ctypes.CDLL(cfg["callgrind_lib"])
    device = torch.device("cpu")
    w = WORKLOADS[cfg["workload"]]
    batches = make_batches(w, rank, 4, device)
    import copy

    import torch.distributed.fsdp  # noqa: F401

    import fsdp_wrap  # noqa: F401
    base = make_model(w)
    variants = [Variant(**v) for v in cfg["variants"]]
    models: dict[str, Callable[[int], None]] = {}
    for v in variants:
        model = build(v, copy.deepcopy(base), device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step(i: int, model: Any = model, opt: Any = opt) -> None:
            t0 = time.thread_time()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batches[i % 4]))
            t1 = time.thread_time()
            loss.backward()
            t2 = time.thread_time()
            opt.step()
            _PHASE_LOG.append((t1 - t0, t2 - t1, time.thread_time() - t2))

        models[v.key] = step
        if cfg.get("no_comm"):
            models[v.key + "/nocomm"] = _without_comm(v.framework, model, step)
        if cfg.get("waiting") and v.framework == "fsdp_wrap":
            models[v.key + "/waiting"] = _waiting(step)
    keys = list(models)
    for i in range(cfg["warmup"]):
        for k in keys:
            models[k](i)
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    phases: dict[str, list[list[float]]] = {k: [] for k in keys}  # per round: fwd, bwd, opt
    proc: dict[str, list[float]] = {k: [] for k in keys}
    wall: dict[str, list[float]] = {k: [] for k in keys}
    # (under callgrind every Python instruction is emulated: only the counted steps run)
    for r in range(0 if cfg["callgrind_lib"] else cfg["rounds"]):
        shift = r % len(keys)
        for k in keys[shift:] + keys[:shift]:
            dist.barrier()
            _PHASE_LOG.clear()
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            for i in range(cfg["steps"]):
                models[k](i)
            phases[k].append([sum(col) / len(_PHASE_LOG) for col in zip(*_PHASE_LOG)])
            cpu[k].append((time.thread_time() - c0) / cfg["steps"])
            proc[k].append((time.process_time() - p0) / cfg["steps"])
            wall[k].append((time.perf_counter() - t0) / cfg["steps"])
    calls: dict[str, float] = {}
    for k in keys if not cfg["callgrind_lib"] else []:
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        models[k](0)
        prof.disable()
        calls[k] = pstats.Stats(prof).total_calls  # type: ignore[attr-defined]
        if cfg.get("pstats_dir") and rank == 0:
            prof.dump_stats(os.path.join(cfg["pstats_dir"], k.replace("/", "_") + ".pstats"))
    if cfg["callgrind_lib"]:  # (both ranks run the steps; rank 0 counts them)
        for k in keys:
            dist.barrier()
            if cg is not None:
                cg.cg_start()
            for i in range(cfg["cg_steps"]):
                models[k](i)
            if cg is not None:
                cg.cg_stop(k.encode())
    dist.barrier()
    # each rank's phases (they differ: ranks hold different pieces)
    per_rank: list[Any] = [None, None]
    dist.all_gather_object(per_rank, phases)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"cpu": cpu, "proc": proc, "wall": wall, "calls": calls,
                       "phases": per_rank}, f)
    dist.destroy_process_group()
    exit_now()


def _instructions(outdir: str, keys: list[str]) -> dict[str, int]:
    """Instructions of each dump (callgrind writes one file per ``DUMP_STATS_AT``,
    in order)."""
    dumps = sorted((f for f in os.listdir(outdir) if f.startswith("cg.out")),
                   key=lambda f: int(f.rsplit(".", 1)[-1]) if f.rsplit(".", 1)[-1].isdigit() else 0)
    found: dict[str, int] = {}
    for name in dumps:
        trigger, total = None, None
        with open(os.path.join(outdir, name)) as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    trigger = line.split(": ", 3)[-1].strip()
                elif line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
        if trigger in keys and total is not None:
            found[trigger] = total
    return found


def _print_phases(keys: list[str], per_rank: list[dict[str, list[list[float]]]]) -> None:
    """Each configuration's median CPU ms per phase on each rank (the ranks hold
    different pieces of the model, so their optimizers' work can differ)."""
    print("cpu ms per phase (median over rounds): forward / backward / optimizer")
    for k in keys:
        cells = []
        for rank, phases in enumerate(per_rank):
            med = [statistics.median(col) * 1e3 for col in zip(*phases[k])]
            cells.append(f"rank {rank} " + " / ".join(f"{m:.1f}" for m in med))
        print(f"  {k}: " + ";  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="small")
    p.add_argument("--variants", default="ddp,fsdp_wrap/FULL_SHARD/F,fsdp_wrap/FULL_SHARD/T")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=2, help="steps per configuration and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--callgrind", action="store_true", help="instructions per step (valgrind)")
    p.add_argument("--cg-steps", type=int, default=3, help="steps counted under callgrind")
    p.add_argument("--keep", default=None, help="copy callgrind's output files here")
    p.add_argument("--no-comm", action="store_true",
                   help="add a KEY/nocomm row per configuration: the step without its "
                        "collectives (DDP under no_sync(); FSDPs with local stand-ins)")
    p.add_argument("--pstats", default=None,
                   help="write each configuration's profiled step (cProfile) to DIR/KEY.pstats")
    p.add_argument("--phases", action="store_true",
                   help="also print each rank's CPU ms per phase (forward with the loss, "
                        "backward, optimizer step) for every configuration")
    p.add_argument("--waiting", action="store_true",
                   help="add a KEY/waiting row per fsdp_wrap configuration: a prefetch's batched "
                        "gather waited for at once instead of in flight behind compute")
    args = p.parse_args(argv)
    if args.pstats:
        os.makedirs(args.pstats, exist_ok=True)
    variants = [_parse_variant(v) for v in args.variants.split(",") if v]
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        cfg = {
            "workload": args.workload, "variants": variants, "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup, "cg_steps": args.cg_steps,
            "out": os.path.join(tmp, "out.json"),
            "callgrind_lib": _callgrind_lib(tmp) if args.callgrind else None,
            "pstats_dir": os.path.abspath(args.pstats) if args.pstats else None,
            "no_comm": args.no_comm, "waiting": args.waiting,
        }
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE="2", STEP_COST_CFG=json.dumps(cfg))
        procs = []
        for rank in (0, 1):
            cmd = [sys.executable, os.path.abspath(__file__), "--rank-main"]
            if rank == 0 and args.callgrind:
                cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={tmp}/cg.out", "-q"] + cmd
            procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank))))
        codes = [pr.wait() for pr in procs]
        if any(codes):
            print(f"ranks exited with {codes}")
            return 1
        with open(cfg["out"]) as f:
            res = json.load(f)
        keys = list(res["cpu"])  # (every configuration the ranks ran, in their order)
        instr = _instructions(tmp, keys) if args.callgrind else {}
        if args.keep:
            import shutil

            os.makedirs(args.keep, exist_ok=True)
            for name in os.listdir(tmp):
                if name.startswith("cg.out"):
                    shutil.copy(os.path.join(tmp, name), args.keep)
    print(f"# {args.workload}, {args.rounds} rounds x {args.steps} steps, rank 0; load "
          f"{os.getloadavg()[0]:.1f}; python {' '.join(sys.argv)}")
    if instr:
        header = ["configuration", "Minstr/step"]
        rows = [[k, f"{instr.get(k, 0) / args.cg_steps / 1e6:.1f}"] for k in keys]
    else:
        header = ["configuration", "cpu ms", "proc ms", "wall ms", "calls"]
        rows = [[k, f"{statistics.median(res['cpu'][k]) * 1e3:.1f}",
                 f"{statistics.median(res['proc'][k]) * 1e3:.1f}",
                 f"{statistics.median(res['wall'][k]) * 1e3:.1f}", f"{res['calls'][k]:.0f}"]
                for k in keys]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    rule = "  ".join("=" * n for n in widths)
    print(rule)
    print("  ".join(h.ljust(n) for h, n in zip(header, widths)))
    print(rule)
    for r in rows:
        print("  ".join(c.ljust(n) for c, n in zip(r, widths)))
    print(rule)
    if args.phases and not instr:
        _print_phases(keys, res["phases"])
    for k in keys if not instr else []:
        if k + "/waiting" in res["wall"]:
            ratios = [a / b for a, b in zip(res["wall"][k], res["wall"][k + "/waiting"])]
            print(f"{k}: in flight / waiting {statistics.median(ratios):.3f} "
                  "(median of per-round wall ratios)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank-main"]:
        _rank_main(json.loads(os.environ["STEP_COST_CFG"]))
    sys.exit(main())
