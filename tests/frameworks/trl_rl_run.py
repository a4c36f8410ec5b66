"""TRL's ``DPOTrainer`` and ``GRPOTrainer`` on FSDP1 through Accelerate's plugin.

Both use a reference model: with a full fine-tune a second model that TRL
loads from the policy's path and wraps itself (``prepare_fsdp``); with LoRA
and QLoRA the policy with its adapter disabled.  GRPO generates with the
policy itself (``generate`` under TRL's ``summon_full_params(recurse=False)``
of the root, no vLLM).  torch's FSDP1 first, then fsdp_wrap after
``install()``; each run as in ``trl_sft_run.py`` (3 steps, a checkpoint at
step 2, resumed, ``save_model`` reloaded; torch's FSDP1 only trains), plus,
for GRPO, the all-gathers and the bytes they bring per generated token.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from _common import OUT, record
from _trl import (
    SAVE_EVERY,
    Snapshot,
    args,
    base_dir,
    build,
    changed,
    check_saved,
    load,
    lora,
    losses,
    max_diff,
    sentences,
    tokenizer,
    trainable,
)


def dpo(base: str, out: str, kind: str, sdt: str, uop: bool, snap: object, save: bool) -> object:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    prompts = sentences(8, 2, 4, seed=1)
    data = Dataset.from_dict({"prompt": prompts, "chosen": sentences(8, 2, 5, seed=2),
                              "rejected": sentences(8, 2, 5, seed=3)})
    return build(DPOTrainer, DPOConfig, args(out, sdt, uop, save, learning_rate=5e-2,
                                             max_length=16, beta=0.1),
                 model=load(base, kind), train_dataset=data, processing_class=tokenizer(),
                 peft_config=lora(kind), callbacks=[snap] if snap is not None else None)


def reward(completions: list[str], **kw: object) -> list[float]:
    """More distinct words score higher (different completions, different rewards)."""
    return [float(len(set(c.split()))) for c in completions]


def grpo(base: str, out: str, kind: str, sdt: str, uop: bool, snap: object, save: bool) -> object:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    data = Dataset.from_dict({"prompt": sentences(8, 2, 4, seed=4)})
    return build(GRPOTrainer, GRPOConfig,
                 args(out, sdt, uop, save, learning_rate=5e-2, num_generations=2,
                      max_completion_length=6, beta=0.1, temperature=1.0, bf16=False),
                 model=load(base, kind), reward_funcs=reward, train_dataset=data,
                 processing_class=tokenizer(), peft_config=lora(kind),
                 callbacks=[snap] if snap is not None else None)


def run(algo: str, impl: str, kind: str, sdt: str, uop: bool) -> None:
    t0 = time.perf_counter()
    base = base_dir(OUT)
    make = dpo if algo == "dpo" else grpo
    key = f"{algo}/{impl}/{kind}/{sdt}/{uop}"
    out = os.path.join(OUT, key.replace("/", "_"))
    snap = Snapshot()
    tr = make(base, out, kind, sdt, uop, snap, True)
    tr.train()
    record(key + "/class", type(tr.model_wrapped).__module__)
    record(key + "/losses", losses(tr))
    ref = getattr(tr, "ref_model", None)
    record(key + "/ref", type(ref).__module__ if ref is not None else None)
    done = trainable(tr.model_wrapped)
    record(key + "/trained", changed(snap.first, done))
    t1 = time.perf_counter()
    if impl == "torch":  # (its resume restores no adapter: trl_sft_run.py shows it)
        if algo == "grpo":
            generation_cost(key, tr)
        return
    again = make(base, out, kind, sdt, uop, None, False)
    again.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_EVERY}"))
    record(key + "/resumed", losses(again))
    record(key + "/resumed_vs_whole", max_diff(done, trainable(again.model_wrapped)))
    del again
    t2 = time.perf_counter()
    final = os.path.join(out, "final")
    if sdt != "FULL_STATE_DICT":
        tr.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    tr.save_model(final)
    dist.barrier()
    check_saved(key, kind, base, final, tr.model_wrapped, tr.args.bf16)
    if algo == "grpo":
        generation_cost(key, tr)
    dist.barrier()
    record(key + "/seconds", [t1 - t0, t2 - t1, time.perf_counter() - t2])


def generation_cost(key: str, tr: object) -> None:
    """All-gathers (and the exchanges or broadcasts fsdp_wrap gathers with on
    gloo) per generated token in one 6-token generation, run as GRPO's
    generation runs it under FSDP1; counted at the dispatcher, whoever issues them."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from trl.models import unwrap_model_for_generation

    from benchmarks._bench_measure import CollectiveCounter

    model = tr.model_wrapped  # type: ignore[attr-defined]
    ids = torch.tensor([[1, 4, 6, 8]])
    counter = CollectiveCounter()
    with (unwrap_model_for_generation(model, tr.accelerator) as unwrapped,  # type: ignore[attr-defined]
          torch.no_grad(), FSDP.summon_full_params(model, recurse=False), counter):
        new = unwrapped.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False).shape[1] - ids.shape[1]
    calls, nbytes = counter.gathers()
    record(key + "/gathers_per_token", [calls / new, nbytes / new])


def torch_part() -> None:
    for algo in ("dpo", "grpo"):
        for kind in ("lora", "qlora", "full"):
            run(algo, "torch", kind, "SHARDED_STATE_DICT", True)


def ours_part() -> None:
    for algo in ("dpo", "grpo"):
        for kind, sdt, uop in (("lora", "FULL_STATE_DICT", False), ("qlora", "SHARDED_STATE_DICT", True),
                               ("full", "SHARDED_STATE_DICT", True)):
            run(algo, "ours", kind, sdt, uop)
