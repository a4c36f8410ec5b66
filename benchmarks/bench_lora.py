#!/usr/bin/env python
"""LoRA and QLoRA training steps on a LLaMA, 2 CPU ranks: what a rank holds and how
long a step takes, fsdp_wrap against torch's FSDP1 and against the ideal.

    python benchmarks/bench_lora.py                 # LLaMA-shaped, 302M parameters (~25 min: QLoRA is slow on CPU)
    python benchmarks/bench_lora.py --size tiny     # the 2-layer model of tests/test_peft.py (smoke)
    python benchmarks/bench_lora.py --json out.json

The model (``benchmarks/_lora_models.py``): ``--size 300m`` is the LLaMA shape
of ``bench_pretrained.py`` (hidden 1024, ffn 2816, 20 layers, 16 heads, vocab
32000, untied head), random init with seed 0 on every rank, PEFT LoRA r=8 on
``q_proj`` and ``v_proj``.  Rows:

* **LoRA**: fp32 base and adapters;
* **QLoRA**: the decoder layers' Linears bitsandbytes NF4 (bf16 quantization
  storage), the rest of the base and the adapters bf16;
* **QLoRA, fp32 adapters** (``--size tiny`` only by default): PEFT's default
  adapters beside the bf16 base, which torch's FSDP1 refuses (mixed dtypes).

Each by torch's FSDP1 with ``use_orig_params=True`` (the only way it runs a
unit mixing frozen and trainable weights) and by fsdp_wrap with either
``use_orig_params``; FULL_SHARD, one unit per decoder layer, AdamW over the
trainable parameters, each row in fresh processes (one thread each).

Per rank:

* **grad**: bytes of the distinct storages behind every gradient the rank
  holds after a backward (flat and original parameters), and that over the
  **ideal**, the rank's share of the trainable parameters (trainable elements
  x itemsize / world size; padding of the trainable flat parameters adds a
  little);
* **optim**: bytes of AdamW's state tensors after a step, over twice the ideal
  (``exp_avg`` and ``exp_avg_sq``; the ``step`` scalars add a few bytes);
* **held**: RSS between steps (after ``zero_grad``) above the RSS before the
  model was built: shards, optimizer state, whatever the implementation keeps;
* **peak**: the highest RSS over a measured step above that same baseline
  (``VmHWM`` reset through ``/proc/self/clear_refs`` at the step's start), the
  largest of the measured steps; **growth** is peak minus held;
* **step**: median wall seconds of the measured steps (barrier to barrier,
  after ``--warmup`` steps), and the median CPU seconds of the rank's process
  (all its threads; less sensitive to a shared machine).

The frozen weights' bytes over the world size (the frozen elements x their
itemsize / world size) bound what torch's FSDP1 holds beyond the ideal: it
keeps a gradient for every frozen weight in a unit that also trains (not for
a unit that is all frozen, such as the root's embedding and head here).  Needs ``peft`` and,
for the QLoRA rows, ``bitsandbytes >= 0.50`` (``pip install .[finetune]``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_launch import launch, rst_table  # noqa: E402
from _bench_measure import PeakMemory, malloc_trim  # noqa: E402
from _lora_models import (  # noqa: E402
    SIZES,
    decoder_layer_class,
    grad_bytes,
    lora_llama,
    optimizer_bytes,
    trainable_bytes,
)

MiB = 2**20
CPU = torch.device("cpu")

# (kind, implementation, use_orig_params)
ROWS = [
    ("lora", "torch", True),
    ("lora", "fsdp_wrap", True),
    ("lora", "fsdp_wrap", False),
    ("qlora", "torch", True),
    ("qlora", "fsdp_wrap", True),
    ("qlora", "fsdp_wrap", False),
    ("qlora-fp32", "torch", True),
    ("qlora-fp32", "fsdp_wrap", False),
]
KINDS = {"lora": "LoRA (fp32)", "qlora": "QLoRA (NF4, bf16 adapters)",
         "qlora-fp32": "QLoRA (NF4, fp32 adapters)"}
IMPLS = {"torch": "torch FSDP1", "fsdp_wrap": "fsdp_wrap"}


# ------------------------------------------------------------------ rank side


def _wrap(impl: str, model: torch.nn.Module, uop: bool) -> torch.nn.Module:
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as F
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        from fsdp_wrap import FullyShardedDataParallel as F  # type: ignore[assignment]
        from fsdp_wrap.wrap import ModuleWrapPolicy  # type: ignore[assignment]
    return F(model, auto_wrap_policy=ModuleWrapPolicy({decoder_layer_class()}),
             use_orig_params=uop, device_id=CPU)


def _imports(cfg: dict[str, Any]) -> None:
    """Everything the row imports, before any window (transformers imports lazily)."""
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401

    import fsdp_wrap  # noqa: F401

    decoder_layer_class()
    if cfg["kind"].startswith("qlora"):
        import bitsandbytes  # noqa: F401


def run_row(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Build, wrap and train one row on this rank; its measurements."""
    _imports(cfg)
    ws = dist.get_world_size()
    mem = PeakMemory(CPU)
    malloc_trim()
    base_rss = mem.current()
    model = lora_llama(cfg["size"], quantized=cfg["kind"].startswith("qlora"),
                       bf16_adapters=cfg["kind"] == "qlora")
    out: dict[str, Any] = dict(
        params=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        ideal=trainable_bytes(model) / ws,
        frozen_grad=sum(p.numel() * p.element_size() for p in model.parameters()
                        if not p.requires_grad) / ws)
    try:
        model = _wrap(cfg["impl"], model, cfg["uop"])
    except Exception as e:  # noqa: BLE001  (a refusal: raised alike on every rank, before any collective)
        return {**out, "error": str(e).strip().splitlines()[0][:160]}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = SIZES[cfg["size"]]["vocab_size"]

    def step(i: int) -> float:
        gen = torch.Generator().manual_seed(1000 * i + rank)
        ids = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if i == cfg["warmup"] - 1:  # the last warm-up step: not timed
            out["grad"] = grad_bytes(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach().float())

    losses = [step(i) for i in range(cfg["warmup"])]
    out["optim"] = optimizer_bytes(opt)
    walls, cpus, peaks, helds = [], [], [], []
    for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        gc.collect()
        mem.start_window()  # malloc_trim, then VmHWM := VmRSS
        helds.append(mem.current() - base_rss)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(i))
        dist.barrier()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        peaks.append(mem.peak() - base_rss)
    mean = torch.tensor(losses)
    dist.all_reduce(mean)
    out.update(wall=statistics.median(walls), cpu=statistics.median(cpus), walls=walls,
               held=statistics.median(helds), peak=max(peaks),
               losses=[round(x, 4) for x in (mean / ws).tolist()])
    return out


# ------------------------------------------------------------------- report


def _mib(n: float) -> str:
    return f"{n / MiB:,.2f}" if abs(n) < 10 * MiB else f"{n / MiB:,.0f}"


HEADER = ["model", "implementation", "orig params", "rank", "grad MiB", "x ideal", "optim MiB",
          "x 2 ideal", "held MiB", "peak MiB", "growth MiB", "step s", "CPU s"]


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for res in results:
        for rank, r in enumerate(res["ranks"]):
            label = [KINDS[res["kind"]], IMPLS[res["impl"]], str(res["uop"])] if rank == 0 else ["", "", ""]
            if "error" in r:
                rows.append(label + [str(rank), "(1)" if "crashed" in r["error"] else "refused (1)"]
                            + [""] * 8)
                continue
            rows.append(label + [str(rank), _mib(r["grad"]), f"{r['grad'] / r['ideal']:.2f}",
                                 _mib(r["optim"]), f"{r['optim'] / (2 * r['ideal']):.2f}",
                                 _mib(r["held"]), _mib(r["peak"]), _mib(r["peak"] - r["held"]),
                                 f"{r['wall']:.2f}", f"{r['cpu']:.2f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="300m")
    ap.add_argument("--only", default="", help="kinds to run, comma-separated: "
                    "lora,qlora,qlora-fp32 (default: all for tiny, lora,qlora otherwise)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per row")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (gradient bytes are taken in the last warm-up step)")
    kinds = args.only.split(",") if args.only else (
        list(KINDS) if args.size == "tiny" else ["lora", "qlora"])
    results = []
    t0 = time.perf_counter()
    for kind, impl, uop in ROWS:
        if kind not in kinds:
            continue
        cfg = dict(size=args.size, kind=kind, impl=impl, uop=uop, batch=args.batch, seq=args.seq,
                   warmup=args.warmup, steps=args.steps, nproc=args.nproc, threads=args.threads)
        try:
            ranks = launch(run_row, cfg)
        except Exception as e:  # noqa: BLE001  (a crashed row is reported, the others still run)
            ranks = [{"error": f"crashed: {str(e).strip().splitlines()[-1][:160]}"}] * args.nproc
        results.append(dict(kind=kind, impl=impl, uop=uop, ranks=ranks))
        print(f"  {kind} {impl} use_orig_params={uop}: done ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    first = next((r for res in results for r in res["ranks"] if "params" in r), None)
    size = (f"{first['params'] / 1e6:.1f}M parameters, LoRA r=8 on q_proj,v_proj: "
            f"{first['trainable'] / 1e6:.3f}M trainable" if first else "not built")
    print(f"\nmodel: LLaMA ({args.size}), {size}; "
          f"{args.nproc} gloo ranks on CPU, {args.threads} thread(s) each; "
          f"batch {args.batch} x {args.seq} tokens; {args.warmup} warm-up + {args.steps} measured steps\n")
    for kind in kinds:
        ok = [r for res in results if res["kind"] == kind for r in res["ranks"] if "error" not in r]
        if ok:
            print(f"{KINDS[kind]}: ideal (trainable share) {_mib(ok[0]['ideal'])} MiB per rank, "
                  f"frozen weights / world size {_mib(ok[0]['frozen_grad'])} MiB (their gradient "
                  "bytes, were they all held)")
    print()
    print(rst_table(HEADER, table_rows(results)))
    for res in results:
        if "error" in res["ranks"][0]:
            print(f"  (1) {res['kind']} {res['impl']} uop={res['uop']}: {res['ranks'][0]['error']}")
    for res in results:
        losses = [r.get("losses") for r in res["ranks"][:1]]
        print(f"  losses {res['kind']} {res['impl']} uop={res['uop']}: {losses[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
