"""Hugging Face Accelerate's FSDP1 path, on torch's FSDP1 and then on fsdp_wrap.

For each configuration: ``Accelerator(fsdp_plugin=...)`` prepares a tiny GPT-2,
trains 3 steps, ``save_state``, trains 2 more (the reference), then a fresh
model and accelerator ``load_state`` and train the same 2 steps (resumed).
With ``FULL_STATE_DICT`` the saved model file is also loaded into a plain
GPT-2.  torch's FSDP1 crashes on CPU saving a FULL state dict with
``offload_to_cpu`` (what Accelerate asks for), so there torch only trains.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _common import (
    OUT,
    accelerate_on_cpu,
    full_params_match,
    record,
    tiny_gpt2,
    tokens,
)

CONFIGS = [
    # name, state_dict_type, use_orig_params, load the model in bf16 (Accelerate upcasts)
    ("sharded", "SHARDED_STATE_DICT", False, False),
    ("full_bf16_loaded", "FULL_STATE_DICT", True, True),
]


def init_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One zero-learning-rate step on zero gradients: state tensors exist, nothing moves."""
    x = tokens(0)
    model(input_ids=x, labels=x).loss.mul(0).backward()
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    opt.zero_grad()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


def run(impl: str, name: str, sdt: str, uop: bool, bf16: bool) -> None:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    def make() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
        accelerate_on_cpu()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=1, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["GPT2Block"], state_dict_type=sdt,
            use_orig_params=uop, sync_module_states=False, cpu_ram_efficient_loading=False)
        acc = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16" if bf16 else "no")
        model = acc.prepare(tiny_gpt2(torch.bfloat16 if bf16 else torch.float32))
        opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
        return acc, model, opt

    def step(acc: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
        x = tokens(i)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.item())

    acc, model, opt = make()
    key = f"{impl}/{name}"
    record(key + "/class", type(model).__module__)
    record(key + "/train", [step(acc, model, opt, i) for i in range(3)])
    # Accelerate upcasts a bf16-loaded model's flat parameters to fp32 masters.
    record(key + "/flat_dtypes", sorted({str(m._flat_param.dtype) for m in
                                         type(model).fsdp_modules(model) if m._has_params}))
    can_save = impl == "ours" or sdt == "SHARDED_STATE_DICT"
    if not can_save:
        return
    ckpt = os.path.join(OUT, f"acc_{impl}_{name}")
    acc.save_state(ckpt)
    if sdt == "FULL_STATE_DICT":
        # The full model file Accelerate wrote, into a plain (unwrapped) GPT-2:
        # it must hold exactly the trained model's full parameters.
        files = sorted(f for f in os.listdir(ckpt) if f.startswith("pytorch_model_fsdp"))
        sd = torch.load(os.path.join(ckpt, files[0]), map_location="cpu", weights_only=True)
        plain = tiny_gpt2()
        missing, unexpected = plain.load_state_dict(sd, strict=False)
        record(key + "/plain_load", {"missing": list(missing), "unexpected": list(unexpected),
                                     "files": files})
        record(key + "/plain_vs_trained", full_params_match(model, sd))
    record(key + "/ref", [step(acc, model, opt, i) for i in range(3, 5)])
    acc2, model2, opt2 = make()
    if sdt == "SHARDED_STATE_DICT" and impl == "torch":
        # Accelerate loads a sharded optimizer state into the *current* state's
        # structure (an empty one for a fresh optimizer loads nothing, on
        # torch's FSDP1): give torch's optimizer state first.  fsdp_wrap.install()
        # does this itself, from the checkpoint (fsdp_wrap/frameworks/accelerate.py).
        init_optimizer_state(model2, opt2)
    acc2.load_state(ckpt)
    record(key + "/resumed", [step(acc2, model2, opt2, i) for i in range(3, 5)])
    dist.barrier()


def torch_part() -> None:
    for cfg in CONFIGS:
        run("torch", *cfg)


def ours_part() -> None:
    for cfg in CONFIGS:
        run("ours", *cfg)
