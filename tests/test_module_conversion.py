"""Whole-module operations on a wrapped model, against torch's FSDP1 (2 ranks).

* ``FSDP(model).half()`` (or ``.double()``) before the first forward converts
  the flat parameters, so the model trains in that dtype, in both
  ``use_orig_params`` modes, as torch's does.
* ``FSDP(checkpoint_wrapper(model))`` (what wrapping after
  ``apply_activation_checkpointing`` on the root gives) loads its own state
  dicts back, of every type, as torch's does (LOCAL with
  ``use_orig_params=True``, which torch cannot load, loads back too).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist

from tests._options_common import cmp, compare_step, loss_of, rank_tag, run_configs, train_step
from tests._sweep import Injection
from tests.models import build, fsdp_api, fsdp_kwargs, make_input, new_model, transformer_policy

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _convert_run(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(0)
    base = new_model("transformer")
    kw = dict(sharding_strategy=cfg["strategy"], use_orig_params=cfg["uop"])
    models = {impl: getattr(build("transformer", impl, base, **kw), cfg["to"])()
              for impl in ("torch", "ours")}
    dtype = {"half": torch.float16, "double": torch.float64}[cfg["to"]]
    opts = {i: torch.optim.SGD(m.parameters(), lr=0.1) for i, m in models.items()}
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    names = [n for n, _ in models["ours"].named_parameters()]
    fails = []
    dtypes = {i: sorted({str(p.dtype) for p in m.parameters()}) for i, m in models.items()}
    if dtypes["torch"] != dtypes["ours"] or dtypes["ours"] != [str(dtype)]:
        fails.append(f"{tag}: parameter dtypes torch {dtypes['torch']} vs ours {dtypes['ours']}")
    for step in range(2):
        x = make_input("transformer", gen)
        res = {}
        for i, m in models.items():
            out = m(x)
            if out.dtype != dtype:
                fails.append(f"{tag} step {step}: {i} computed in {out.dtype}")
            res[i] = train_step(m, opts[i], loss_of(out))
        # Bit-exact: the same ops as torch's FSDP1, in the same dtype and order.
        fails += compare_step(f"{tag} step {step}", names, res["torch"], res["ours"], 0.0)
    return fails


def _convert_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=u, to=t)
            for s, u, t in itertools.product(STRATEGIES, (False, True), ("half", "double"))]


def _convert_sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """No comparison gates a collective: both steps run whatever they found."""
    return run_configs(configs, _convert_run, inject=inject)


def test_half_after_wrapping_trains_in_half_as_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_convert_sweep, _convert_configs()) for f in r]
    assert not fails, "\n".join(fails[:20])


# ------------------------------------------------------- checkpoint wrapper


def _full_params(impl: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with fsdp_api(impl).FullyShardedDataParallel.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""):
                p.detach().clone() for n, p in model.named_parameters()}


def _ckpt_wrapper_run(cfg: dict[str, Any]) -> list[str]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    warnings.simplefilter("ignore")
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(0)
    base = new_model("transformer")
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    x = make_input("transformer", gen)
    saved, loaded, outcome = {}, {}, {}
    torch_cannot = cfg["sd_type"] == "LOCAL_STATE_DICT" and cfg["uop"]  # docs/features.rst: deliberate
    for impl in ("torch", "ours"):
        api = fsdp_api(impl)
        kw = fsdp_kwargs(impl, sharding_strategy=cfg["strategy"], use_orig_params=cfg["uop"],
                         auto_wrap_policy=transformer_policy(impl))
        model = api.FullyShardedDataParallel(checkpoint_wrapper(copy.deepcopy(base)), **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_of(model(x)).backward()
        opt.step()
        saved[impl] = _full_params(impl, model)
        sd_type = api.StateDictType[cfg["sd_type"]]
        with api.FullyShardedDataParallel.state_dict_type(model, sd_type):
            sd = copy.deepcopy(model.state_dict())  # LOCAL values alias the shards
        opt.zero_grad()
        loss_of(model(x)).backward()
        opt.step()  # the parameters move away from the saved ones
        try:
            with api.FullyShardedDataParallel.state_dict_type(model, sd_type):
                res = model.load_state_dict(sd)
            outcome[impl] = f"missing {res.missing_keys}, unexpected {res.unexpected_keys}"
        except RuntimeError as e:
            # Only torch's expected failure is caught: its strict key check
            # ("Unexpected key(s) ... _flat_param"), raised on every rank alike
            # after the load hooks.  Any other exception ends the task.
            if impl != "torch" or not torch_cannot:
                raise
            outcome[impl] = f"RuntimeError: {e}"
        loaded[impl] = _full_params(impl, model)
    fails = []
    want = "missing [], unexpected []"
    if outcome["ours"] != want or (not torch_cannot and outcome["torch"] != want):
        fails.append(f"{tag}: load_state_dict torch {outcome['torch']!r} vs ours {outcome['ours']!r}")
    ref = saved["torch"] if torch_cannot else loaded["torch"]
    fails += [f"{tag} after load: {e}" for e in
              (cmp(n, ref[n], loaded["ours"].get(n), 0.0) for n in ref) if e]
    fails += [f"{tag} after load vs saved: {e}" for e in
              (cmp(n, saved["ours"][n], loaded["ours"].get(n), 0.0) for n in saved["ours"]) if e]
    return fails


def _ckpt_wrapper_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=u, sd_type=t)
            for s, u, t in itertools.product(("FULL_SHARD", "NO_SHARD"), (False, True),
                                             ("FULL_STATE_DICT", "SHARDED_STATE_DICT",
                                              "LOCAL_STATE_DICT"))]


def _ckpt_wrapper_sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """No comparison gates a collective: they all come after the last one."""
    return run_configs(configs, _ckpt_wrapper_run, inject=inject)


def test_checkpoint_wrapped_root_loads_its_state_dicts_as_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_ckpt_wrapper_sweep, _ckpt_wrapper_configs()) for f in r]
    assert not fails, "\n".join(fails[:20])
