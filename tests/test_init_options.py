"""Construction options: sync_module_states, meta-device init, device_id=cpu (2 ranks).

* ``sync_module_states=True`` with a different model on every rank: every rank
  ends with rank 0's parameters and buffers, then trains like a plain
  replicated copy of rank 0's model (torch's FSDP1 raises on CPU here,
  reference section 12, so the oracle is the replicated model).
* Meta-device init: ``param_init_fn`` is called on the same modules in the
  same order as torch's; the default path (``to_empty`` + ``reset_parameters``)
  gives exactly the values of a model built off meta when
  ``reset_parameters`` is deterministic, and the same as torch's; tensors
  still on meta afterwards are an error naming them.
* ``device_id=torch.device("cpu")`` matches torch step by step.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import (
    LONGEST_SUM,
    Replicated,
    cmp,
    compare_step,
    fsdp_params_full,
    loss_of,
    rank_tag,
    replicated_tol,
    run_configs,
    train_step,
)
from tests._sweep import Injection, any_rank
from tests.models import build, fsdp_api, fsdp_kwargs, make_input, new_model, wrap_api

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


# ---------------------------------------------------------------------------
# a model whose reset_parameters is deterministic (no RNG)
# ---------------------------------------------------------------------------


class DetLinear(nn.Linear):
    def reset_parameters(self) -> None:
        n = self.weight.numel()
        with torch.no_grad():
            self.weight.copy_(torch.linspace(-0.5, 0.5, n).reshape(self.weight.shape).cos() * 0.3)
            if self.bias is not None:
                self.bias.copy_(torch.linspace(-0.1, 0.2, self.bias.numel()))


class DetNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.copy_(torch.linspace(0.8, 1.2, self.weight.numel()))
            self.bias.copy_(torch.linspace(-0.05, 0.05, self.bias.numel()))


class DetBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = DetLinear(6, 9)
        self.norm = DetNorm(9)
        self.b = DetLinear(9, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.norm(self.a(x))))


class DetNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = DetLinear(5, 6)
        self.blocks = nn.Sequential(DetBlock(), DetBlock())
        self.out = DetLinear(6, 3, bias=False)
        self.register_buffer("shift", torch.zeros(3))

    def reset_parameters(self) -> None:  # owns a buffer, so it is materialised directly
        with torch.no_grad():
            self.shift.copy_(torch.tensor([0.1, -0.2, 0.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x))) + self.shift


def _det_net(meta: bool) -> DetNet:
    if meta:
        with torch.device("meta"):
            return DetNet()
    net = DetNet()
    net.reset_parameters()
    return net


def _wrap(impl: str, model: nn.Module, **kw: Any) -> nn.Module:
    api = fsdp_api(impl)
    policy = wrap_api(impl).ModuleWrapPolicy({DetBlock})
    return api.FullyShardedDataParallel(model, auto_wrap_policy=policy, **fsdp_kwargs(impl, **kw))


def _x(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(4, 5, generator=gen)


def _lockstep(tag: str, ref: nn.Module, ours: nn.Module, inputs: Any, steps: int = 3) -> list[str]:
    names = [n for n, _ in ref.named_parameters()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ours)]
    for step in range(steps):
        x = inputs()
        res = []
        for m, o in zip((ref, ours), opts):
            res.append(train_step(m, o, loss_of(m(x))))
        # Bit-exact: torch's FSDP1 and fsdp_wrap compute every step by the same
        # ops on the same flat-parameter layout, reduced in the same order.
        fails = compare_step(f"{tag} step {step}", names, res[0], res[1], 0.0)
        # agreed: a rank stopping alone would leave the others in the next step's collectives
        if any_rank(bool(fails)):
            return fails
    return []


# ---------------------------------------------------------------------------
# worker tasks
# ---------------------------------------------------------------------------


def _sync_configs() -> list[dict[str, Any]]:
    return [dict(k=k, strategy=s, uop=uop)
            for k, (s, uop) in enumerate(itertools.product(STRATEGIES, [False, True]))]


def _sync_module_states(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    rank = dist.get_rank()

    def one(cfg: dict[str, Any]) -> list[str]:
        k, s, uop = cfg["k"], cfg["strategy"], cfg["uop"]
        tag = f"{rank_tag()} sync_module_states {s} uop={uop}"
        torch.manual_seed(50 + k + 1000 * rank)  # a different model on every rank
        mine = new_model("transformer")
        mine.scale.mul_(rank + 1)  # buffers too
        torch.manual_seed(50 + k)
        rank0 = new_model("transformer")
        ours = build("transformer", "ours", mine, sharding_strategy=s, use_orig_params=uop,
                     sync_module_states=True)
        full = fsdp_params_full(ours)
        sd = ours.state_dict()
        errs = [cmp(f"param {n}", p, full.get(n), 0.0) for n, p in rank0.named_parameters()]
        errs += [cmp(f"buffer {n}", b, sd.get(n), 0.0) for n, b in rank0.named_buffers()]
        errs = [e for e in errs if e]
        # agreed: a rank returning alone would leave the others in training's collectives
        if any_rank(bool(errs)):
            return [f"{tag}: " + "; ".join(errs[:5])] if errs else []
        ref = Replicated(rank0)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref.module)]
        gen = torch.Generator().manual_seed(7 + rank)
        for step in range(2):
            x = make_input("transformer", gen)
            for m, o in zip((ours, ref.module), opts):
                loss_of(m(x)).backward()
                if m is ref.module:
                    ref.sync()
                o.step()
                o.zero_grad()
            got = fsdp_params_full(ours)
            # Against the replicated model: the same sums (2 ranks: one add),
            # possibly blocked differently by the BLAS for flat-parameter views
            # (see replicated_tol); bit-exact on the machines measured so far.
            tol = replicated_tol(step, dist.get_world_size(), LONGEST_SUM["transformer"])
            errs = [e for e in (cmp(f"param {n}", p, got.get(n), tol)
                                for n, p in ref.module.named_parameters()) if e]
            if any_rank(bool(errs)):  # agreed, as above
                return [f"{tag} step {step}: " + "; ".join(errs[:5])] if errs else []
        return []

    fails = run_configs(configs, one, inject=inject)
    # Torch's FSDP1 cannot do this on CPU (documented difference); it raises on
    # every rank alike, before any collective.
    try:
        fsdp_api("torch").FullyShardedDataParallel(new_model("deep"), **fsdp_kwargs("torch", sync_module_states=True))
        fails.append(f"{rank_tag()} torch's FSDP1 now supports sync_module_states on CPU: update docs/options.rst")
    except ValueError:
        pass
    return fails


def _meta_param_init_fn_calls(uops: list[bool], inject: Injection | None = None) -> list[str]:
    """param_init_fn: same modules, same order, same values, same training as torch's."""
    warnings.simplefilter("ignore")

    def one(uop: bool) -> list[str]:
        fails: list[str] = []
        calls: dict[str, list[str]] = {"torch": [], "ours": []}
        models = {}
        for impl in ("torch", "ours"):
            def init(m: nn.Module, log: list[str] = calls[impl]) -> None:
                log.append(type(m).__name__)
                m.to_empty(device=torch.device("cpu"), recurse=False)
                reset = getattr(m, "reset_parameters", None)
                if reset is not None and any(True for _ in m.parameters(recurse=False)) or isinstance(m, DetNet):
                    reset()
            models[impl] = _wrap(impl, _det_net(meta=True), use_orig_params=uop, param_init_fn=init)
        tag = f"{rank_tag()} param_init_fn uop={uop}"
        if calls["torch"] != calls["ours"]:
            fails.append(f"{tag}: calls torch {calls['torch']} vs ours {calls['ours']}")
        p1, p2 = fsdp_params_full(models["torch"]), fsdp_params_full(models["ours"])
        fails += [f"{tag}: {e}" for e in (cmp(f"param {n}", p, p2.get(n), 0.0) for n, p in p1.items()) if e]
        gen = torch.Generator().manual_seed(3 + dist.get_rank())
        fails += _lockstep(tag, models["torch"], models["ours"], lambda gen=gen: _x(gen))
        return fails

    return run_configs(uops, one, lambda uop: f"{rank_tag()} uop={uop}", inject)  # type: ignore[arg-type]


def _meta_default_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=uop)
            for s, uop in [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", True)]]


def _meta_default_reset_parameters(configs: list[dict[str, Any]],
                                   inject: Injection | None = None) -> list[str]:
    """Default meta init == the same model built off meta == torch's meta init."""
    warnings.simplefilter("ignore")

    def one(cfg: dict[str, Any]) -> list[str]:
        s, uop = cfg["strategy"], cfg["uop"]
        tag = f"{rank_tag()} meta default init {s} uop={uop}"
        ours = _wrap("ours", _det_net(meta=True), sharding_strategy=s, use_orig_params=uop)
        ref = _wrap("torch", _det_net(meta=True), sharding_strategy=s, use_orig_params=uop)
        plain = _det_net(meta=False)
        got, torch_got = fsdp_params_full(ours), fsdp_params_full(ref)
        errs = [cmp(f"param {n} vs non-meta model", p, got.get(n), 0.0) for n, p in plain.named_parameters()]
        errs += [cmp(f"param {n} vs torch", p, got.get(n), 0.0) for n, p in torch_got.items()]
        sd = ours.state_dict()
        errs += [cmp(f"buffer {n}", b, sd.get(n), 0.0) for n, b in plain.named_buffers()]
        if any(t.is_meta for t in sd.values()):
            errs.append("state_dict still holds meta tensors")
        errs = [e for e in errs if e]
        # agreed: a rank returning alone would leave the others in training's collectives
        if any_rank(bool(errs)):
            return [f"{tag}: " + "; ".join(errs[:5])] if errs else []
        gen = torch.Generator().manual_seed(5 + dist.get_rank())
        return _lockstep(tag, ref, ours, lambda gen=gen: _x(gen))

    return run_configs(configs, one, inject=inject)


def _meta_errors() -> list[str]:
    import fsdp_wrap as fw

    warnings.simplefilter("ignore")
    fails: list[str] = []
    # param_init_fn that leaves tensors on meta: an error naming them.
    try:
        _wrap("ours", _det_net(meta=True), param_init_fn=lambda m: None)
        fails.append("param_init_fn leaving meta tensors: no error")
    except RuntimeError as e:
        msg = str(e)
        for needle in ("meta", "a.weight", f"rank {dist.get_rank()}"):
            if needle not in msg:
                fails.append(f"leftover-meta error does not mention {needle!r}: {msg}")

    # A module holding meta tensors without reset_parameters(): an error naming its class.
    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    with torch.device("meta"):
        m = NoReset()
    try:
        fw.FullyShardedDataParallel(m)
        fails.append("meta module without reset_parameters: no error")
    except (ValueError, AttributeError, RuntimeError, TypeError) as e:
        if "NoReset" not in str(e):
            fails.append(f"no-reset_parameters error does not name the class: {type(e).__name__}: {e}")
    return fails


def _device_id_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=uop)
            for s, uop in [("FULL_SHARD", True), ("SHARD_GRAD_OP", False), ("NO_SHARD", False)]]


def _device_id_cpu(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    import fsdp_wrap as fw

    warnings.simplefilter("ignore")

    def one(cfg: dict[str, Any]) -> list[str]:
        s, uop = cfg["strategy"], cfg["uop"]
        fails: list[str] = []
        torch.manual_seed(9)
        base = new_model("transformer")
        kw = dict(sharding_strategy=s, use_orig_params=uop, device_id=torch.device("cpu"))
        ref, ours = build("transformer", "torch", base, **kw), build("transformer", "ours", base, **kw)
        tag = f"{rank_tag()} device_id=cpu {s} uop={uop}"
        if ours.compute_device != torch.device("cpu"):
            fails.append(f"{tag}: compute_device {ours.compute_device}")
        if any(u.compute_device != torch.device("cpu") for u in fw.FullyShardedDataParallel.fsdp_modules(ours)):
            fails.append(f"{tag}: a nested unit's compute_device is not cpu")
        gen = torch.Generator().manual_seed(13 + dist.get_rank())
        return fails + _lockstep(tag, ref, ours, lambda gen=gen: make_input("transformer", gen))

    return run_configs(configs, one, inject=inject)


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


def _check(pool: Any, fn: Any, *args: Any) -> None:
    fails = [f for r in pool.run(fn, *args) for f in r]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_sync_module_states_gives_rank0_values(pool2: Any) -> None:
    _check(pool2, _sync_module_states, _sync_configs())


def test_meta_param_init_fn_like_torch(pool2: Any) -> None:
    _check(pool2, _meta_param_init_fn_calls, [False, True])


def test_meta_default_reset_parameters(pool2: Any) -> None:
    _check(pool2, _meta_default_reset_parameters, _meta_default_configs())


def test_meta_leftovers_are_errors(pool2: Any) -> None:
    _check(pool2, _meta_errors)


def test_device_id_cpu_matches_torch(pool2: Any) -> None:
    _check(pool2, _device_id_cpu, _device_id_configs())


@pytest.mark.parametrize("meta", [False, True])
def test_det_net_is_deterministic(meta: bool) -> None:
    a, b = _det_net(meta=False), _det_net(meta=False)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    if meta:
        assert all(t.is_meta for t in _det_net(meta=True).state_dict().values())
