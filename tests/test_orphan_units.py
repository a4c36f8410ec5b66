"""Units outliving their root (issue 51), against torch's FSDP1 on 2 ranks.

Three ways a model's FSDP units lose the root they were initialised under:

* ``dropped``: the root wrapper is thrown away and its module kept (Lightning's
  ``Trainer.test`` after ``fit``: the strategy goes on with the bare
  ``LightningModule``, whose nested units were set up as non-roots);
* ``rewrap``: that module wrapped again by a new root;
* ``moved``: the units put under another, plain module.

Each is built twice from the same trained model, with torch's FSDP1 and with
fsdp_wrap, and compared: the forward, FULL and SHARDED state dicts, the FULL
optimizer state, the full parameters under ``summon_full_params``, a load of
what was saved; then two training steps.  torch's FSDP1 trains only through a
root (units without one never finalise backward: their training state stays
FORWARD_BACKWARD and, without ``use_orig_params``, no gradient reaches the
optimizer), so for ``dropped`` and ``moved`` fsdp_wrap's rootless training is
compared with torch's training of the same units under a new root (the same
operations); ``rewrap`` is compared with torch's own re-wrap.  Bit-exact: the
same operations in the same order.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._sweep import Injection, injected, run_sweep

CPU = torch.device("cpu")
SCENARIOS = ("dropped", "rewrap", "moved")


class LM(nn.Module):
    """A LightningModule's shape: a container whose layers are the units."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class Holder(nn.Module):
    """Another module the units are moved under."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _configs() -> list[dict[str, Any]]:
    kinds = (("FULL_SHARD", False), ("FULL_SHARD", True), ("SHARD_GRAD_OP", True), ("NO_SHARD", False))
    return [dict(scenario=s, strategy=st, uop=u) for s, (st, u) in itertools.product(SCENARIOS, kinds)]


def _impls() -> tuple[Any, Any]:
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    return (tfsdp, TorchPolicy, {"device_id": CPU}), (fsdp_wrap, ModuleWrapPolicy, {})


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    loss = model(_batch(step)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _trained(impl: Any, cfg: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    """A root over ``LM`` with a unit per Linear, trained two steps."""
    F, policy, kw = impl
    torch.manual_seed(0)
    root = F.FullyShardedDataParallel(LM(), auto_wrap_policy=policy({nn.Linear}),
                                      sharding_strategy=F.ShardingStrategy[cfg["strategy"]],
                                      use_orig_params=cfg["uop"], **kw)
    opt = torch.optim.Adam(root.parameters(), lr=1e-2)
    return root, opt, [_step(root, opt, s) for s in range(2)]


def _rewrap(impl: Any, module: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    F, _, kw = impl
    return F.FullyShardedDataParallel(module, sharding_strategy=F.ShardingStrategy[cfg["strategy"]],
                                      use_orig_params=cfg["uop"], **kw)


def _orphaned(impl: Any, root: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    scenario, inner = cfg["scenario"], root.module
    if scenario == "rewrap":
        return _rewrap(impl, inner, cfg)
    if scenario == "moved":
        return Holder(inner.layer[0], inner.layer[2])
    return inner  # dropped


def _tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Plain tensors of a state dict (a ShardedTensor's local shard)."""
    out = {}
    for k, v in sd.items():
        if hasattr(v, "local_shards"):
            shards = v.local_shards()
            v = shards[0].tensor if shards else torch.empty(0)
        out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _views(impl: Any, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a framework reads from the model: every value compared."""
    F, _, _ = impl
    FSDP = F.FullyShardedDataParallel
    out: dict[str, Any] = {}
    with torch.no_grad():
        out["forward"] = model(torch.ones(2, 8))
    # (torch's default offload_to_cpu aliases exp_avg and exp_avg_sq on CPU)
    with FSDP.state_dict_type(model, F.StateDictType.FULL_STATE_DICT, None,
                              F.FullOptimStateDictConfig(offload_to_cpu=False)):
        out["full"] = _tensors(model.state_dict())
        osd = FSDP.optim_state_dict(model, opt)
        out["optim"] = {f"{k}/{n}": v for k, s in osd["state"].items() for n, v in s.items()}
    with FSDP.state_dict_type(model, F.StateDictType.SHARDED_STATE_DICT):
        out["sharded"] = _tensors(model.state_dict())
    with FSDP.summon_full_params(model, writeback=False):
        # (a root gives clean names here; a bare module, names with the wrappers')
        out["summon"] = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                         for n, p in model.named_parameters()}
    with FSDP.state_dict_type(model, F.StateDictType.FULL_STATE_DICT):
        result = model.load_state_dict(model.state_dict())
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))
    out["load"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["states"] = sorted({u.training_state.name for u in FSDP.fsdp_modules(model)})
    return out


def _diff(what: str, theirs: Any, ours: Any) -> list[str]:
    hit = injected(what)
    if hit:
        return [hit]
    if isinstance(theirs, dict):
        if sorted(theirs) != sorted(ours):
            return [f"{what}: keys torch {sorted(theirs)} ours {sorted(ours)}"]
        return [f for k in theirs for f in _diff(f"{what}[{k}]", theirs[k], ours[k])]
    if isinstance(theirs, torch.Tensor):
        same = isinstance(ours, torch.Tensor) and theirs.shape == ours.shape and torch.equal(theirs, ours)
        return [] if same else [f"{what}: torch {theirs} ours {ours}"]
    return [] if theirs == ours else [f"{what}: torch {theirs!r} ours {ours!r}"]


def _one(cfg: dict[str, Any]) -> list[str]:
    name = f"{cfg['scenario']} {cfg['strategy']} uop={cfg['uop']}"
    impls = _impls()
    built = [_trained(impl, cfg) for impl in impls]
    fails = _diff(f"{name} losses before", built[0][2], built[1][2])
    models = [_orphaned(impl, root, cfg) for impl, (root, _, _) in zip(impls, built)]
    # (the dropped roots live on only as the units' references)
    built = [(None, opt, losses) for _, opt, losses in built]
    views = [_views(impl, m, opt) for impl, m, (_, opt, _) in zip(impls, models, built)]
    fails += _diff(f"{name} after the root went", views[0], views[1])
    # Training: torch's FSDP1 trains these units only under a root.
    reference = models[0] if cfg["scenario"] == "rewrap" else _rewrap(impls[0], models[0], cfg)
    losses = [[_step(m, opt, s) for s in (2, 3)] for m, (_, opt, _) in zip((reference, models[1]), built)]
    fails += _diff(f"{name} losses after", losses[0], losses[1])
    after = [_views(impl, m, opt) for impl, m, (_, opt, _) in zip(impls, (reference, models[1]), built)]
    fails += _diff(f"{name} after training", after[0], after[1])
    return fails


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_sweep(configs, _one, inject=inject)


def test_units_outliving_their_root_behave_as_torch(pool2: Any) -> None:
    for fails in pool2.run(_sweep, _configs()):
        assert not fails, "\n".join(fails[:20])
