"""verl 0.9.1's FSDP1 engine end to end on 2 CPU ranks: torch's FSDP1, then fsdp_wrap.

Run in an environment with verl (its transformers pin), under torchrun::

    torchrun --nproc-per-node 2 verl_engine_run.py OUT [CASE ...]

verl runs on CPU through its platform plugin API (``verl_cpu_platform``,
``VERL_PLATFORM=cpu``); nothing of verl is changed.  Each case builds verl's
``TrainingWorker`` (its FSDP engine, ``strategy: fsdp``) from a tiny Qwen2
saved as a Hugging Face checkpoint and calls it the way verl's PPO trainer
and its ``ActorRolloutRefWorker`` do, without Ray (each rank is handed its
data-parallel share of the batch, as Ray's dispatch does) and without a
rollout server (the weight sync's tensors are taken from the engine's
``get_per_tensor_param``, which the rollout would consume):

* ``actor``: compute-log-prob (``infer_batch``, entropy on), update-actor
  (``train_mini_batch``: two mini-batches of two micro-batches each, so
  ``no_sync`` on the first micro-batch, ``clip_grad_norm_``, AdamW), its
  checkpoint manager's save with the HF export, a second update, the full
  weight sync, and a resume: a new worker loads the checkpoint and repeats
  the second update (exact: the same losses, gradient norms and weights);
  fsdp_wrap's run also resumes torch's FSDP1 checkpoint and must repeat
  torch's second update;
* ``offload``: the same actor with parameter and optimizer offload
  (``param_offload``/``optimizer_offload``: verl's ``offload_fsdp_model_to_cpu``
  / ``load_fsdp_model_to_gpu`` around every call), save and resume;
* ``ref``: the reference model (``forward_only``: verl builds it with
  ``CPUOffload(offload_params=True)``) computing the reference log-probs;
* ``lora``: a LoRA actor (verl wraps the adapters' leaves as units of their
  own), an update, then the weight syncs: the adapters (full summon), the
  adapters with ``layered_summon``, the base weights (before the first
  sync), the merged LoRA (``lora.merge``), then the reference log-probs
  with the adapter disabled (the ref-in-actor path) and a last update;
* ``layered``: verl's own ``collect_lora_params(layered_summon=True)`` on a
  model wrapped one unit per decoder layer (which its engine does not
  build), then a forward: verl leaves nested units marked as roots, and the
  forward fails on both (recorded, with each's error).

The same cases run first on torch's FSDP1, then, after
``fsdp_wrap.install()``, on fsdp_wrap; every tensor is compared (bit-exact)
and the result written to ``OUT/verl_engine_rank{R}.json``.  A step torch's
FSDP1 cannot run on CPU is recorded as torch's exception and the case goes on
without it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# verl registers its FSDP engine for the devices "cuda" and "npu"; its own
# override picks the "cuda" registration (the engine's code is device-generic:
# devices, streams and collectives come from the platform).
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
import verl_cpu_platform  # noqa: E402,F401  (registers the platform before verl asks)
from verl_torch_lifts import TORCH_CPU_FIXES, TORCH_CPU_LIFTS, lifted  # noqa: E402

GLOBAL_BATCH = 8  # sequences, over both ranks
PROMPT, RESPONSE = 8, 8
CASES = ("actor", "offload", "ref", "lora", "layered")


# ------------------------------------------------------------------ set-up

def save_tiny_qwen2(path: str) -> None:
    """A tiny Qwen2 as a Hugging Face checkpoint (rank 0 writes, all wait)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                          tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
        Qwen2ForCausalLM(cfg).save_pretrained(path)
    dist.barrier()


def worker_config(model_path: str, *, forward_only: bool = False, offload: bool = False,
                  lora: bool = False, save_hf: bool = False) -> tuple[Any, Any]:
    """verl's TrainingWorkerConfig, filled in as ActorRolloutRefWorker.init_model does."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        ActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
    )
    from verl.workers.config.engine import TrainingWorkerConfig

    model = HFModelConfig(path=model_path, load_tokenizer=False, use_remove_padding=False,
                          override_config={"attn_implementation": "eager"},
                          **({"lora_rank": 4, "lora_alpha": 8} if lora else {}))
    engine = FSDPEngineConfig(strategy="fsdp", forward_only=forward_only, param_offload=offload,
                              optimizer_offload=offload, use_dynamic_bsz=False,
                              micro_batch_size_per_gpu=1, infer_micro_batch_size_per_gpu=2,
                              use_remove_padding=False, use_torch_compile=False, seed=1)
    contents = ["model", "optimizer", "extra"] + (["hf_model"] if save_hf else [])
    ckpt = CheckpointConfig(save_contents=contents, load_contents=["model", "optimizer", "extra"])
    optim = None if forward_only else FSDPOptimizerConfig(lr=1e-2, clip_grad=1.0)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=GLOBAL_BATCH // 2,
                        ppo_micro_batch_size_per_gpu=1, use_torch_compile=False, entropy_coeff=0.01,
                        use_kl_loss=True, optim=optim or FSDPOptimizerConfig(), checkpoint=ckpt,
                        engine=engine, model_config=model)
    cfg = TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                               optimizer_config=optim, checkpoint_config=ckpt)
    return cfg, actor


def build_worker(cfg: Any, actor: Any) -> Any:
    """verl's TrainingWorker as ActorRolloutRefWorker builds it: reset() builds
    the engine (model, FSDP, optimizer, checkpoint manager); the PPO loss."""
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    torch.manual_seed(0)  # as a fresh trainer process: PEFT draws the LoRA A weights (on rank 0)
    worker = TrainingWorker(config=cfg)
    worker.reset()
    if not cfg.engine_config.forward_only:
        worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker


def rollout_batch(step: int) -> dict[str, torch.Tensor]:
    """What the rollout hands the trainer: left-padded prompts, responses,
    masks; then this rank's share, as Ray's data-parallel dispatch cuts it."""
    from verl.utils.model import compute_position_id_with_mask

    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 128, (GLOBAL_BATCH, PROMPT + RESPONSE), generator=g)
    mask = torch.ones_like(ids)
    left = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)  # prompts left-padded
    length = torch.randint(RESPONSE - 3, RESPONSE + 1, (GLOBAL_BATCH,), generator=g)  # responses end early
    for i in range(GLOBAL_BATCH):
        mask[i, :left[i]] = 0
        mask[i, PROMPT + length[i]:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask),
             "prompts": ids[:, :PROMPT], "responses": ids[:, PROMPT:], "response_mask": mask[:, PROMPT:],
             "advantages": torch.randn(GLOBAL_BATCH, RESPONSE, generator=g)}
    per = GLOBAL_BATCH // dist.get_world_size()
    r = dist.get_rank()
    return {k: v[r * per:(r + 1) * per].clone() for k, v in batch.items()}


def as_td(batch: dict[str, torch.Tensor], **meta: Any) -> Any:
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(tu.get_tensordict(dict(batch)))
    tu.assign_non_tensor(td, temperature=1.0, **meta)
    return td


def log_probs(worker: Any, batch: dict[str, torch.Tensor], **meta: Any) -> dict[str, torch.Tensor]:
    """compute-log-prob (the trainer's _compute_old_log_prob / _compute_ref_log_prob)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    td = as_td(batch, compute_loss=False, **meta)
    out = worker.infer_batch(td)
    res = {"log_probs": no_padding_2_padding(tu.get(out, "log_probs"), td).float()}
    if meta.get("calculate_entropy"):
        res["entropy"] = no_padding_2_padding(tu.get(out, "entropy"), td).float()
    return res


def update(worker: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """update-actor (the trainer's _update_actor): mini-batches of
    ``ppo_mini_batch_size`` over both ranks, micro-batches of one."""
    from verl.utils import tensordict_utils as tu

    mini = GLOBAL_BATCH // 2
    td = as_td(batch, calculate_entropy=True, global_batch_size=mini, mini_batch_size=mini, epochs=1,
               seed=42, dataloader_kwargs={"shuffle": False}, compute_loss=True)
    metrics = tu.get(worker.train_mini_batch(td), "metrics")
    return {k: metrics[k] for k in ("actor/pg_loss", "grad_norm", "loss") if k in metrics}


def sync(engine: Any, **kw: Any) -> dict[str, Any]:
    """The weight sync's tensors (what update_weights hands the rollout)."""
    params, peft_config = engine.get_per_tensor_param(**kw)
    out: dict[str, Any] = {name: t.detach().clone() for name, t in params}
    if peft_config is not None:
        out["__peft_config_r"] = peft_config.get("r")
    return out


def local_weights(worker: Any) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter (what the optimizer updates)."""
    return {n: p.detach().clone().cpu() for n, p in worker.engine.module.named_parameters()}


def torch_unlifted(model_path: str) -> dict[str, Any]:
    """Where torch's FSDP1, as it is, stops verl's engine on CPU."""
    out: dict[str, Any] = {}
    cfg, actor = worker_config(model_path)
    Case(out).step("build", lambda: build_worker(cfg, actor) and "built")
    return out


# ------------------------------------------------------------------ the cases

class Case:
    """Runs steps, recording each one's tensors or the exception that stopped it."""

    def __init__(self, out: dict[str, Any]) -> None:
        self.out = out

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)
            where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in tb[-4:]]
            self.out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}", "where": where}
            if os.environ.get("VERL_RUN_TRACEBACKS"):
                traceback.print_exc()
            return None
        self.out[name] = value
        self.out.setdefault("_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        return value


def case_actor(model_path: str, tmp: str, impl: str, offload: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    c = Case(out)
    cfg, actor = worker_config(model_path, offload=offload, save_hf=not offload)
    w = c.step("build", lambda: build_worker(cfg, actor))
    if w is None:
        return out
    out["build"] = True
    out["_class"] = type(w.engine.module).__module__
    b = rollout_batch(0)
    old = c.step("old_log_prob", lambda: log_probs(w, b, calculate_entropy=True))
    if old is None:
        return out
    b1 = {**b, "old_log_probs": old["log_probs"], "ref_log_prob": old["log_probs"].roll(1, -1)}
    c.step("update1", lambda: update(w, b1))
    ckpt = os.path.join(tmp, f"{impl}_{'offload' if offload else 'actor'}_ckpt")
    c.step("save", lambda: w.save_checkpoint(ckpt, global_step=1) or sorted(os.listdir(ckpt)))
    if not offload and dist.get_rank() == 0:
        c.step("hf_export", lambda: hf_export(ckpt))
    c.step("update2", lambda: update(w, b1))
    c.step("log_prob2", lambda: log_probs(w, b))
    c.step("weights2", lambda: local_weights(w))
    c.step("sync_full", lambda: sync(w.engine))
    w = None  # (the first trainer is gone)
    # resume: a new worker (a restarted trainer) loads the checkpoint and repeats update2
    w2 = c.step("resume_build", lambda: build_worker(cfg, actor))
    if w2 is None:
        return out
    out["resume_build"] = True
    c.step("resume_load", lambda: w2.load_checkpoint(ckpt) or True)
    c.step("resume_update2", lambda: update(w2, b1))
    c.step("resume_log_prob2", lambda: log_probs(w2, b))
    c.step("resume_weights2", lambda: local_weights(w2))
    if impl == "ours":  # torch's FSDP1 checkpoint (saved in the torch run), resumed by fsdp_wrap
        torch_ckpt = ckpt.replace(os.sep + "ours_", os.sep + "torch_")
        w3 = c.step("resume_torch_build", lambda: build_worker(cfg, actor))
        if w3 is not None:
            out["resume_torch_build"] = True
            c.step("resume_torch_load", lambda: w3.load_checkpoint(torch_ckpt) or True)
            c.step("resume_torch_update2", lambda: update(w3, b1))
            c.step("resume_torch_weights2", lambda: local_weights(w3))
    return out


def hf_export(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    hf = os.path.join(ckpt, "huggingface")
    files = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(hf, f)))
    return out


def case_ref(model_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    c = Case(out)
    cfg, actor = worker_config(model_path, forward_only=True)
    w = c.step("build", lambda: build_worker(cfg, actor))
    if w is None:
        return out
    out["_class"] = type(w.engine.module).__module__
    out["build"] = {"cpu_offload": bool(getattr(w.engine.module.cpu_offload, "offload_params", False))}
    c.step("ref_log_prob", lambda: log_probs(w, rollout_batch(0), calculate_entropy=False))
    c.step("ref_log_prob_again", lambda: log_probs(w, rollout_batch(1), calculate_entropy=False))
    return out


def case_lora(model_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    c = Case(out)
    cfg, actor = worker_config(model_path, lora=True)
    w = c.step("build", lambda: build_worker(cfg, actor))
    if w is None:
        return out
    out["_class"] = type(w.engine.module).__module__
    out["build"] = {"units": sum(1 for m in w.engine.module.modules()
                                 if type(m).__name__ == "FullyShardedDataParallel")}
    b = rollout_batch(0)
    old = c.step("old_log_prob", lambda: log_probs(w, b, calculate_entropy=True))
    if old is None:
        return out
    b1 = {**b, "old_log_probs": old["log_probs"], "ref_log_prob": old["log_probs"].roll(1, -1)}
    c.step("update1", lambda: update(w, b1))
    e = w.engine
    c.step("adapters_reference", lambda: adapters_reference(e.module))
    # ActorRolloutRefWorker.update_weights: the adapters, then (first sync) the base weights
    c.step("sync_lora", lambda: sync(e, layered_summon=False, base_sync_done=True))
    c.step("sync_base", lambda: sync(e, layered_summon=False, base_sync_done=False))
    c.step("sync_lora_layered", lambda: sync(e, layered_summon=True, base_sync_done=True))
    # lora.merge (read at each sync): the merged weights, then the adapters restored
    e.model_config.lora["merge"] = True
    c.step("sync_merged", lambda: sync(e, layered_summon=False, base_sync_done=True))
    e.model_config.lora["merge"] = False
    # the reference log-probs from the actor with its adapter disabled (ref in actor)
    c.step("ref_in_actor", lambda: log_probs(w, b, no_lora_adapter=True))
    c.step("update2", lambda: update(w, b1))
    c.step("log_prob2", lambda: log_probs(w, b))
    return out


def adapters_reference(model: Any) -> dict[str, torch.Tensor]:
    """The LoRA weights read the plain way (every unit summoned, the original
    parameters named): what the adapter sync must hand the rollout, under
    PEFT's names (no wrapper parts, no adapter name)."""
    out: dict[str, torch.Tensor] = {}
    with type(model).summon_full_params(model, writeback=False):
        for name, p in model.named_parameters():
            if "lora_" in name:
                key = name.replace("_fsdp_wrapped_module.", "").replace(".default", "")
                out[key] = p.detach().clone()
    return out


def case_layered(model_path: str) -> dict[str, Any]:
    """verl's own LoRA helpers on a model its engine does not build (one unit
    per decoder layer, the adapters inside them): ``layered_summon_lora_params``
    marks each unit ``_is_root = True`` for its own summon; when PEFT finds no
    adapter under the unit's relative names it leaves the loop with the flag
    still set, and the next forward runs a root's pre-forward on a nested unit."""
    import functools

    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from verl.utils import fsdp_utils as V

    out: dict[str, Any] = {}
    c = Case(out)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager")
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer})
    model = FSDP(peft, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    out["_class"] = type(model).__module__
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    c.step("forward", lambda: model(input_ids=ids).logits.detach().clone())
    c.step("adapters_reference", lambda: adapters_reference(model))
    c.step("collect_layered", lambda: {k: v.clone() for k, v in V.collect_lora_params(
        model, layered_summon=True, base_sync_done=True).items()})
    out["left_flagged"] = [n for n, m in model.named_modules()
                           if n and isinstance(m, FSDP) and m._is_root]
    c.step("forward_after", lambda: model(input_ids=ids).logits.detach().clone())
    return out


def run_all(impl: str, model_path: str, tmp: str, cases: list[str]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for case in cases:
        t0 = time.perf_counter()
        if case == "actor":
            res[case] = case_actor(model_path, tmp, impl, offload=False)
        elif case == "offload":
            res[case] = case_actor(model_path, tmp, impl, offload=True)
        elif case == "ref":
            res[case] = case_ref(model_path)
        elif case == "lora":
            res[case] = case_lora(model_path)
        elif case == "layered":
            res[case] = case_layered(model_path)
        res[case]["_case_seconds"] = round(time.perf_counter() - t0, 1)
        dist.barrier()
    return res


# ------------------------------------------------------------------ comparison

def same(a: Any, b: Any) -> tuple[bool, str]:
    """Bit-exact equality of nested results; a short reason when not."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False, f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if torch.equal(a, b):
            return True, ""
        diff = (a.double() - b.double()).abs().max().item()
        return False, f"max |diff| {diff:.3g}"
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a) != sorted(b):
            return False, f"keys differ: {sorted(set(a) ^ set(b))[:4]}"
        for k in a:
            ok, why = same(a[k], b[k])
            if not ok:
                return False, f"{k}: {why}"
        return True, ""
    if isinstance(a, float) and isinstance(b, float):
        return (a == b or (a != a and b != b)), f"{a!r} vs {b!r}"
    return a == b, f"{a!r} vs {b!r}"


def summary(v: Any) -> Any:
    if isinstance(v, dict) and "error" in v:
        return v
    if isinstance(v, dict):
        return {"n": len(v)} if any(isinstance(x, torch.Tensor) for x in v.values()) else {
            k: summary(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}{tuple(v.shape)}"
    return v


def compare(theirs: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for case, steps in ours.items():
        rep: dict[str, Any] = {"seconds": {"torch": theirs.get(case, {}).get("_case_seconds"),
                                           "ours": steps.get("_case_seconds")},
                               "classes": [theirs.get(case, {}).get("_class"), steps.get("_class")]}
        for name, v in steps.items():
            if name.startswith("_"):
                continue
            if name.startswith("resume_torch"):  # (fsdp_wrap's run only: checked below)
                rep[name] = {"ours": summary(v)}
                continue
            t = theirs.get(case, {}).get(name, {"error": "not reached"})
            entry: dict[str, Any] = {"ours": summary(v)}
            if isinstance(t, dict) and "error" in t:
                entry["torch"] = t
            elif isinstance(v, dict) and "error" in v:
                entry["torch"] = summary(t)
            else:
                ok, why = same(t, v)
                entry["equal"] = ok
                if not ok:
                    entry["why"] = why
            rep[name] = entry
        # fsdp_wrap resuming torch's checkpoint repeats torch's update after the save
        for a, b in (("update2", "resume_torch_update2"), ("weights2", "resume_torch_weights2")):
            if b in steps and a in theirs.get(case, {}):
                ok, why = same(theirs[case][a], steps[b])
                rep[f"ours_resumed_torch_{a}_exact"] = ok if ok else why
        # the adapter syncs against the adapters read the plain way from torch's model
        ref = theirs.get(case, {}).get("adapters_reference")
        for name in ("sync_lora", "sync_lora_layered", "collect_layered"):
            if name in steps and isinstance(ref, dict) and "error" not in ref:
                for who, got in (("torch", theirs[case].get(name)), ("ours", steps[name])):
                    if isinstance(got, dict) and "error" not in got:
                        got = {k: v for k, v in got.items() if not k.startswith("__")}
                        ok, why = same(ref, got)
                        rep[f"{name}_{who}_is_the_adapters"] = ok if ok else why[:200]
        # resume exact: the resumed worker repeats what the first one did after the save
        for a, b in (("update2", "resume_update2"), ("log_prob2", "resume_log_prob2"),
                     ("weights2", "resume_weights2")):
            if a in steps and b in steps:
                ok, why = same(steps[a], steps[b])
                rep[f"resumed_{a}_exact"] = ok if ok else why
        report[case] = rep
    return report


def main() -> None:
    out_dir = sys.argv[1]
    cases = sys.argv[2:] or list(CASES)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tmp = os.path.join(out_dir, "work")
    model_path = os.path.join(tmp, "tiny-qwen2")
    if dist.get_rank() == 0:
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    save_tiny_qwen2(model_path)

    unlifted = torch_unlifted(model_path)
    dist.barrier()
    with lifted():
        theirs = run_all("torch", model_path, tmp, cases)
    import fsdp_wrap

    fsdp_wrap.install(verbose=False)
    ours = run_all("ours", model_path, tmp, cases)
    report = compare(theirs, ours)
    report["_torch_as_is"] = unlifted
    report["_torch_lifts"] = ([f"{m}.{f}: {why}" for m, f, why in TORCH_CPU_LIFTS]
                              + [f"{name}: {why}" for name, why in TORCH_CPU_FIXES])
    report["_meta"] = {"torch": torch.__version__, "verl": __import__("verl").__version__,
                       "transformers": __import__("transformers").__version__,
                       "peft": __import__("peft").__version__, "world_size": dist.get_world_size()}
    with open(os.path.join(out_dir, f"verl_engine_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    dist.barrier()
    if dist.get_rank() == 0 and not os.environ.get("VERL_RUN_KEEP"):
        shutil.rmtree(tmp, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
