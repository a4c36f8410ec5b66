"""verl 0.9.1's own FSDP1 helpers on 2 CPU ranks: torch's FSDP1, then fsdp_wrap.

Run in an environment with verl (its transformers pin), under torchrun:
``VERL_PLATFORM=cpu torchrun --nproc-per-node 2 verl_helpers_run.py OUT``.
verl runs on CPU through its platform plugin API (``verl_cpu_platform``).
A tiny Qwen2 with LoRA, one unit per decoder layer, is put through verl's
offload and load (``offload_fsdp_model_to_cpu`` / ``load_fsdp_model_to_gpu``),
its LoRA weight sync (``collect_lora_params``: full summon, layered summon,
and the base weights before the first sync) and its merged-LoRA export
(``collect_merged_lora_params``), then one training step; every tensor is
compared between torch's FSDP1 and fsdp_wrap (bit-exact) and the result
written to ``OUT/verl_helpers_rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VERL_PLATFORM", "cpu")
import verl_cpu_platform  # noqa: E402,F401  (registers the platform before verl asks)


def build(FSDP: type, policy_fn: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import functools

    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    policy = functools.partial(policy_fn, transformer_layer_cls={Qwen2DecoderLayer})
    wrapped = FSDP(model, auto_wrap_policy=policy, use_orig_params=True,
                   device_id=torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    return wrapped, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 64, (2, 8), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def run(impl: str) -> dict[str, object]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from verl.utils import fsdp_utils as V

    model, opt = build(FSDP, transformer_auto_wrap_policy)
    out: dict[str, object] = {"class": type(model).__module__, "loss0": step(model, opt)}
    V.offload_fsdp_model_to_cpu(model)
    V.load_fsdp_model_to_gpu(model)
    out["loss1"] = step(model, opt)
    stages = {
        "lora_full": lambda: V.collect_lora_params(model, layered_summon=False, base_sync_done=True),
        "lora_layered": lambda: V.collect_lora_params(model, layered_summon=True, base_sync_done=True),
        "base": lambda: V.collect_lora_params(model, layered_summon=False, base_sync_done=False),
        "merged": lambda: V.collect_merged_lora_params(model),
    }
    for key, stage in stages.items():
        try:
            out[key] = stage()
        except Exception as e:  # (recorded: torch's FSDP1 dies on some of these on CPU)
            out[key] = f"{type(e).__name__}: {str(e)[:200]}"
    out["loss2"] = step(model, opt)
    return out


def compare(a: dict[str, object], b: dict[str, object]) -> dict[str, object]:
    res: dict[str, object] = {"classes": [a["class"], b["class"]]}
    for k in ("loss0", "loss1", "loss2"):
        res[k] = [a[k], b[k]]
    for k in ("lora_full", "lora_layered", "base", "merged"):
        ta, tb = a[k], b[k]
        if not (isinstance(ta, dict) and isinstance(tb, dict)):
            res[k] = {"torch": ta if isinstance(ta, str) else len(ta),
                      "ours": tb if isinstance(tb, str) else len(tb)}
            continue
        same_keys = sorted(ta) == sorted(tb)
        bad = [n for n in ta if n not in tb or not torch.equal(ta[n], tb[n])]
        res[k] = {"n": len(ta), "n_ours": len(tb), "same_keys": same_keys, "differ": bad[:5]}
    return res


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    theirs = run("torch")
    import fsdp_wrap

    fsdp_wrap.install(verbose=False)
    ours = run("ours")
    res = compare(theirs, ours)
    with open(os.path.join(sys.argv[1], f"verl_helpers_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
