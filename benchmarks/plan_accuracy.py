#!/usr/bin/env python
"""How close ``fsdp_wrap.plan`` comes to what training holds (CPU, 2 gloo ranks).

    python benchmarks/plan_accuracy.py                 # every row, ~2 minutes
    python benchmarks/plan_accuracy.py --quick         # a subset (what the test runs)
    python benchmarks/plan_accuracy.py --check 0.10    # exit 1 if a peak is off by >10%
    python benchmarks/plan_accuracy.py --bucket-caps 0,1,8,100   # rows per bucket cap

For each model and configuration the plan is made for world size 2 (no process
group), then the model is wrapped for real on 2 gloo ranks and trained:

* **held**: after the steps, the bytes of the distinct storages behind the
  sharded parameters, their gradients and the optimizer state of FSDP's units,
  against the plan's (must be equal);
* **peak**: glibc's live heap bytes sampled after every op of forward and
  backward (``_live_bytes.py``), above the state before forward (parameters
  and optimizer state, no gradients), the maximum over 3 steps after one
  unmeasured warm-up step (the BLAS library's kept scratch buffers), against the
  plan's ``step_device`` (gradients as they appear, unsharded parameters in
  flight, gradient transients and gloo's staging buffers).  Inputs are one
  sequence of 2 tokens, so activations are negligible.  Where the plan warns
  of units under 1 MiB the peak is shown but not checked: the heap bytes of
  the autograd graph and Python objects, which are no tensors, then dominate.

With ``--device cuda`` the ranks hold CUDA tensors (two gloo ranks sharing one
GPU, each with its own caching allocator) and the peak is the allocator's
``max_memory_allocated`` above ``memory_allocated`` before forward, against the
plan made with ``device="cuda"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_models import WORKLOADS, Block, make_model  # noqa: E402
from _hf_models import HF_MODELS, hf_model, output_tensor  # noqa: E402
from _live_bytes import LivePeak, live_bytes  # noqa: E402

from fsdp_wrap.comm.teardown import exit_now  # noqa: E402

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
#: Below this a CPU peak is mostly the autograd graph's and Python's own heap bytes.
TINY_PEAK = 2 * 2**20


def _gpt2() -> tuple[torch.nn.Module, set[type[torch.nn.Module]], dict[str, torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=2048, n_positions=64)
    return GPT2LMHeadModel(cfg), {GPT2Block}, {"input_ids": torch.randint(0, 2048, (1, 2))}


def _model(name: str) -> tuple[torch.nn.Module, set[type[torch.nn.Module]], dict[str, Any]]:
    """``(model, block classes, forward kwargs)``."""
    if name == "gpt2":
        return _gpt2()
    if name in HF_MODELS:
        return hf_model(name)
    w = dataclasses.replace(WORKLOADS[name], batch=1, seq=2)
    return make_model(w), {Block}, {"x": torch.randn(1, 2, w.dim)}


#: Hugging Face rows (issue 20 item 6): every strategy in fp32, and bf16 compute
#: with use_orig_params, on LLaMA (untied head), BERT (tied MLM decoder) and T5
#: (shared embedding); LoRA on the LLaMA likewise; QLoRA (bf16 storage: no
#: param_dtype cast allowed) every strategy, and FULL_SHARD with use_orig_params.
HF_ROWS: list[dict[str, Any]] = (
    [dict(model=m, strategy=s, uop=False, mp=None)
     for m in ("llama", "bert", "t5", "llama-lora") for s in STRATEGIES]
    + [dict(model=m, strategy=s, uop=True, mp="bf16")
       for m in ("llama", "bert", "t5") for s in STRATEGIES]
    + [dict(model="llama-lora", strategy="FULL_SHARD", uop=True, mp="bf16")]
    + [dict(model="llama-qlora", strategy=s, uop=False, mp=None) for s in STRATEGIES]
    + [dict(model="llama-qlora", strategy="FULL_SHARD", uop=True, mp=None)]
)


def configs(quick: bool, caps: tuple[float | None, ...] = (None,),
            models: str = "all") -> list[dict[str, Any]]:
    """The rows: ``caps`` are gradient bucket caps in MiB (``None``: the default).

    Quick: every strategy in fp32, and bf16 with ``use_orig_params``, on two
    models, at the first cap; at the others FULL_SHARD and NO_SHARD in fp32 and
    the bf16 row (what buckets change: sharded vs all-reduced buffers, casts).
    ``models``: ``"bench"`` (the benchmark's own and GPT-2), ``"hf"`` (the
    Hugging Face rows, :data:`HF_ROWS`, at the default cap), ``"all"`` (both;
    with ``quick`` one LoRA row joins the bench rows), or model names
    separated by commas (their rows of either list).
    """
    if models not in ("all", "bench"):
        names = HF_MODELS if models == "hf" else tuple(models.split(","))
        bench = [c for c in configs(quick, caps, "bench") if c["model"] in names]
        return bench + [dict(c, cap=None) for c in HF_ROWS if c["model"] in names]
    if not quick and models == "all":
        return configs(False, caps, "bench") + [dict(c, cap=None) for c in HF_ROWS]
    if quick:
        rows = [dict(model=m, strategy=s, uop=False, mp=None, cap=caps[0])
                for m in ("compute", "gpt2") for s in STRATEGIES] + [
                dict(model=m, strategy="FULL_SHARD", uop=True, mp="bf16", cap=caps[0])
                for m in ("compute", "gpt2")]
        for cap in caps[1:]:
            rows += [dict(model=m, strategy=s, uop=False, mp=None, cap=cap)
                     for m in ("compute", "gpt2") for s in ("FULL_SHARD", "NO_SHARD")]
            rows += [dict(model=m, strategy="FULL_SHARD", uop=True, mp="bf16", cap=cap)
                     for m in ("compute", "gpt2")]
        if models == "all":
            rows.append(dict(model="llama-lora", strategy="FULL_SHARD", uop=False, mp=None,
                             cap=None))
        return rows
    return [dict(model=m, strategy=s, uop=uop, mp=mp_, cap=cap)
            for cap in caps for m in ("compute", "small", "gpt2")
            for s in STRATEGIES for uop in (False, True) for mp_ in (None, "bf16")]


def measure(cfg: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    import fsdp_wrap as fw
    from fsdp_wrap.wrap import ModuleWrapPolicy

    model, blocks, x = _model(cfg["model"])
    kw: dict[str, Any] = dict(
        auto_wrap_policy=ModuleWrapPolicy(blocks),
        sharding_strategy=fw.ShardingStrategy[cfg["strategy"]],
        use_orig_params=cfg["uop"],
        bucket_cap_mb=cfg.get("cap"),
    )
    if cfg["mp"]:
        kw["mixed_precision"] = fw.MixedPrecision(param_dtype=torch.bfloat16)
    plan = fw.plan(model, dist.get_world_size(), device=device, **kw)
    cuda = device == "cuda"
    if cuda:
        model, x = model.cuda(), {k: v.cuda() for k, v in x.items()}
    real = fw.FullyShardedDataParallel(model, **kw)
    opt = torch.optim.Adam([p for p in real.parameters() if p.requires_grad], lr=1e-4)
    handles = [h for u in fw.FullyShardedDataParallel.fsdp_modules(real) for h in u._handles]
    peak = 0

    def forward_backward() -> None:
        output_tensor(real(**x)).float().pow(2).mean().backward()

    for step in range(1 + 3):
        opt.zero_grad(set_to_none=True)
        if step == 0:
            # Warm-up, not measured: the BLAS library keeps scratch buffers for
            # the matmul shapes it first meets (MKL: 0.5 MiB kept after one
            # 2048x2 @ 2x256 weight gradient), cuBLAS its workspaces.  The plan
            # is of a step in steady state.
            forward_backward()
            opt.step()
            continue
        # With use_orig_params the flat gradients behind the (now None) views
        # are dropped at the next forward; they are not part of the baseline.
        # (Counted once per storage: units reduced in one bucket share one.)
        stale = _storage_bytes(h.flat_param.grad for h in handles)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() - stale
            forward_backward()
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        else:
            base = live_bytes() - stale
            sampler = LivePeak()
            with sampler:
                forward_backward()
            peak = max(peak, sampler.peak - base)
        opt.step()
    params = [h.flat_param for h in handles] + [i.param for h in handles for i in h.infos]
    managed = set(params)
    state = [v for p, st in opt.state.items() if p in managed for v in st.values()
             if torch.is_tensor(v)]
    m = plan.per_rank[dist.get_rank()] if len(plan.per_rank) > 1 else plan.per_rank[0]
    return {
        "held": [_storage_bytes(p.data for p in params), _storage_bytes(p.grad for p in params),
                 _storage_bytes(state)],
        "planned": [m.params_device + m.params_cpu, m.grads_device + m.grads_cpu,
                    m.optimizer_device + m.optimizer_cpu],
        "peak": peak,
        "planned_peak": m.step_device,
        "units": len(plan.units),
        "params": plan.total_params,
        # Below 1 MiB per unit the CPU measurement is dominated by the autograd
        # graph's and Python's own heap bytes, not by tensors; the plan warns.
        "small_units": any("smaller than" in w for w in plan.warnings),
    }


def _storage_bytes(tensors: Any) -> int:
    seen: dict[Any, int] = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr() if st.nbytes() else id(st)] = st.nbytes()
    return sum(seen.values())


def _warm_cuda() -> None:
    """cuBLAS allocates its workspaces through the caching allocator on first use
    and keeps them: take them before the first measured step, not inside it."""
    a = torch.ones(64, 64, device="cuda", requires_grad=True)
    (a @ a).to(torch.bfloat16).float().sum().backward()
    (a.to(torch.bfloat16) @ a.to(torch.bfloat16)).float().sum().backward()
    torch.cuda.synchronize()


def _worker(rank: int, port: int, cfgs: list[dict[str, Any]], out: str, device: str,
            world_size: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" and world_size == 1 else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
        _warm_cuda()
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        results = [measure(c, device) for c in cfgs]
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, results)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(everyone, f)
    finally:
        # Nobody tears the group down while a peer still finishes a collective
        # (gloo aborts the process at exit otherwise).
        dist.barrier()
        dist.destroy_process_group()
    exit_now()  # see fsdp_wrap/comm/teardown.py: gloo's threads vs interpreter shutdown


def run(cfgs: list[dict[str, Any]], device: str = "cpu",
        world_size: int = 2) -> list[list[dict[str, Any]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        mp.start_processes(_worker, args=(port, cfgs, path, device, world_size),
                           nprocs=world_size, start_method="spawn")
        with open(path) as f:
            return json.load(f)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--check", type=float, default=None,
                   help="exit 1 if a held byte count differs or a peak is off by more than this")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: two gloo ranks share one GPU; peak = max_memory_allocated")
    p.add_argument("--world-size", type=int, choices=(1, 2), default=2,
                   help="1 with --device cuda: one rank on NCCL (every strategy runs as NO_SHARD)")
    p.add_argument("--bucket-caps", default="default",
                   help="comma-separated gradient bucket caps in MiB; 'default' is the "
                   "constructor's ($FSDP_WRAP_BUCKET_CAP_MB, else 1) (default: default)")
    p.add_argument("--models", default="all",
                   help="bench (the benchmark's models and GPT-2), hf (LLaMA, BERT, T5, LoRA, "
                   "QLoRA), all, or model names separated by commas (default: all)")
    a = p.parse_args(argv)
    caps = tuple(None if c == "default" else float(c) for c in a.bucket_caps.split(","))
    cfgs = configs(a.quick, caps, a.models)
    results = run(cfgs, a.device, a.world_size)
    mib = 2**20
    rows, bad = [], []
    for i, cfg in enumerate(cfgs):
        worst = max((r[i] for r in results), key=lambda r: abs(r["planned_peak"] / r["peak"] - 1))
        ratio = worst["planned_peak"] / worst["peak"]
        exact = all(r[i]["held"] == r[i]["planned"] for r in results)
        cap = "default" if cfg["cap"] is None else f"{cfg['cap']:g}"
        dtype = cfg["mp"] or ("nf4/bf16" if cfg["model"] == "llama-qlora" else "fp32")
        rows.append([cfg["model"], cfg["strategy"], str(cfg["uop"]), dtype, cap,
                     "yes" if exact else "NO", f"{worst['peak'] / mib:.2f}",
                     f"{worst['planned_peak'] / mib:.2f}", f"{ratio:.2f}"])
        # The CUDA allocator counts tensor bytes only: small units are checked there.
        # A step that adds under TINY_PEAK (NO_SHARD LoRA: nothing gathered, the
        # adapters' gradients a few KiB) measures the heap's non-tensor bytes.
        checked = a.device == "cuda" or not (worst["small_units"] or worst["peak"] < TINY_PEAK)
        if not checked:
            why = "small units" if worst["small_units"] else "tiny peak"
            rows[-1][-1] += f" ({why}: not checked)"
        if not exact or (a.check is not None and checked and abs(ratio - 1) > a.check):
            bad.append(f"{cfg}: held {[r[i]['held'] for r in results]} planned "
                       f"{[r[i]['planned'] for r in results]}; peak ratio {ratio:.3f}")
    header = ["model", "strategy", "orig", "dtype", "cap MiB", "held = plan", "peak MiB", "plan MiB", "plan/peak"]
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    rule = "  ".join("=" * w for w in widths)
    print(rule)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print(rule)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(rule)
    for line in bad:
        print("OFF:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
