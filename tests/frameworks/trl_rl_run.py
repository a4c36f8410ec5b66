"""TRL's ``DPOTrainer`` and ``GRPOTrainer`` on FSDP1 through Accelerate's plugin.

Both use a reference model: with a full fine-tune a second model that TRL
loads from the policy's path and wraps itself (``prepare_fsdp``); with LoRA
and QLoRA the policy with its adapter disabled.  GRPO generates with the
policy itself (``generate`` under TRL's ``summon_full_params(recurse=False)``
of the root, no vLLM).  torch's FSDP1 first, then fsdp_wrap after
``install()``; each run as in ``trl_sft_run.py`` (3 steps, a checkpoint at
step 2, resumed, ``save_model`` reloaded; torch's FSDP1 only trains), plus,
for GRPO, the all-gathers and the bytes they bring per generated token, and
TRL's FSDP1 weight syncs to a colocated vLLM (GRPO's ``VLLMGeneration`` and
online DPO's walk, vLLM stood in for: ``weight_syncs``).
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
            if kind == "full":
                weight_syncs(key, tr)
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
        if kind == "full":
            weight_syncs(key, tr)
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


def _digest(t: torch.Tensor) -> str:
    import hashlib

    # (a copy: numpy pins the storage it views, which FSDP must be able to free)
    data = t.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(data).hexdigest()[:16]}"


class _VllmStandIn:
    """What TRL's colocated weight sync calls on vLLM (its model's
    ``load_weights``, the prefix-cache reset): records what it receives."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.received: list[list[str]] = []
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=runner)))

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.received += [[name, _digest(t)] for name, t in weights]

    def reset_prefix_cache(self) -> None:
        pass


def weight_syncs(key: str, tr: object) -> None:
    """TRL's FSDP1 weight syncs to a colocated vLLM, run by TRL's own code on the
    trained (full fine-tune) model, with vLLM stood in for (not installable
    here): GRPO's ``VLLMGeneration.sync_weights`` (a per-unit
    ``summon_full_params(recurse=False, writeback=False)`` walk,
    ``_iter_fsdp1_params``) and online DPO's ``_sync_fsdp1_params_to_vllm`` (the
    same walk from the root).  Recorded: the full weights read the plain way
    (one summon of the root), then what vLLM received (names and value
    digests), or the error.  (With PEFT, TRL merges the adapters into the
    FSDP1-sharded base weights first, which TRL itself marks "TODO: does this
    work with FSDP?": not run here.)"""
    import functools
    from types import SimpleNamespace

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from trl.distributed import DistributedBackend
    from trl.experimental.online_dpo.online_dpo_trainer import OnlineDPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    root = tr.model_wrapped  # type: ignore[attr-defined]
    with FSDP.summon_full_params(root, writeback=False):
        record(key + "/full_weights", [[n.replace("_fsdp_wrapped_module.", ""), _digest(p)]
                                       for n, p in root.named_parameters()])
    gen = object.__new__(VLLMGeneration)  # (its __init__ starts vLLM)
    llm = _VllmStandIn()
    # GRPOTrainer hands VLLMGeneration its model before Accelerate wraps it
    gen.__dict__.update(model=root.module, accelerator=tr.accelerator, mode="colocate",  # type: ignore[attr-defined]
                        enable_sleep_mode=False, llm=llm,
                        _dist=DistributedBackend(tr.accelerator))  # type: ignore[attr-defined]
    try:
        gen.sync_weights()
        record(key + "/vllm_sync_grpo", llm.received)
    except Exception as e:
        record(key + "/vllm_sync_grpo", f"{type(e).__name__}: {e}"[:300])
    llm = _VllmStandIn()
    stub = SimpleNamespace(vllm_mode="colocate", llm=llm, accelerator=tr.accelerator,  # type: ignore[attr-defined]
                           _fix_param_name_to_vllm=functools.partial(
                               OnlineDPOTrainer._fix_param_name_to_vllm, None))
    stub._sync_fsdp1_params_to_vllm = functools.partial(OnlineDPOTrainer._sync_fsdp1_params_to_vllm, stub)
    try:
        stub._sync_fsdp1_params_to_vllm(root)
        record(key + "/vllm_sync_online_dpo", llm.received)
    except Exception as e:
        record(key + "/vllm_sync_online_dpo", f"{type(e).__name__}: {e}"[:300])


def torch_part() -> None:
    for algo in ("dpo", "grpo"):
        for kind in ("lora", "qlora", "full"):
            run(algo, "torch", kind, "SHARDED_STATE_DICT", True)


def ours_part() -> None:
    for algo in ("dpo", "grpo"):
        for kind, sdt, uop in (("lora", "FULL_STATE_DICT", False), ("qlora", "SHARDED_STATE_DICT", True),
                               ("full", "SHARDED_STATE_DICT", True)):
            run(algo, "ours", kind, sdt, uop)
