"""use_orig_params=True: original parameters changed outside forward, against torch's FSDP1.

torch's FSDP1 copies an original parameter or gradient replaced between steps
(``p.data = t``, ``module.weight = nn.Parameter(t)``, ``p.grad = t``,
``p.grad = None``, ``p.grad.data = t``) into the flat parameter (and flat
gradient) before the next unshard, refuses a shape change with
``RuntimeError("Cannot writeback ...")``, refuses replacing one name of a tied
parameter with ``NotImplementedError`` and, for strategies that keep a unit
unsharded after forward, refuses a change between forward and backward with
an ``AssertionError``.  Each configuration below applies the same change to
torch's FSDP1 and to fsdp_wrap (2 ranks, different data per rank), then
compares the full parameters (``summon_full_params`` and FULL state dict,
both of which write back first) and two training steps.

Last, what the write-back reads: the sharded ``.grad`` of each original
parameter, a view of the flat gradient and equal to torch's FSDP1's.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import cmp, compare_step, loss_of, rank_tag, run_configs, train_step
from tests._sweep import Injection
from tests.models import fsdp_api, fsdp_kwargs, wrap_api

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
CHANGES = ["data", "param", "grad", "grad_none", "grad_data"]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _wrap(impl: str, base: nn.Module, nested: bool, **kw: Any) -> nn.Module:
    import copy

    if nested:
        kw["auto_wrap_policy"] = wrap_api(impl).ModuleWrapPolicy({nn.Linear})
    return fsdp_api(impl).FullyShardedDataParallel(copy.deepcopy(base), **fsdp_kwargs(impl, **kw))


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def _full(impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    cls = fsdp_api(impl).FullyShardedDataParallel
    with cls.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}


def _new_value(like: torch.Tensor) -> torch.Tensor:
    return torch.arange(like.numel(), dtype=like.dtype).view_as(like) * 0.01 + 2.0


def _change(model: nn.Module, change: str, which: int) -> None:
    lin = _linears(model)[which]
    p = lin.weight
    if change == "data":
        p.data = _new_value(p)
    elif change == "param":
        lin.weight = nn.Parameter(_new_value(p))
    elif change == "grad":
        p.grad = _new_value(p)
    elif change == "grad_none":
        p.grad = None
    elif change == "grad_data" and p.grad is not None:
        p.grad.data = _new_value(p)


def _run(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(0)
    base = Model()
    kw = dict(sharding_strategy=cfg["strategy"], use_orig_params=True)
    models = {impl: _wrap(impl, base, cfg["nested"], **kw) for impl in ("torch", "ours")}
    opts = {i: torch.optim.Adam(m.parameters(), lr=1e-2) for i, m in models.items()}
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    xs = [torch.randn(3, 5, generator=gen) for _ in range(3)]
    fails: list[str] = []
    grad_change = cfg["change"].startswith("grad")
    if grad_change:  # an initial gradient to change
        for m in models.values():
            loss_of(m(xs[0])).backward()
    for i, m in models.items():
        _change(m, cfg["change"], cfg["which"])
        if cfg["change"] == "param":  # the optimizer must see the new Parameter
            opts[i] = torch.optim.Adam(m.parameters(), lr=1e-2)
    if grad_change:  # the optimizer reads the changed gradients directly
        for o in opts.values():
            o.step()
    full = {i: _full(i, m) for i, m in models.items()}
    fails += [f"{tag} after the change: {e}" for e in
              (cmp(n, full["torch"][n], full["ours"].get(n), 0.0) for n in full["torch"]) if e]
    names = [n for n, _ in models["ours"].named_parameters()]
    for step, x in enumerate(xs[1:]):
        # no zero_grad before the first step: a changed gradient accumulates
        res = {i: train_step(m, opts[i], loss_of(m(x))) for i, m in models.items()}
        # Bit-exact: the same ops as torch's FSDP1 on the same flat layout, same order.
        fails += compare_step(f"{tag} step {step}", names, res["torch"], res["ours"], 0.0)
    sds = {i: _state_dict(i, m) for i, m in models.items()}
    fails += [f"{tag} FULL state dict: {e}" for e in
              (cmp(k, v, sds["ours"].get(k), 0.0) for k, v in sds["torch"].items()) if e]
    return fails


def _state_dict(impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    api = fsdp_api(impl)
    with api.FullyShardedDataParallel.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, nested=n, change=c, which=w)
            for s, n, c, w in itertools.product(STRATEGIES, (False, True), CHANGES, (0, 1))]


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_configs(configs, _run, inject=inject)


def test_changed_orig_params_are_written_back_as_in_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_sweep, _configs()) for f in r]
    assert not fails, "\n".join(fails[:20])


# ----------------------------------------------------------------- refusals


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))


def _shape_mismatch(impl: str, trigger: str) -> tuple[str, str]:
    """torch's test: each rank replaces a weight it holds with a larger one."""
    torch.manual_seed(0)
    model = _wrap(impl, Model(), False, use_orig_params=True)
    lin = _linears(model)[dist.get_rank()]
    shape = [d + 1 for d in lin.weight.shape]
    lin.weight = nn.Parameter(torch.randn(shape))
    lin.weight.grad = torch.randn(shape)
    if trigger == "summon":
        def go() -> None:
            with fsdp_api(impl).FullyShardedDataParallel.summon_full_params(model):
                pass
    else:
        def go() -> None:
            model(torch.randn(2, 5))
    return _outcome(go)


def _between_fwd_bwd(impl: str, how: str) -> tuple[str, str]:
    torch.manual_seed(0)
    model = _wrap(impl, Model(), True, use_orig_params=True, sharding_strategy="SHARD_GRAD_OP")
    loss = model(torch.randn(2, 5)).sum()
    lin = _linears(model)[0]
    if how == "data":
        lin.weight.data = lin.weight.clone()
    else:
        lin.weight = nn.Parameter(lin.weight.detach().clone())
    return _outcome(loss.backward)


def _tied_alias(impl: str, _: str) -> tuple[str, str]:
    """Replacing the second name of a tied parameter (torch: not supported)."""
    from tests.models import build, new_model

    torch.manual_seed(0)
    model = build("transformer", impl, new_model("transformer"), use_orig_params=True)
    head = next(m for n, m in model.named_modules() if n.endswith("head"))
    head.weight = nn.Parameter(head.weight.detach().clone())
    return _outcome(lambda: model(torch.zeros(2, 3, dtype=torch.long)))


def _refusals() -> list[str]:
    warnings.simplefilter("ignore")
    fails = []
    cases = [(_shape_mismatch, t, "Cannot writeback when the parameter shape changes")
             for t in ("summon", "forward")]
    cases += [(_between_fwd_bwd, h, "FSDP does not support changing the parameters between "
               "forward and backward for ") for h in ("data", "param")]
    cases.append((_tied_alias, "", "Changing shared parameters is not supported yet"))
    for fn, arg, text in cases:
        ref, ours = fn("torch", arg), fn("ours", arg)
        name = f"{rank_tag()} {fn.__name__}({arg})"
        if ref[0] != ours[0] or text not in ref[1] or text not in ours[1]:
            fails.append(f"{name}: torch {ref} vs ours {ours}")
        elif f"rank {dist.get_rank()}" not in ours[1] or not any(
                n in ours[1] for n in ("'lin", "'head.weight'")):
            fails.append(f"{name}: message names neither rank nor parameter: {ours[1]}")
    return fails


def test_writeback_refusals_match_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_refusals) for f in r]
    assert not fails, "\n".join(fails)



# ---------------------------------------------------------------------------
# the original parameters' gradients: views of the flat gradient
# ---------------------------------------------------------------------------


class _Odd(nn.Module):
    """Parameters of odd sizes (42 elements): on 2 ranks some lie wholly in one
    rank's shard and one spans both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 1)   # 3 + 1
        self.b = nn.Linear(1, 9)   # 9 + 9
        self.c = nn.Linear(9, 2)   # 18 + 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.a(x))))


def _flat_grad_views(model: nn.Module, names: list[str]) -> list[str]:
    """fsdp_wrap's sharded ``.grad`` of each original parameter is the view of
    the flat gradient at the parameter's piece of the shard, ``None`` where the
    shard holds none of it."""
    handle = model._all_handles[0]  # type: ignore[index]
    flat = handle.flat_param.grad
    fails = []
    for i, info in enumerate(handle.infos):
        sl, g, name = handle.param_shard_slice(i), info.param.grad, names[i]
        if sl is None or g is None:
            if (sl is None) != (g is None):
                fails.append(f"{name}: shard slice {sl} but grad {g}")
        elif (g.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
              or g.storage_offset() != flat.storage_offset() + sl[0]
              or g.numel() != sl[1] - sl[0] or not torch.equal(g, flat[sl[0]:sl[1]])):
            fails.append(f"{name}: not the view flat.grad[{sl[0]}:{sl[1]}]")
    return fails


def _grad_views(cfg: dict[str, Any]) -> list[str]:
    """After a second backward (a fresh flat gradient after ``zero_grad``), per
    original parameter and rank: ``.grad`` equal to torch's FSDP1's (``None``
    or not, shape, dtype, values), and a view of the flat gradient."""
    import copy

    torch.manual_seed(0)
    base = _Odd()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    got: dict[str, list[tuple[str, Any]]] = {}
    fails: list[str] = []
    for impl in ("torch", "ours"):
        kw: dict[str, Any] = {"sharding_strategy": cfg["strategy"], "use_orig_params": True}
        if cfg["low_grads"]:  # (bf16 gradients on fp32 parameters: set through .grad.data)
            kw["mixed_precision"] = fsdp_api(impl).MixedPrecision(
                param_dtype=torch.bfloat16, keep_low_precision_grads=True)
        model = fsdp_api(impl).FullyShardedDataParallel(copy.deepcopy(base), **fsdp_kwargs(impl, **kw))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        got[impl] = [(n.replace("_fsdp_wrapped_module.", ""), p.grad) for n, p in model.named_parameters()]
        if impl == "ours":
            fails += _flat_grad_views(model, [n for n, _ in got[impl]])
    for (name, a), (_, b) in zip(got["torch"], got["ours"]):
        if (a is None) != (b is None) or (a is not None and (
                a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b))):
            fails.append(f"{name}: torch {a} vs ours {b}")
    return [f"{rank_tag()} {cfg}: {f}" for f in fails]


def test_sharded_grads_are_views_of_the_flat_gradient(pool2: Any) -> None:
    configs = [{"strategy": s, "low_grads": False} for s in ("FULL_SHARD", "SHARD_GRAD_OP")]
    configs.append({"strategy": "FULL_SHARD", "low_grads": True})
    fails = [f for r in pool2.run(run_configs, configs, _grad_views) for f in r]
    assert not fails, "\n".join(fails)
