"""``fsdp-wrap plan``: the plan of a model from the command line (:func:`fsdp_wrap.plan`)."""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import sys
from typing import Any

import torch
import torch.nn as nn

from fsdp_wrap.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_wrap.cli._common import CommandError, add_command, usage_error
from fsdp_wrap.cli._peft import SPEC_HELP, apply_peft, parse_peft
from fsdp_wrap.planning import Plan, plan
from fsdp_wrap.planning._report import fmt_bytes, table
from fsdp_wrap.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

DESCRIPTION = """\
What FSDP would build for a model and what each rank would hold: the units, their
padded and sharded sizes, and per rank the parameters, gradients and optimizer
state (exact) and the peak in flight during a step (activations not counted).
The model is built on the meta device: nothing is allocated, no GPU or process
group is needed.

The model: MODULE:FACTORY names a function returning an nn.Module (called with
--factory-kwargs), or --hf-config a transformers config (a JSON file, a JSON
string, or a name AutoConfig.from_pretrained resolves) for AutoModelForCausalLM.
--peft puts a LoRA adapter on it (PEFT's get_peft_model): the base frozen, so
its weights count no gradient or optimizer state, and units mixing frozen and
trainable parameters split into one flat parameter per kind, as FSDP does.

examples:
  fsdp-wrap plan mypkg.models:build_model --world-size 64 --policy transformer:Block
  fsdp-wrap plan --hf-config llama7b.json --world-size 8 --mixed-precision bf16
  fsdp-wrap plan --hf-config config.json --world-size 64 --compare --gpu-memory 80
  fsdp-wrap plan --hf-config config.json --world-size 8 --plot memory.png --gpu-memory 80
  fsdp-wrap plan --hf-config llama7b.json --world-size 8 --peft lora:r=8,targets=q_proj,v_proj
"""


def add_parser(sub: Any) -> None:
    p = add_command(sub, "plan", help="the FSDP units and per-rank memory of a model, "
                    "before launch", description=DESCRIPTION)
    p.add_argument("model", nargs="?", metavar="MODULE:FACTORY",
                   help="a function returning the model (or give --hf-config)")
    p.add_argument("--factory-kwargs", default="{}", metavar="JSON",
                   help="keyword arguments for FACTORY, as a JSON object")
    p.add_argument("--hf-config", metavar="CONFIG",
                   help="a transformers config: a JSON file, a JSON string or a model name")
    p.add_argument("--peft", metavar="SPEC", default=None, help=SPEC_HELP)
    p.add_argument("--world-size", type=int, required=True, help="ranks in the job (required)")
    p.add_argument("--shard-group-size", type=int, default=None,
                   help="hybrid strategies: ranks per shard group (default: min(8, world size))")
    p.add_argument("--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy],
                   help="the sharding strategy")
    p.add_argument("--policy", default="auto",
                   help="the auto-wrap policy: transformer:CLASS[,CLASS], size:MIN_PARAMS, "
                   "none, or auto (a transformers model's _no_split_modules, else none)")
    p.add_argument("--offload", action="store_true", help="CPUOffload(offload_params=True)")
    p.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default="none",
                   help="MixedPrecision(param_dtype=this)")
    p.add_argument("--reduce-dtype", choices=tuple(DTYPES), default=None,
                   help="MixedPrecision(reduce_dtype=this) (default: the compute dtype)")
    p.add_argument("--use-orig-params", action="store_true",
                   help="FSDP(use_orig_params=True): optimizer state per original parameter")
    p.add_argument("--backward-prefetch", default="BACKWARD_PRE",
                   choices=("BACKWARD_PRE", "BACKWARD_POST", "none"),
                   help="which unit is gathered ahead during backward")
    p.add_argument("--forward-prefetch", action="store_true",
                   help="FSDP(forward_prefetch=True): gather the next unit during forward")
    p.add_argument("--optimizer", default="adam",
                   choices=("adam", "adamw", "sgd", "sgd-momentum", "none"),
                   help="the optimizer whose state is counted")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="what the ranks compute on: cuda (NCCL) or cpu (gloo, whose staging "
                   "buffers are counted)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="gradient bucket cap in MiB, 0 for none "
                   "(default: $FSDP_WRAP_BUCKET_CAP_MB, else 1)")
    p.add_argument("--all-gather-batch-mb", type=float, default=None,
                   help="batched all-gather cap in MiB, 0 for none; counted with --device cpu "
                   "(default: $FSDP_WRAP_ALL_GATHER_BATCH_MB, else 1)")
    p.add_argument("--compare", action="store_true",
                   help="every strategy x offload x precision side by side")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="GiB per device: say which configurations fit (activations not counted)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="draw one rank's memory over a step (forward, backward, optimizer step) "
                   "into FILE (.png, .svg or .pdf; needs matplotlib)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def build_model(args: argparse.Namespace) -> nn.Module:
    if bool(args.model) == bool(args.hf_config):
        usage_error("give either MODULE:FACTORY or --hf-config")
    if args.model and ":" not in args.model:
        usage_error(f"expected MODULE:FACTORY (e.g. mypkg.models:build), got {args.model!r}")
    try:
        kwargs = json.loads(args.factory_kwargs)
    except json.JSONDecodeError as e:
        usage_error(f"--factory-kwargs is not JSON ({e}): {args.factory_kwargs!r}")
    lora = parse_peft(args.peft) if args.peft else None  # a bad spec fails before building
    with torch.device("meta"):
        model = _hf_model(args.hf_config) if args.hf_config else _factory(args.model)(**kwargs)
        if not isinstance(model, nn.Module):
            raise CommandError(f"{args.model} returned {type(model).__name__}, not an nn.Module")
        if lora is not None:
            model = apply_peft(model, lora)
    return model


def _factory(spec: str) -> Any:
    """The function ``MODULE:FACTORY`` names (the current directory importable)."""
    module_name, _, attr = spec.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CommandError(f"cannot import {module_name!r} ({e}); run from the directory "
                           "that holds it or put it on PYTHONPATH") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CommandError(f"{module_name} has no function {attr!r}")
    return factory


def _hf_model(spec: str) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise CommandError("--hf-config needs transformers (pip install transformers)") from None
    if os.path.exists(spec):
        with open(spec) as f:
            data = json.load(f)
    elif spec.lstrip().startswith("{"):
        data = json.loads(spec)
    else:
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec))
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise CommandError("the config needs a \"model_type\" (e.g. \"llama\")")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **data))


def resolve_policy(spec: str, model: nn.Module) -> Any:
    kind, _, arg = spec.partition(":")
    if kind == "none":
        return None
    if kind == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=int(float(arg)))
    if kind == "auto":
        names = getattr(model, "_no_split_modules", None) or []
        return _class_policy(list(names), model) if names else None
    if kind == "transformer":
        return _class_policy(arg.split(","), model)
    usage_error(f"unknown --policy {spec!r} (transformer:CLASS, size:N, none or auto)")


def _class_policy(names: list[str], model: nn.Module) -> ModuleWrapPolicy:
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise CommandError(f"no module class named {missing} in the model "
                           f"(classes: {sorted(by_name)})")
    return ModuleWrapPolicy({by_name[n] for n in names})


def _kwargs(args: argparse.Namespace, policy: Any, strategy: str, offload: bool,
            precision: str) -> dict[str, Any]:
    dtype = DTYPES.get(precision) if precision != "none" else None
    reduce = DTYPES[args.reduce_dtype] if args.reduce_dtype else None
    return dict(
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=policy,
        cpu_offload=CPUOffload(offload_params=offload),
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=reduce),
        use_orig_params=args.use_orig_params,
        backward_prefetch=None if args.backward_prefetch == "none"
        else BackwardPrefetch[args.backward_prefetch],
        forward_prefetch=args.forward_prefetch,
        shard_group_size=args.shard_group_size if "HYBRID" in strategy else None,
        optimizer=args.optimizer,
        device=args.device,
        bucket_cap_mb=args.bucket_cap_mb,
        all_gather_batch_mb=args.all_gather_batch_mb,
    )


def run(args: argparse.Namespace) -> int:
    if args.compare and args.plot:
        usage_error("--plot draws one configuration: leave out --compare")
    model = build_model(args)
    policy = resolve_policy(args.policy, model)
    if not args.compare:
        p = plan(model, args.world_size,
                 **_kwargs(args, policy, args.strategy, args.offload, args.mixed_precision))
        if args.json:
            print(json.dumps(p.to_dict(), indent=1))
        else:
            print(p)
            if args.gpu_memory is not None:
                print(f"\nfits in {args.gpu_memory:g} GiB per device (before activations): "
                      f"{'yes' if _fits(p, args.gpu_memory) else 'no'}")
        if args.plot:
            from fsdp_wrap.planning.plot import plot_plan

            peak = plot_plan(p, args.plot, gpu_memory_gib=args.gpu_memory)
            print(f"wrote {args.plot}: one rank's memory over a step, peak {fmt_bytes(peak)}",
                  file=sys.stderr if args.json else sys.stdout)
        return 0
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    if args.shard_group_size:
        strategies.append("HYBRID_SHARD")
    precisions = ["none", "bf16"]
    rows, data = [], []
    for strategy, offload, precision in itertools.product(strategies, (False, True), precisions):
        p = plan(model, args.world_size, **_kwargs(args, policy, strategy, offload, precision))
        m = p.memory
        data.append({"strategy": strategy, "offload": offload, "precision": precision,
                     **p.to_dict()["memory"]})
        rows.append([strategy, "yes" if offload else "no", "fp32" if precision == "none"
                     else precision, fmt_bytes(m.params_device + m.params_cpu),
                     fmt_bytes(m.optimizer_device + m.optimizer_cpu),
                     fmt_bytes(m.unsharded_peak), fmt_bytes(m.peak_device),
                     fmt_bytes(m.persistent_cpu)]
                    + ([("yes" if _fits(p, args.gpu_memory) else "no")]
                       if args.gpu_memory is not None else []))
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    header = ["strategy", "offload", "precision", "params", "optimizer", "in flight",
              "device peak", "cpu"] + (["fits"] if args.gpu_memory is not None else [])
    print(f"{p.total_params:,} parameters, {len(p.units)} units, world size {args.world_size}, "
          f"optimizer {args.optimizer}; bytes per rank, activations not counted")
    print(table(rows, header))
    return 0


def _fits(p: Plan, gib: float) -> bool:
    return p.memory.peak_device <= gib * 2**30
