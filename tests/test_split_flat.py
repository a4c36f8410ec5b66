"""Units split into several flat parameters (issue 20): LoRA-shaped units
mixing frozen and trainable parameters, and dtypes, train like a plain
replicated model; frozen flat parameters hold no gradient and no optimizer
state; gradient memory is the trainable shard only; a rank whose shard of
every trainable flat parameter is empty steps, saves and loads like the
others.

Reference: the same training in float64 on a plain model replicated on every
rank (gradients all-reduced and divided by the world size), held to the fp32
bound of :func:`tests._options_common.fp32_bound`.  torch's FSDP1 refuses
these units with ``use_orig_params=False`` and mixed dtypes with either
setting; the ``use_orig_params=True`` one-dtype case is compared with torch in
tests/test_parity.py (group ``frozen_mixed``).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from tests._options_common import fp32_bound
from tests._sweep import Injection, any_rank, injected, run_sweep
from tests.models import HIDDEN, LoraNet, float_input, lora_policy

FSDP = fsdp_wrap.FullyShardedDataParallel
STEPS = 3
# The longest sum these models compute: a weight gradient over the 3 x 4 rows
# of a batch times the widest input (HIDDEN); the loss's mean is over 3*4*3.
LONGEST_SUM = 3 * 4 * HIDDEN


def _configs(ws: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    grid = itertools.product(
        (False, True), ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), ("fp32", "fp64"), (False, True)
    )
    for i, (uop, strategy, base, tiny) in enumerate(grid):
        out.append(dict(uop=uop, strategy=strategy, base=base, tiny=tiny,
                        nosync=i % 3 == 0, clip=i % 2 == 0, offload=i % 5 == 1,
                        sd=strategy != "NO_SHARD" and i % 2 == 1, idx=i))
    return out


def _describe(cfg: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in cfg.items()) + "}"


def _wrap(base: nn.Module, cfg: dict[str, Any]) -> nn.Module:
    return FSDP(
        copy.deepcopy(base), auto_wrap_policy=lora_policy("ours"),
        use_orig_params=cfg["uop"], sharding_strategy=getattr(fsdp_wrap.ShardingStrategy, cfg["strategy"]),
        cpu_offload=fsdp_wrap.CPUOffload(offload_params=cfg["offload"]),
    )


class _Reference:
    """The float64 replicated model: same data, same reduction (a mean over
    ranks), same clipping and optimizer."""

    def __init__(self, base: nn.Module, cfg: dict[str, Any]) -> None:
        self.model = copy.deepcopy(base).double()
        self.opt = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=0.01)
        self.cfg = cfg

    def step(self, x: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.cfg["nosync"]:
            self.model(x2.double()).pow(2).mean().backward()
        loss = self.model(x.double()).pow(2).mean()
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        norm = torch.nn.utils.clip_grad_norm_(params, 0.05) if self.cfg["clip"] else None
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach(), norm


def _handles(model: nn.Module) -> list[Any]:
    return [h for u in FSDP.fsdp_modules(model) for h in u._handles]


def grad_bytes(model: nn.Module) -> int:
    """Bytes of every gradient this rank holds (flat and original, each storage once)."""
    storages: dict[int, int] = {}
    tensors = [h.flat_param.grad for h in _handles(model)] + [p.grad for p in model.parameters()]
    for g in tensors:
        if g is not None:
            storages[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    return sum(storages.values())


def _trainable_shard_bytes(model: nn.Module) -> int:
    return sum(h.shard_numel * h.flat_param.element_size()
               for h in _handles(model) if h.flat_param.requires_grad)


def _check_split(model: nn.Module, cfg: dict[str, Any]) -> list[str]:
    """Each block unit: one flat parameter per (requires_grad, dtype), trainable first."""
    fails = []
    want = 2 if cfg["base"] == "fp32" else 3
    for unit in FSDP.fsdp_modules(model):
        if unit is model:
            continue
        kinds = [(h.flat_param.requires_grad, h.flat_param.dtype) for h in unit._handles]
        if len(kinds) != want or not kinds[0][0] or len(set(kinds)) != len(kinds):
            fails.append(f"unit {unit._handles[0].unit_fqn}: flat parameters {kinds}")
    return fails


def _check_grads(model: nn.Module, opt: torch.optim.Optimizer, tag: str) -> list[str]:
    """After a synced backward: frozen flat parameters and originals carry no
    gradient; the gradients held are exactly the trainable shards."""
    fails = []
    for h in _handles(model):
        if not h.flat_param.requires_grad and h.flat_param.grad is not None:
            fails.append(f"{tag}: frozen flat parameter of {h.unit_fqn!r} has a gradient")
    frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    if frozen_with_grad:
        fails.append(f"{tag}: frozen parameters with a gradient: {frozen_with_grad}")
    held, shards = grad_bytes(model), _trainable_shard_bytes(model)
    if held > shards:
        fails.append(f"{tag}: {held} gradient bytes held, trainable shards are {shards}")
    return fails


def _check_optim_state(model: nn.Module, opt: torch.optim.Optimizer, tag: str) -> list[str]:
    frozen = [p for p in opt.state if not p.requires_grad]
    return [f"{tag}: optimizer state for {len(frozen)} frozen tensors"] if frozen else []


def _cmp(what: str, exact: torch.Tensor, got: torch.Tensor, step: int) -> list[str]:
    bad = injected(what)
    if bad:
        return [bad]
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    bound = fp32_bound(step, dist.get_world_size(), scale, LONGEST_SUM)
    d = float((exact.double() - got.detach().double().cpu()).abs().max()) if exact.numel() else 0.0
    return [f"{what}: {d:.3g} from float64 (bound {bound:.3g}, step {step})"] if d > bound else []


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}


def _train(model: nn.Module, opt: torch.optim.Optimizer, ref: _Reference, cfg: dict[str, Any],
           gen: torch.Generator, tag: str, steps: range) -> list[str]:
    fails: list[str] = []
    for step in steps:
        x, x2 = float_input(gen), float_input(gen)
        if cfg["nosync"]:
            with model.no_sync():
                model(x2).pow(2).mean().backward()
        loss = model(x).pow(2).mean()
        loss.backward()
        fails += _check_grads(model, opt, f"{tag} step {step}")
        norm = model.clip_grad_norm_(0.05) if cfg["clip"] else None
        opt.step()
        opt.zero_grad()
        fails += _check_optim_state(model, opt, f"{tag} step {step}")
        loss64, norm64 = ref.step(x, x2)
        fails += _cmp(f"{tag} loss step {step}", loss64, loss, step)
        if norm is not None and norm64 is not None:
            fails += _cmp(f"{tag} clip norm step {step}", norm64, norm, step)
        full = _full_params(model)
        for name, p64 in ref.model.named_parameters():
            fails += _cmp(f"{tag} param {name}", p64.detach(), full[name], step)
        if any_rank(bool(fails)):
            return fails
    return fails


def _one(cfg: dict[str, Any]) -> list[str]:
    rank = dist.get_rank()
    tag = f"[rank {rank}] {_describe(cfg)}"
    torch.manual_seed(cfg["idx"])
    base = LoraNet(torch.float64 if cfg["base"] == "fp64" else torch.float32, cfg["tiny"])
    model = _wrap(base, cfg)
    fails = _check_split(model, cfg)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref = _Reference(base, cfg)
    gen = torch.Generator().manual_seed(1000 + 7919 * rank + cfg["idx"])
    fails += _train(model, opt, ref, cfg, gen, tag, range(STEPS))
    if cfg["sd"] and not any_rank(bool(fails)):
        fails += _state_dict_round_trip(model, opt, base, ref, cfg, gen, tag)
    return fails


def _state_dict_round_trip(model: nn.Module, opt: torch.optim.Optimizer, base: nn.Module,
                           ref: _Reference, cfg: dict[str, Any], gen: torch.Generator,
                           tag: str) -> list[str]:
    """FULL and SHARDED model and optimizer state dicts into a fresh model and
    optimizer; training goes on as if never interrupted (against the same
    float64 reference).  Frozen weights have no optimizer state."""
    fails: list[str] = []
    for sd_type in (fsdp_wrap.StateDictType.FULL_STATE_DICT, fsdp_wrap.StateDictType.SHARDED_STATE_DICT):
        with FSDP.state_dict_type(model, sd_type):
            msd = model.state_dict()
            osd = FSDP.optim_state_dict(model, opt)
        frozen_names = {n for n, p in base.named_parameters() if not p.requires_grad}
        with_state = [k for k in osd["state"] if k in frozen_names]
        if with_state:
            fails.append(f"{tag} {sd_type.name}: optimizer state for frozen {with_state}")
        fresh = _wrap(base, cfg)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        with FSDP.state_dict_type(fresh, sd_type):
            fresh.load_state_dict(msd)
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
        model, opt = fresh, fresh_opt
    step = STEPS
    fails += _train(model, opt, ref, cfg, gen, f"{tag} after FULL+SHARDED reload", range(step, step + 1))
    return fails


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    return run_sweep(configs, _one, _describe, inject)


@pytest.mark.parametrize("ws", [2, 3])
def test_split_units_train_like_a_replicated_model(request: pytest.FixtureRequest, ws: int) -> None:
    """LoRA-shaped units, both use_orig_params settings, every strategy, a
    float64 base beside float32 adapters, offload, no_sync, clipping; at 3
    ranks the tiny-trainable model leaves ranks 1 and 2 with nothing to train."""
    pool = request.getfixturevalue(f"pool{ws}")
    results = pool.run(_sweep, _configs(ws))
    failures = [f for fails in results for f in fails]
    assert not failures, "\n".join(failures[:20])


def _empty_trainable_shards() -> list[str]:
    """The tiny model at this world size: which ranks hold no trainable element."""
    torch.manual_seed(0)
    model = FSDP(LoraNet(tiny_trainable=True), auto_wrap_policy=lora_policy("ours"))
    empty = all(h.shard_valid_numel == 0 for h in _handles(model) if h.flat_param.requires_grad)
    return [str(empty)]


def test_world_size_forces_ranks_with_nothing_to_train(pool3: Any) -> None:
    """The sweep's premise holds: at 3 ranks, ranks 1 and 2 hold no trainable element."""
    assert pool3.run(_empty_trainable_shards) == [["False"], ["True"], ["True"]]


def _grad_ratios() -> list[float]:
    torch.manual_seed(0)
    base = LoraNet()
    model = FSDP(copy.deepcopy(base), auto_wrap_policy=lora_policy("ours"), use_orig_params=True)
    model(float_input(torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    share = sum(p.numel() for p in base.parameters() if p.requires_grad) * 4 / dist.get_world_size()
    return [grad_bytes(model) / share, _trainable_shard_bytes(model) / share]


def test_gradient_bytes_are_the_trainable_shard(pool2: Any) -> None:
    """After backward a rank holds the gradient of its trainable shard only:
    padding aside, its share of the trainable parameters (with these odd
    sizes the padding is a few elements per flat parameter)."""
    for ratio, padded in pool2.run(_grad_ratios):
        assert ratio == padded, (ratio, padded)
        assert ratio <= 1.1, ratio
