#!/usr/bin/env python
"""Checkpoint costs: fsdp_wrap against torch's FSDP1 on the same model, 2 CPU ranks.

One command::

    python benchmarks/bench_checkpoint.py                 # ~400M parameters (needs ~40 GB RAM)
    python benchmarks/bench_checkpoint.py --width 1024 --blocks 4 --vocab 8000   # smaller
    python benchmarks/bench_checkpoint.py --tiny          # smoke run

Every measurement runs in fresh processes (an allocator's high-water mark cannot
be separated between frameworks sharing a process).  Peak RSS growth is the
``VmHWM`` reached during the window minus ``VmRSS`` at its start (the
high-water mark is reset through ``/proc/self/clear_refs`` and freed heap
memory trimmed first).  Bytes moved are the payloads of the ``c10d`` ops the
framework issues while building or loading the state dicts, counted at the
dispatcher: what lands on the rank (all-gather and all-to-all outputs, gather
outputs on the destination, broadcast tensors); DCP's own small planning
exchanges are not counted.

1. **SHARDED save and load** (model + Adam state, DCP): per rank, bytes moved
   and peak RSS growth, fsdp_wrap vs torch's FSDP1.
2. **Full save**: rank 0's peak RSS growth for fsdp_wrap's
   ``save_full_checkpoint`` (safetensors, streamed) vs torch's FSDP1
   ``FULL_STATE_DICT`` with ``rank0_only=True`` and ``torch.save``.
3. **Offline consolidation** of the SHARDED checkpoint to one ``torch.save``
   file: ``fsdp-wrap ckpt consolidate`` vs torch's ``dcp_to_torch_save``, one
   process each.

Results are printed as reStructuredText tables (``--json`` also writes them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_launch import launch as run_on_ranks  # noqa: E402
from _bench_launch import rst_table  # noqa: E402
from _bench_measure import CollectiveCounter, PeakMemory, malloc_trim  # noqa: E402

MiB = 2**20
CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, blocks: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(blocks)))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


def _build(framework: str, cfg: dict[str, Any], seed: int) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    module = Model(cfg["vocab"], cfg["width"], cfg["blocks"])
    if framework == "fsdp_wrap":
        import fsdp_wrap as F
        from fsdp_wrap.wrap import ModuleWrapPolicy
    else:
        import torch.distributed.fsdp as F  # type: ignore[no-redef]
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # type: ignore[no-redef]
    model = F.FullyShardedDataParallel(
        module, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=CPU
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt, F


def _step(model: nn.Module, opt: Any) -> None:
    model(torch.randint(0, 100, (2, 4))).float().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class Window:
    """Over a region of this rank: peak RSS growth, what stayed (the result), and the
    c10d bytes of the calls made under :meth:`counted`."""

    def __init__(self, count: bool = True) -> None:
        self.mem = PeakMemory(CPU)
        self.counter = CollectiveCounter() if count else None

    def __enter__(self) -> Window:
        malloc_trim()
        self.mem.start_window()
        self.base = self.mem.current()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = self.mem.peak() - self.base
        malloc_trim()
        self.kept = max(0, self.mem.current() - self.base)

    @property
    def transient(self) -> int:
        """Peak memory beyond what the region returned (buffers, gathered copies)."""
        return self.peak - self.kept

    def counted(self) -> Any:
        return self.counter if self.counter is not None else _Null()

    @property
    def bytes(self) -> int:
        return 0 if self.counter is None else int(sum(self.counter.bytes.values()))


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ------------------------------------------------------------------- jobs


def job_sharded(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    fw = cfg["framework"]
    path = cfg["path"]
    model, opt, F = _build(fw, cfg, seed=0)
    _step(model, opt)
    FSDP = F.FullyShardedDataParallel
    sd_type = F.StateDictType.SHARDED_STATE_DICT
    with Window() as save:
        with FSDP.state_dict_type(model, sd_type), save.counted():
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    del state
    other, other_opt, _ = _build(fw, cfg, seed=1)
    _step(other, other_opt)  # the optimizer template needs state
    with FSDP.state_dict_type(other, sd_type):
        with Window() as template, template.counted():
            state = {"model": other.state_dict(), "optim": FSDP.optim_state_dict(other, other_opt)}
        dcp.load(state, checkpoint_id=path)
        with Window() as load_model, load_model.counted():
            other.load_state_dict(state["model"])
        with Window() as load_optim, load_optim.counted():
            osd = FSDP.optim_state_dict_to_load(other, other_opt, state["optim"])
        other_opt.load_state_dict(osd)
        del state, osd
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "shard_bytes": shard,
        "save_bytes": save.bytes, "save_peak": save.peak, "save_kept": save.kept,
        "save_transient": save.transient,
        "template_bytes": template.bytes, "template_transient": template.transient,
        "load_bytes": load_model.bytes + load_optim.bytes,
        "load_transient": max(load_model.transient, load_optim.transient),
    }


def job_full(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    fw = cfg["framework"]
    path = cfg["path"]
    from fsdp_wrap.checkpoint import save_full_checkpoint  # imports are not data

    model, opt, F = _build(fw, cfg, seed=0)
    _step(model, opt)
    FSDP = F.FullyShardedDataParallel
    with Window(count=False) as w:
        if fw == "fsdp_wrap":
            save_full_checkpoint(model, path, max_shard_size=cfg["max_shard_size"])
        else:
            # torch's FSDP1 cannot offload_to_cpu on a CPU-only host; on CPU it is the same
            config = F.FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
            with FSDP.state_dict_type(model, F.StateDictType.FULL_STATE_DICT, config):
                sd = model.state_dict()
            if rank == 0:
                os.makedirs(path, exist_ok=True)
                torch.save(sd, os.path.join(path, "model.pt"))
            del sd
            dist.barrier()
    return {"peak": w.peak}


JOBS = {"sharded": job_sharded, "full": job_full}


def launch(job: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Job ``job`` of :data:`JOBS` on fresh ranks (``_bench_launch.launch``)."""
    result: list[dict[str, Any]] = run_on_ranks(JOBS[job], cfg)
    return result


_CONSOLIDATE = """
import ctypes, os, sys, tempfile, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
import torch._subclasses.fake_tensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from fsdp_wrap.checkpoint import offline
src, out, how = sys.argv[1:4]
run = offline.consolidate if how == "fsdp_wrap" else dcp_to_torch_save
tiny = tempfile.mkdtemp()
dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=os.path.join(tiny, "d"), no_dist=True)
run(os.path.join(tiny, "d"), os.path.join(tiny, "o.pt"))  # warm up: imports, caches
def status(field):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
run(src, out)
print(status("VmHWM") - before)
"""


def consolidate_peak(src: str, out: str, how: str) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]
    ))
    proc = subprocess.run([sys.executable, "-c", _CONSOLIDATE, src, out, how],
                          capture_output=True, text=True, env=env, check=True)
    return int(proc.stdout.split()[-1])


# ------------------------------------------------------------------- main


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--max-shard-size", type=int, default=1 << 30)
    ap.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.width, args.blocks, args.vocab, args.max_shard_size = 64, 2, 256, 100_000
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    os.makedirs(root, exist_ok=True)
    n_params = sum(p.numel() for p in Model(args.vocab, args.width, args.blocks).parameters())
    base = {k: getattr(args, k) for k in ("width", "blocks", "vocab", "nproc", "threads")}
    base["max_shard_size"] = args.max_shard_size
    results: dict[str, Any] = {"params": n_params, "config": base}
    try:
        sharded = {}
        for fw in ("torch_fsdp1", "fsdp_wrap"):
            sharded[fw] = launch("sharded", {**base, "framework": fw, "path": os.path.join(root, f"dcp-{fw}")})
        full = {}
        for fw in ("torch_fsdp1", "fsdp_wrap"):
            full[fw] = launch("full", {**base, "framework": fw, "path": os.path.join(root, f"full-{fw}")})
        consolidate = {
            how: consolidate_peak(os.path.join(root, "dcp-fsdp_wrap"), os.path.join(root, f"c-{how}.pt"), how)
            for how in ("fsdp_wrap", "dcp_to_torch_save")
        }
        sizes = {
            "dcp": sum(os.path.getsize(os.path.join(root, "dcp-fsdp_wrap", f))
                       for f in os.listdir(os.path.join(root, "dcp-fsdp_wrap"))),
        }
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    results.update(sharded=sharded, full=full, consolidate=consolidate, sizes=sizes)

    print(f"\nmodel: {n_params / 1e6:.0f}M parameters ({_mib(4 * n_params)} MiB fp32), "
          f"{args.nproc} gloo ranks on CPU, Adam\n")
    rows = []
    for r in range(args.nproc):
        t, o = sharded["torch_fsdp1"][r], sharded["fsdp_wrap"][r]
        t_load = t["template_bytes"] + t["load_bytes"]
        o_load = o["template_bytes"] + o["load_bytes"]
        rows.append([
            str(r), _mib(t["shard_bytes"]), _mib(o["save_kept"]),
            _mib(t["save_bytes"]), _mib(o["save_bytes"]), f"{o['save_bytes'] / max(t['save_bytes'], 1):.2f}",
            _mib(t["save_transient"]), _mib(o["save_transient"]),
            _mib(t_load), _mib(o_load), f"{o_load / max(t_load, 1):.2f}",
            _mib(max(t["template_transient"], t["load_transient"])),
            _mib(max(o["template_transient"], o["load_transient"])),
        ])
    print("SHARDED_STATE_DICT save and load, model + Adam state (MiB per rank).  bytes: moved by\n"
          "the state-dict calls; transient: peak RSS beyond what the call returns (load: the\n"
          "largest of the template's state dicts, load_state_dict, optim_state_dict_to_load)\n")
    print(rst_table(["rank", "param shard", "state dict", "save bytes torch", "ours", "ratio",
                  "save transient torch", "ours", "load bytes torch", "ours", "ratio",
                  "load transient torch", "ours"], rows))
    t0, o0 = full["torch_fsdp1"][0]["peak"], full["fsdp_wrap"][0]["peak"]
    print("\nfull checkpoint, rank 0 peak RSS growth (MiB)\n")
    print(rst_table(["torch FULL_STATE_DICT rank0_only + torch.save", "save_full_checkpoint", "ratio"],
                 [[_mib(t0), _mib(o0), f"{t0 / max(o0, 1):.1f}x less"]]))
    c_ours, c_torch = consolidate["fsdp_wrap"], consolidate["dcp_to_torch_save"]
    print(f"\noffline consolidation of the SHARDED checkpoint ({_mib(sizes['dcp'])} MiB on disk), "
          "peak RSS growth (MiB)\n")
    print(rst_table(["dcp_to_torch_save", "fsdp-wrap ckpt consolidate", "ratio"],
                 [[_mib(c_torch), _mib(c_ours), f"{c_torch / max(c_ours, 1):.1f}x less"]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
