"""What ``summon_full_params`` shows of ``requires_grad`` and ``.grad``, against torch's FSDP1.

* With ``use_orig_params=False`` a flat parameter frozen after wrapping
  (``flat_param.requires_grad_(False)``, as code written for torch's FSDP1
  does to freeze a unit) shows its original parameters with
  ``requires_grad=False`` inside ``summon_full_params``; training the other
  units (or all units, once unfrozen again) still matches torch.
* ``summon_full_params(with_grads=True)`` shows ``.grad`` as torch does: ``None``
  before any backward, and, between a forward and its backward, the same set
  of parameters holding a gradient.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import cmp, compare_step, loss_of, rank_tag, run_configs, train_step
from tests._sweep import Injection, injected
from tests.models import build, fsdp_api, make_input, new_model

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _shown(impl: str, model: nn.Module, **kw: Any) -> list[tuple[str, bool, bool, bool]]:
    """(name, is a Parameter, requires_grad, has .grad) per parameter inside the context."""
    with fsdp_api(impl).FullyShardedDataParallel.summon_full_params(model, **kw):
        return [(n.replace("_fsdp_wrapped_module.", ""), isinstance(p, nn.Parameter),
                 p.requires_grad, p.grad is not None) for n, p in model.named_parameters()]


def _frozen_run(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(0)
    base = new_model("transformer")
    kw = dict(sharding_strategy=cfg["strategy"], use_orig_params=False)
    models = {impl: build("transformer", impl, base, **kw) for impl in ("torch", "ours")}
    for m in models.values():
        flat = list(m.parameters())
        for i in cfg["freeze"]:
            flat[i].requires_grad_(False)
    fails = []
    shown = {i: _shown(i, m) for i, m in models.items()}
    if e := _cmp_shown("inside summon", shown):
        fails.append(f"{tag} {e}")
    if cfg["unfreeze"]:  # frozen for a while (e.g. a warm-up), trained again
        for m in models.values():
            for p in m.parameters():
                p.requires_grad_(True)
    trainable = {i: [p for p in m.parameters() if p.requires_grad] for i, m in models.items()}
    if all(trainable.values()):
        opts = {i: torch.optim.SGD(trainable[i], lr=0.1) for i in models}
        gen = torch.Generator().manual_seed(100 + dist.get_rank())
        names = [n for n, _ in models["ours"].named_parameters()]
        for step in range(2):
            x = make_input("transformer", gen)
            res = {i: train_step(m, opts[i], loss_of(m(x))) for i, m in models.items()}
            # Bit-exact: the same ops as torch's FSDP1 on the same flat layout, same order.
            fails += compare_step(f"{tag} step {step}", names, res["torch"], res["ours"], 0.0)
    shown = {i: _shown(i, m) for i, m in models.items()}
    if e := _cmp_shown("after training", shown):
        fails.append(f"{tag} {e}")
    return fails


def _cmp_shown(what: str, shown: dict[str, Any]) -> str | None:
    if bad := injected(what):
        return bad
    if shown["torch"] != shown["ours"]:
        return f"{what}: torch {shown['torch']} vs ours {shown['ours']}"
    return None


def _frozen_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, freeze=f, unfreeze=u)
            for s, f, u in itertools.product(STRATEGIES, ((0,), (1, 2)), (False, True))]


def _frozen_sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_configs(configs, _frozen_run, inject=inject)


def test_frozen_flat_param_shows_frozen_originals_as_in_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_frozen_sweep, _frozen_configs()) for f in r]
    assert not fails, "\n".join(fails[:20])


# ------------------------------------------------------------ with_grads


def _grads(model: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    return [(n.replace("_fsdp_wrapped_module.", ""), None if p.grad is None else p.grad.clone())
            for n, p in model.named_parameters()]


def _cmp_grads(what: str, ref: list[Any], ours: list[Any]) -> list[str]:
    if bad := injected(f"grads {what}"):
        return [bad]
    if [(n, g is None) for n, g in ref] != [(n, g is None) for n, g in ours]:
        return [f"{what}: (name, .grad is None) torch {[(n, g is None) for n, g in ref]} "
                f"vs ours {[(n, g is None) for n, g in ours]}"]
    # Bit-exact: torch's FSDP1 and ours reduce the same gradients in the same order.
    errs = [cmp(f"{what} {n}", a, b, 0.0) for (n, a), (_, b) in zip(ref, ours)]
    return [e for e in errs if e]


def _with_grads_run(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(0)
    name = cfg["model"]
    base = new_model(name)
    kw = dict(sharding_strategy=cfg["strategy"], use_orig_params=True)
    models = {impl: build(name, impl, base, **kw) for impl in ("torch", "ours")}
    opts = {i: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
            for i, m in models.items()}
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    fails: list[str] = []

    # fsdp_wrap splits a unit mixing frozen and trainable parameters
    # (docs/fine_tuning.rst): frozen ones never get a gradient, where torch's
    # one flat parameter shows zeros for them, and each rank's 1-D pieces
    # (which parameters have a local gradient outside summon) follow the split.
    frozen = {n.replace("_fsdp_wrapped_module.", "") for n, p in base.named_parameters()
              if not p.requires_grad}

    def look(when: str) -> None:
        inside = {}
        for impl, m in models.items():
            with fsdp_api(impl).FullyShardedDataParallel.summon_full_params(m, with_grads=True):
                inside[impl] = _grads(m)
        for n, g in inside["torch"]:
            if n in frozen and g is not None and bool(g.abs().max() > 0):
                fails.append(f"{tag} {when}: torch's gradient of frozen {n} is not zero")
        inside["torch"] = [(n, None if n in frozen else g) for n, g in inside["torch"]]
        fails.extend(f"{tag} {when}, inside: {e}" for e in _cmp_grads("", *inside.values()))
        if not frozen:
            after = {impl: _grads(m) for impl, m in models.items()}
            fails.extend(f"{tag} {when}, after: {e}" for e in _cmp_grads("", *after.values()))

    look("before any forward")
    for step in range(3):
        x = make_input(name, gen)
        losses = {i: loss_of(m(x)) for i, m in models.items()}
        look(f"step {step} between forward and backward")
        # No try/except around backward (collectives): an error raised on one
        # rank only would leave the others in a reduction; it ends the task.
        for loss in losses.values():
            loss.backward()
        look(f"step {step} after backward")
        for o in opts.values():
            o.step()
        if step == 1:  # step 2 runs with the gradients of step 1 left in place
            continue
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        look(f"step {step} after zero_grad")
    return fails


def _with_grads_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, model=m)
            for s, m in itertools.product(STRATEGIES, ("transformer", "frozen_mixed"))]


def _with_grads_sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_configs(configs, _with_grads_run, inject=inject)


def test_summon_with_grads_shows_grads_as_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_with_grads_sweep, _with_grads_configs()) for f in r]
    assert not fails, "\n".join(fails[:20])
