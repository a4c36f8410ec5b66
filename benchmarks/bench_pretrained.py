#!/usr/bin/env python
"""Loading a pretrained model into FSDP units, and streaming its weights out, 2 CPU ranks.

One command::

    python benchmarks/bench_pretrained.py            # LLaMA-shaped, ~300M parameters
    python benchmarks/bench_pretrained.py --tiny     # smoke run

A LLaMA-shaped ``transformers`` model is saved with ``save_pretrained`` in bf16
(several files and an index) and loaded into fp32 FSDP units on 2 gloo ranks,
one decoder layer per unit, three ways, each in fresh processes:

* **fsdp_wrap**: meta device, ``FullyShardedDataParallel(param_init_fn=
  pretrained_init(model, path))``, ``load_pretrained(model, path)``;
* **(a) rank 0 loads, sync**: rank 0 ``from_pretrained``, the other ranks
  build on the meta device, ``sync_module_states=True`` with
  ``param_init_fn=to_empty`` (what Accelerate's ``cpu_ram_efficient_loading``
  does).  Wrapped by fsdp_wrap: torch's FSDP1 refuses ``sync_module_states``
  for CPU tensors ("requires them to be on GPU");
* **(b) every rank loads**: every rank ``from_pretrained``, then wraps; by
  fsdp_wrap and, once more, by torch's FSDP1.

and two rows to read those against: **fp32 shard written once** (each rank
allocates its fp32 shard and converts bf16 from memory into it: what any
loader into fp32 units must do besides reading, the machine's floor), and
**load_pretrained, bf16 units** (the same flow into bf16 units: no conversion,
each rank reads its bytes straight into its shard).  ``--recipes`` runs a
subset (``load_pretrained`` always runs).

Per rank: peak RSS growth (``VmHWM`` after a reset through
``/proc/self/clear_refs``, minus ``VmRSS`` at the start; imports, the process
group and a warm-up done before) and wall time from the first line of the
recipe to the last rank's barrier, and the rank's own CPU time over the
same lines (less sensitive to a machine shared with other work).  Against: the raw time to read every byte of
the checkpoint once (one process, ``readinto``), and the rank's fp32 shard and
largest unit.  Each is measured with the files in the page cache ("warm") and
evicted first (``posix_fadvise(DONTNEED)``, "cold").

Then the export: per-rank peak RSS growth of ``iter_full_weights`` (every rank,
and ``rank0_only``) with a consumer that reduces each tensor and lets it go,
against the two ways without it on the same fsdp_wrap model:
``summon_full_params`` over the model, then ``named_parameters()`` (the same
consumer), and a FULL ``state_dict()``.  (``state_dict()`` inside
``summon_full_params`` is refused, by torch's FSDP1 as by fsdp_wrap.)
Results print as reStructuredText tables (``--json`` also writes them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_launch import launch, rst_table  # noqa: E402
from _bench_measure import PeakMemory, malloc_trim  # noqa: E402

MiB = 2**20
CPU = torch.device("cpu")


def _config(args: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.width,
                       intermediate_size=args.ffn, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def save_checkpoint(args: Any, path: str) -> int:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(args))
    return _save(model, path, args.max_shard_size)


def _save(model: Any, path: str, max_shard_size: Any) -> int:
    model = model.to_empty(device=CPU).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return sum(p.numel() for p in model.parameters())


def _files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def evict(path: str) -> None:
    """Drop the checkpoint's pages from the page cache (clean pages: no root needed)."""
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_once(path: str) -> tuple[float, float]:
    """Wall and CPU seconds to read every byte of the checkpoint once, into one reused buffer."""
    buf = bytearray(64 * MiB)
    view = memoryview(buf)
    t0, c0 = time.perf_counter(), time.process_time()
    for f in _files(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - t0, time.process_time() - c0


# ------------------------------------------------------------------ rank side


def _policy(fsdp_wrap_side: bool) -> Any:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if fsdp_wrap_side:
        from fsdp_wrap.wrap import ModuleWrapPolicy
    else:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return ModuleWrapPolicy({LlamaDecoderLayer})


def _load(how: str, path: str) -> Any:
    """The recipe being measured; returns the wrapped model."""
    from transformers import AutoConfig, LlamaForCausalLM

    if how in ("fsdp_wrap", "fsdp_wrap_bf16"):
        import fsdp_wrap

        cfg = AutoConfig.from_pretrained(path)
        dtype = torch.bfloat16 if how == "fsdp_wrap_bf16" else torch.float32
        with torch.device("meta"):
            model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
        model = fsdp_wrap.FullyShardedDataParallel(
            model, auto_wrap_policy=_policy(True), device_id=CPU,
            param_init_fn=fsdp_wrap.pretrained_init(model, path))
        fsdp_wrap.load_pretrained(model, path)
        return model
    if how == "torch_every_rank":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        return TorchFSDP(model, auto_wrap_policy=_policy(False), device_id=CPU)
    import fsdp_wrap

    if how == "rank0_sync":
        if dist.get_rank() == 0:
            model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            cfg = AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                model = LlamaForCausalLM._from_config(cfg, dtype=torch.float32)
        return fsdp_wrap.FullyShardedDataParallel(
            model, auto_wrap_policy=_policy(True), device_id=CPU, sync_module_states=True,
            param_init_fn=lambda m: m.to_empty(device=CPU, recurse=False))
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    return fsdp_wrap.FullyShardedDataParallel(model, auto_wrap_policy=_policy(True), device_id=CPU)


def _shard_and_unit(model: Any) -> tuple[int, int]:
    """This rank's fp32 shard bytes and the largest unit's unsharded bytes."""
    shard = unit = 0
    for m in model.modules():
        h = getattr(m, "_handle", None)
        if h is not None and hasattr(h, "flat_param"):
            fp = h.flat_param
            shard += fp.numel() * fp.element_size()
            full = getattr(h, "padded_numel", None) or sum(getattr(fp, "_numels", []) or [0])
            unit = max(unit, full * fp.element_size())
    return shard, unit


def job_load(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401

    import fsdp_wrap  # noqa: F401  (imports outside the window)

    mem = PeakMemory(CPU)
    if cfg["how"] == "floor":
        return _floor(cfg, mem)
    # warm-up: the same recipe on a toy checkpoint, so that the window below
    # holds no import or first-call cost (transformers imports lazily)
    _load(cfg["how"], cfg["warm_path"])
    dist.barrier()
    if cfg["cold"] and rank == 0:
        evict(cfg["path"])
    dist.barrier()
    malloc_trim()
    before = mem.current()
    mem.start_window()
    t0, c0 = time.perf_counter(), time.process_time()
    model = _load(cfg["how"], cfg["path"])
    cpu = time.process_time() - c0
    dist.barrier()
    wall = time.perf_counter() - t0
    peak = mem.peak() - before
    shard, unit = _shard_and_unit(model)
    out = dict(peak=peak, wall=wall, cpu=cpu, shard=shard, unit=unit)
    if cfg["how"] == "fsdp_wrap" and cfg["export"]:
        out.update(_export(model, mem))
    return out


def _floor(cfg: dict[str, Any], mem: PeakMemory) -> dict[str, Any]:
    """What any loader into fp32 units must do at least, reading aside: allocate
    this rank's fp32 shard and write every element once, converted from bf16
    (from memory here, already touched)."""
    numel = -(-cfg["params"] // dist.get_world_size())
    src = torch.empty(numel, dtype=torch.bfloat16).fill_(1.0)
    for n in (min(1 << 16, numel), numel):  # (the first, small, is the warm-up)
        dist.barrier()
        malloc_trim()
        before = mem.current()
        mem.start_window()
        t0, c0 = time.perf_counter(), time.process_time()
        shard = torch.empty(n, dtype=torch.float32)
        shard.copy_(src[:n])
        cpu = time.process_time() - c0
        dist.barrier()
        wall = time.perf_counter() - t0
        peak = mem.peak() - before
        del shard
    return dict(peak=peak, wall=wall, cpu=cpu, shard=numel * 4, unit=0)


def _export(model: Any, mem: PeakMemory) -> dict[str, Any]:
    import fsdp_wrap

    FSDP = fsdp_wrap.FullyShardedDataParallel
    out = {}
    for key, rank0_only in (("stream", False), ("stream_rank0", True)):
        malloc_trim()
        before = mem.current()
        mem.start_window()
        total = 0.0
        for _, t in fsdp_wrap.iter_full_weights(model, rank0_only=rank0_only):
            total += float(t.float().sum())  # the consumer: reduce and let go
            del t
        dist.barrier()
        out[key] = mem.peak() - before
    # the two ways to the full weights without the stream: the whole model at once
    malloc_trim()
    before = mem.current()
    mem.start_window()
    with FSDP.summon_full_params(model, writeback=False):
        for _, p in model.named_parameters():
            total += float(p.float().sum())
    dist.barrier()
    out["summon"] = mem.peak() - before
    malloc_trim()
    before = mem.current()
    mem.start_window()
    with FSDP.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    for v in sd.values():
        total += float(v.float().sum())
    del sd
    dist.barrier()
    out["full_state_dict"] = mem.peak() - before
    return out


# ------------------------------------------------------------------- main


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


HOWS = {"fsdp_wrap": "load_pretrained", "rank0_sync": "(a) rank 0 loads, sync",
        "every_rank": "(b) every rank loads", "torch_every_rank": "(b) on torch's FSDP1",
        "floor": "fp32 shard written once",
        "fsdp_wrap_bf16": "load_pretrained, bf16 units"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-shard-size", default="200MB")
    ap.add_argument("--repeat", type=int, default=1, help="runs per recipe (the best time is kept)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (smoke test)")
    ap.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--recipes", default=",".join(HOWS),
                    help=f"comma-separated subset of {','.join(HOWS)} (fsdp_wrap is always run)")
    args = ap.parse_args(argv)
    hows = {h: HOWS[h] for h in HOWS if h == "fsdp_wrap" or h in args.recipes.split(",")}
    if args.tiny:
        args.width, args.ffn, args.layers, args.heads, args.vocab = 64, 128, 2, 4, 256
        args.max_shard_size, args.repeat = "100KB", 1
    root = args.dir or tempfile.mkdtemp(prefix="bench_pretrained_")
    path = os.path.join(root, "llama-bf16")
    warm_path = os.path.join(root, "toy-bf16")
    try:
        n_params = save_checkpoint(args, path)
        toy = argparse.Namespace(**{**vars(args), "width": 32, "ffn": 64, "layers": 2, "heads": 4,
                                    "vocab": 128, "max_shard_size": "20KB"})
        save_checkpoint(toy, warm_path)
        on_disk = sum(os.path.getsize(f) for f in _files(path))
        n_files = len(_files(path))
        base = dict(path=path, warm_path=warm_path, nproc=args.nproc, threads=args.threads,
                    export=False, params=n_params)
        results: dict[str, Any] = {"params": n_params, "bytes_on_disk": on_disk, "runs": {}}
        for cold in (False, True):
            temp = "cold" if cold else "warm"
            reads = []
            for _ in range(args.repeat):
                if cold:
                    evict(path)
                reads.append(read_once(path))
            results[f"read_{temp}"] = min(r[0] for r in reads)
            results[f"read_cpu_{temp}"] = min(r[1] for r in reads)
            for how in hows:
                runs = [launch(job_load, {**base, "how": how, "cold": cold,
                                "export": how == "fsdp_wrap" and not cold})
                        for _ in range(args.repeat)]
                results["runs"][f"{how}/{temp}"] = runs
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nmodel: LLaMA-shaped, {n_params / 1e6:.0f}M parameters, {args.layers} layers; "
          f"checkpoint {_mib(on_disk)} MiB bf16 in {n_files} files; "
          f"{args.nproc} gloo ranks on CPU, {args.threads} thread(s) each\n")
    for temp in ("warm", "cold"):
        read, read_cpu = results[f"read_{temp}"], results[f"read_cpu_{temp}"]
        rows = []
        for how, label in hows.items():
            runs = results["runs"][f"{how}/{temp}"]
            best = min(runs, key=lambda r: max(x["wall"] for x in r))
            wall = max(x["wall"] for x in best)
            for rank, r in enumerate(best):
                peak = max(run[rank]["peak"] for run in runs)
                rows.append([label if rank == 0 else "", str(rank), _mib(peak),
                             _mib(r["shard"]), _mib(r["unit"]),
                             f"{wall:.2f}" if rank == 0 else "",
                             f"{wall / read:.2f}" if rank == 0 else "",
                             f"{r['cpu']:.2f}", f"{r['cpu'] / read_cpu:.2f}"])
        print(f"loading, files {temp} (read once: {read:.2f} s wall, {read_cpu:.2f} s CPU); "
              "peak RSS growth per rank, MiB; seconds\n")
        print(rst_table(["recipe", "rank", "peak RSS growth", "shard", "largest unit",
                      "wall", "x read", "CPU (rank)", "x read CPU"], rows))
        print()
    runs = results["runs"]["fsdp_wrap/warm"]
    rows = []
    for rank in range(args.nproc):
        r = runs[0][rank]
        rows.append([str(rank), _mib(r["shard"]), _mib(r["unit"]),
                     _mib(max(run[rank]["stream"] for run in runs)),
                     _mib(max(run[rank]["stream_rank0"] for run in runs)),
                     _mib(max(run[rank]["summon"] for run in runs)),
                     _mib(max(run[rank]["full_state_dict"] for run in runs))])
    print("export, peak RSS growth per rank above the sharded model (MiB)\n")
    print(rst_table(["rank", "fp32 shard", "largest unit", "iter_full_weights",
                  "iter_full_weights rank0_only", "summon_full_params", "FULL state_dict()"],
                 rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
