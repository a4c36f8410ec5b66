#!/usr/bin/env python
"""TRL's trainers on a LLaMA, 2 CPU ranks: fsdp_wrap (through ``install()``)
against torch's FSDP1, each through TRL, Accelerate's FSDP1 plugin and PEFT
as shipped.

    python benchmarks/bench_trl.py                    # 302M LLaMA: SFT QLoRA, DPO and GRPO LoRA
    python benchmarks/bench_trl.py --size tiny        # the tests' 2-layer model (smoke, ~2 min)
    python benchmarks/bench_trl.py --only sft --repeats 2 --json out.json
    python benchmarks/bench_trl.py --only grpo --impls torch:True,fsdp_wrap:True

Rows (each in fresh ``torchrun`` processes, one thread per rank; torch's FSDP1
and fsdp_wrap alternate, starting with the other one on each repeat, so that
a shared machine's load falls on both alike):

* **SFT QLoRA**: ``SFTTrainer``, the base loaded in NF4 with bf16 storage
  through transformers' ``BitsAndBytesConfig`` (the QLoRA recipe for FSDP:
  the ``Trainer`` then sets FSDP's mixed precision to the storage dtype), LoRA
  r=8 on ``q_proj`` and ``v_proj`` (TRL casts the adapters to bf16), TRL's
  default ``bf16=True``; ``use_orig_params=True`` for torch, both for fsdp_wrap;
* **DPO LoRA** and **GRPO LoRA**: fp32 base and adapters (``bf16=False``: with
  FSDP1, GRPO's generation runs the summoned root in full precision beside
  units computing in bf16, which fails on torch's FSDP1 and fsdp_wrap alike);
  the reference model is the policy with its adapter disabled; GRPO
  generates 2 completions of 8 tokens per prompt with the policy itself.

The ``Trainer`` wraps with PEFT's policy: every LoRA ``Linear`` and every
decoder layer a unit of its own.  FULL_SHARD, batch 1 per rank, AdamW.  Per
rank, over the measured steps (after ``--warmup``):

* **grad**: bytes of the distinct storages behind every gradient held just
  before the optimizer step (flat and original parameters), over the
  **ideal**, the rank's share of the trainable bytes (in the dtype they train
  in: Accelerate upcasts trainable flat parameters to fp32 under mixed
  precision, QLoRA's bf16 adapters included);
* **held**: RSS at a step's start above the RSS before the model was loaded;
  **peak**: the highest RSS during a step above that baseline (``VmHWM`` reset
  at the step's start); the largest over the measured steps;
* **step**: median wall seconds (the ``Trainer``'s step, GRPO's generation
  included) and median CPU seconds of the rank's process.

After training, fsdp_wrap's rows save with ``trainer.save_model`` (FULL) and
rank 0 reloads the adapter into a plain base with ``PeftModel.from_pretrained``:
**adapter KiB** is the file, **logits diff** the largest difference between the
reloaded model's logits and the wrapped model's, computed alike (FSDP's mixed
precision, the trainer's autocast).  torch's rows do not save: their FULL save
with ``offload_to_cpu`` (what the ``Trainer`` asks for) crashes on CPU, and
PEFT as shipped would write an empty adapter.  GRPO rows also count the
all-gathers (and broadcasts) of one untimed 8-token generation, per token.
Needs ``pip install -e ".[trl]"``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.append(ROOT)

MiB = 2**20
GROUPS = {  # algo/kind -> (label, use_orig_params per implementation)
    "sft": ("SFT QLoRA (NF4, bf16)", "qlora"),
    "dpo": ("DPO LoRA (fp32)", "lora"),
    "grpo": ("GRPO LoRA (fp32)", "lora"),
}


# ------------------------------------------------------------------ rank side


def _trainer(cfg: dict[str, Any], base: str, out: str, callback: Any) -> Any:
    from _trl_models import accelerate_on_cpu, load, lora, sentences, tokenizer
    from datasets import Dataset

    algo, kind = cfg["algo"], GROUPS[cfg["algo"]][1]
    seq = cfg["seq"]
    common = dict(output_dir=out, per_device_train_batch_size=1, max_steps=cfg["warmup"] + cfg["steps"],
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  ddp_backend="gloo", seed=0, data_seed=0, dataloader_num_workers=0,
                  disable_tqdm=True, learning_rate=1e-4, fsdp="full_shard auto_wrap",
                  fsdp_config={"version": 1,
                               "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                               "state_dict_type": "FULL_STATE_DICT",
                               "use_orig_params": cfg["uop"], "sync_module_states": False,
                               "cpu_ram_efficient_loading": False})
    kw: dict[str, Any] = dict(model=load(base, kind), processing_class=tokenizer(),
                              peft_config=lora(kind, r=8), callbacks=[callback])
    n = 8 * (cfg["warmup"] + cfg["steps"])
    if algo == "sft":
        from trl import SFTConfig as Config
        from trl import SFTTrainer as Trainer

        kw["train_dataset"] = Dataset.from_dict({"text": sentences(n, seq, seq, seed=0)})
        conf = Config(**common, max_length=seq)
    elif algo == "dpo":
        from trl import DPOConfig as Config  # type: ignore[assignment]
        from trl import DPOTrainer as Trainer  # type: ignore[assignment]

        kw["train_dataset"] = Dataset.from_dict({
            "prompt": sentences(n, seq // 2, seq // 2, seed=1),
            "chosen": sentences(n, seq // 2, seq // 2, seed=2),
            "rejected": sentences(n, seq // 2, seq // 2, seed=3)})
        conf = Config(**common, max_length=seq, bf16=False)
    else:
        from trl import GRPOConfig as Config  # type: ignore[assignment]
        from trl import GRPOTrainer as Trainer  # type: ignore[assignment]

        kw["train_dataset"] = Dataset.from_dict({"prompt": sentences(n, seq, seq, seed=4)})
        kw["reward_funcs"] = _reward
        common["per_device_train_batch_size"] = 2
        conf = Config(**common, num_generations=2, max_completion_length=8, beta=0.04,
                      temperature=1.0, bf16=False)
    accelerate_on_cpu()  # (after the arguments, which reset Accelerate's state)
    return Trainer(args=conf, **kw)


def _reward(completions: list[str], **kw: Any) -> list[float]:
    return [float(len(set(c.split()))) for c in completions]


def _measuring_callback(cfg: dict[str, Any], base_rss: int) -> Any:
    import torch
    import torch.distributed as dist
    from _bench_measure import PeakMemory, malloc_trim
    from _lora_models import grad_bytes
    from transformers import TrainerCallback

    mem = PeakMemory(torch.device("cpu"))

    class Measure(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.grad: list[int] = []
            self.grad_itemsize = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            gc.collect()
            malloc_trim()
            mem.start_window()
            self.held = mem.current() - base_rss
            dist.barrier()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None,
                                  **kw: Any) -> None:
            self.grad.append(grad_bytes(model))
            held = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
            self.grad_itemsize = self.grad_itemsize or (held[0].element_size() if held else 0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            dist.barrier()
            self.steps.append(dict(wall=time.perf_counter() - self.t0,
                                   cpu=time.process_time() - self.c0,
                                   peak=mem.peak() - base_rss, held=self.held))

    return Measure()


def _save_and_reload(tr: Any, cfg: dict[str, Any], base: str, out: str) -> dict[str, Any]:
    """fsdp_wrap's rows: ``save_model`` (FULL), reloaded on rank 0 beside the
    wrapped model's logits, computed alike."""
    import torch.distributed as dist
    from _trl_models import adapter_file, as_wrapped_computes, load, logits

    final = os.path.join(out, "final")
    tr.save_model(final)
    dist.barrier()
    ids = [[1, 4, 6, 8, 9, 4, 10, 5, 7, 2]]
    wrapped = logits(tr.model_wrapped, ids)
    res: dict[str, Any] = {}
    if dist.get_rank() == 0:
        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(load(base, GROUPS[cfg["algo"]][1]), final)
        same = logits(as_wrapped_computes(reloaded, tr.model_wrapped), ids, bf16=tr.args.bf16)
        res = dict(adapter_bytes=os.path.getsize(adapter_file(final)),
                   logits_diff=(same - wrapped).abs().max().item(),
                   logits_max=wrapped.abs().max().item())
        del reloaded
    dist.barrier()
    return res


def _gathers_per_token(tr: Any) -> list[float]:
    """Collectives (all-gathers, broadcasts, exchanges) and their bytes per token in one
    8-token greedy generation, as GRPO's generation runs it under FSDP1."""
    import torch
    from _bench_measure import CollectiveCounter
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from trl.models import unwrap_model_for_generation

    model = tr.model_wrapped
    ids = torch.tensor([[1, 4, 6, 8]])
    with (unwrap_model_for_generation(model, tr.accelerator) as unwrapped, torch.no_grad(),
          FSDP.summon_full_params(model, recurse=False)):
        counter = CollectiveCounter()
        with counter:
            new = unwrapped.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False).shape[1] - ids.shape[1]
    calls, nbytes = counter.gathers()
    return [calls / new, nbytes / new]


def run_row(cfg: dict[str, Any], base: str, out: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from _bench_measure import PeakMemory, malloc_trim

    torch.set_num_threads(1)
    if cfg["impl"] == "fsdp_wrap":
        import fsdp_wrap

        fsdp_wrap.install(verbose=False)
    import peft  # noqa: F401  (imports before the baseline: not the model's memory)
    import transformers  # noqa: F401
    import trl  # noqa: F401

    if GROUPS[cfg["algo"]][1] == "qlora":
        import bitsandbytes  # noqa: F401
    malloc_trim()
    base_rss = PeakMemory(torch.device("cpu")).current()
    measure = _measuring_callback(cfg, base_rss)
    tr = _trainer(cfg, base, out, measure)
    ws = dist.get_world_size()
    trainable = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    load_before = os.getloadavg()[0]
    tr.train()
    # The ideal is in the dtype of the gradients held, read from one (with QLoRA's
    # bf16 adapters, Accelerate's upcast of trainable flat parameters makes them fp32).
    itemsize = measure.grad_itemsize or next(
        p for p in tr.model_wrapped.parameters() if p.requires_grad).element_size()
    ideal = trainable * itemsize / ws
    measured = measure.steps[cfg["warmup"]:]
    res: dict[str, Any] = dict(
        cls=type(tr.model_wrapped).__module__, ideal=ideal, trainable=trainable,
        grad_itemsize=itemsize,
        load=[load_before, os.getloadavg()[0]],
        params=sum(p.numel() for p in tr.model.parameters()),  # (this rank's, as wrapped)
        grad=max(measure.grad[cfg["warmup"]:] or [0]),
        wall=statistics.median(s["wall"] for s in measured),
        cpu=statistics.median(s["cpu"] for s in measured),
        walls=[round(s["wall"], 2) for s in measured],
        peak=max(s["peak"] for s in measured), held=statistics.median(s["held"] for s in measured),
        losses=[h["loss"] for h in tr.state.log_history if "loss" in h])
    if cfg["algo"] == "grpo":
        res["gathers"] = _gathers_per_token(tr)
    if cfg["impl"] == "fsdp_wrap":
        res.update(_save_and_reload(tr, cfg, base, out))
    return res


def worker(cfg_json: str, base: str, out: str) -> None:
    import torch.distributed as dist
    from _trl_models import accelerate_on_cpu

    from fsdp_wrap.comm.teardown import exit_now

    cfg = json.loads(cfg_json)
    accelerate_on_cpu()  # (starts the gloo group torchrun set up)
    res = run_row(cfg, base, out)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, res)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    exit_now()


# ------------------------------------------------------------------- driver


def launch(cfg: dict[str, Any], base: str, nproc: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
        env.pop("FSDP_WRAP_INSTALL", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), os.path.abspath(__file__), "--worker",
               json.dumps(cfg), base, out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if "Error" in ln]
            raise RuntimeError((tail or ["(no error line)"])[-1][:300])
        with open(os.path.join(out, "result.json")) as f:
            result: list[dict[str, Any]] = json.load(f)
            return result


def _mib(n: float) -> str:
    return f"{n / MiB:,.2f}" if abs(n) < 10 * MiB else f"{n / MiB:,.0f}"


HEADER = ["run", "implementation", "orig params", "rank", "grad MiB", "x ideal", "held MiB",
          "peak MiB", "step s", "CPU s", "gathers/token", "adapter KiB", "logits diff"]


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for res in results:
        for rank, r in enumerate(res["ranks"]):
            label = ([GROUPS[res["algo"]][0], res["impl"].replace("torch", "torch FSDP1"),
                      str(res["uop"])] if rank == 0 else ["", "", ""])
            if "error" in r:
                rows.append(label + [str(rank), f"failed: {r['error'][:60]}"] + [""] * 8)
                continue
            gathers = f"{r['gathers'][0]:.0f}" if "gathers" in r else ""
            adapter = f"{r['adapter_bytes'] / 1024:,.1f}" if "adapter_bytes" in r else ""
            diff = f"{r['logits_diff']:.1e}" if "logits_diff" in r else ""
            rows.append(label + [str(rank), _mib(r["grad"]), f"{r['grad'] / r['ideal']:.2f}",
                                 _mib(r["held"]), _mib(r["peak"]), f"{r['wall']:.2f}",
                                 f"{r['cpu']:.2f}", gathers, adapter, diff])
    return rows


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["tiny", "300m"], default="300m")
    ap.add_argument("--only", default="sft,dpo,grpo", help="runs, comma-separated: sft,dpo,grpo")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence (GRPO: per prompt)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per row")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the implementations")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--impls", default="torch:True,fsdp_wrap:True,fsdp_wrap:False",
                    help="rows per run, comma-separated implementation:use_orig_params")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    from _trl_models import write_base

    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        write_base(base, args.size)
        impls = [(i, u == "True") for i, u in (x.split(":") for x in args.impls.split(","))]
        for rep in range(args.repeats):
            for algo in args.only.split(","):
                order = impls if rep % 2 == 0 else impls[::-1]
                for impl, uop in order:
                    cfg = dict(algo=algo, impl=impl, uop=uop, seq=args.seq, warmup=args.warmup,
                               steps=args.steps)
                    try:
                        ranks = launch(cfg, base, args.nproc)
                    except Exception as e:  # noqa: BLE001  (reported; the other rows still run)
                        ranks = [{"error": str(e)}] * args.nproc
                    results.append(dict(algo=algo, impl=impl, uop=uop, repeat=rep, ranks=ranks))
                    _write_json(args, results)  # (after every row: a long run keeps what it measured)
                    print(f"  {algo} {impl} use_orig_params={uop} (round {rep}): done "
                          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nmodel: LLaMA ({args.size}), {base_params(args.size) / 1e6:.1f}M parameters; ", end="")
    print(f"{args.nproc} gloo ranks on CPU, 1 thread each; {args.seq} tokens per sequence; "
          f"{args.warmup} warm-up + {args.steps} measured steps; machine load {os.getloadavg()}\n")
    results.sort(key=lambda res: (args.only.split(",").index(res["algo"]), res["repeat"]))
    print(rst_table(HEADER, table_rows(results)))
    for res in results:
        print(f"  losses {res['algo']} {res['impl']} uop={res['uop']} round {res['repeat']}: "
              f"{res['ranks'][0].get('losses')} (walls {res['ranks'][0].get('walls')})")
    _write_json(args, results)
    return 0


def _write_json(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=2)


def base_params(size: str) -> int:
    """Parameters of the base model (built on the meta device: its size before
    quantizing or sharding)."""
    import torch
    from _trl_models import CONFIGS
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIGS[size]))
    return sum(p.numel() for p in model.parameters())


def rst_table(header: list[str], rows: list[list[str]]) -> str:
    from _bench_launch import rst_table as table

    return table(header, rows)


if __name__ == "__main__":
    sys.exit(main())
