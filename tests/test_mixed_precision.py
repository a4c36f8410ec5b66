"""MixedPrecision: every field, step by step against torch's FSDP1 on CPU (2 ranks).

One model is deep-copied into torch's FSDP1 and fsdp_wrap with the same
``MixedPrecision``; both train in lockstep on different data per rank.  After
every step the loss, the gradients the optimizer sees (values *and* dtype),
the parameters, the buffers and the dtypes each collective moved must agree.
Low-precision results are compared with torch's own test tolerances for the
dtype (``torch.testing.assert_close`` defaults: bf16 rtol 1.6e-2, fp16 rtol
1e-3, atol 1e-5); the master parameters the optimizer sees must stay float32.

Also here: inputs as each unit sees them (``cast_forward_inputs`` /
``cast_root_forward_inputs``), BatchNorm getting its own full-precision unit
(``_module_classes_to_ignore``) and FULL state dicts returning buffers in
their original dtype.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap.comm.collectives as C
from tests._options_common import loss_of, maxdiff, rank_tag, run_configs, shape_of
from tests._sweep import Injection, any_rank, injected
from tests.models import build, fsdp_api, make_input, new_model, wrap_api

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
RTOL = {BF16: 1.6e-2, FP16: 1e-3, FP32: 1.3e-6}
ATOL = 1e-5
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


# ---------------------------------------------------------------------------
# models for the cast and BatchNorm checks
# ---------------------------------------------------------------------------


class Child(nn.Module):
    """A unit that also takes the raw float input, to see whether it was cast."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.lin(h) * torch.sigmoid(x.to(h.dtype))


class CastNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 5)
        self.c1 = Child()
        self.c2 = Child()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.to(self.inp.weight.dtype))
        return self.c2(self.c1(h, x), x)


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.bn(self.lin(x))))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(BNBlock(), BNBlock())
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


LOCAL_MODELS = {"cast": (CastNet, Child), "bn": (BNNet, BNBlock)}


def _new(name: str) -> nn.Module:
    return LOCAL_MODELS[name][0]() if name in LOCAL_MODELS else new_model(name)


def _build(name: str, impl: str, base: nn.Module, **kw: Any) -> nn.Module:
    if name in LOCAL_MODELS:
        import copy

        from tests.models import fsdp_cls, fsdp_kwargs

        policy = wrap_api(impl).ModuleWrapPolicy({LOCAL_MODELS[name][1]})
        return fsdp_cls(impl)(copy.deepcopy(base), auto_wrap_policy=policy, **fsdp_kwargs(impl, **kw))
    return build(name, impl, base, **kw)


def _input(name: str, gen: torch.Generator) -> torch.Tensor:
    if name in LOCAL_MODELS:
        return torch.randn(4, 5, generator=gen)
    return make_input(name, gen)


# ---------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------


def _configs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(group: str, model: str, strategy: str, uop: bool, **mp: Any) -> None:
        out.append(dict(group=group, model=model, strategy=strategy, uop=uop, mp=mp, idx=len(out)))

    # param_dtype alone: reduce_dtype inferred (torch: reduce = param dtype).
    for dt, s, uop in ((dt, s, uop) for dt in (BF16, FP16) for s in STRATEGIES for uop in (False, True)):
        add("param_dtype", "deep", s, uop, param_dtype=dt)
    # reduce_dtype explicit: full-precision reduction of low-precision compute,
    # low-precision reduction of full-precision compute, and a mix.
    for s, uop in [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", True)]:
        add("reduce_dtype", "deep", s, uop, param_dtype=BF16, reduce_dtype=FP32)
        add("reduce_dtype", "deep", s, not uop, reduce_dtype=BF16)
        add("reduce_dtype", "deep", s, uop, param_dtype=FP16, reduce_dtype=BF16)
    # buffer_dtype alone and with param_dtype (transformer's `scale`, deep's `bias2`).
    for s, uop in [("FULL_SHARD", True), ("SHARD_GRAD_OP", False), ("NO_SHARD", False)]:
        add("buffer_dtype", "deep", s, uop, param_dtype=BF16, buffer_dtype=BF16)
        add("buffer_dtype", "transformer", s, not uop, param_dtype=FP16, buffer_dtype=FP16)
    # keep_low_precision_grads: the optimizer sees grads in the reduce dtype.
    for s, uop in [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False), ("FULL_SHARD", True)]:
        add("keep_low_precision_grads", "deep", s, uop, param_dtype=BF16, keep_low_precision_grads=True)
    # torch keeps them in param_dtype even when the reduction ran in float32.
    add("keep_low_precision_grads_fp32_reduce", "transformer", "FULL_SHARD", False,
        param_dtype=BF16, reduce_dtype=FP32, buffer_dtype=BF16, keep_low_precision_grads=True)
    # cast_forward_inputs / cast_root_forward_inputs: what dtype each unit's input has.
    # (torch's root casts when *either* flag is set: its pre-forward applies
    # cast_forward_inputs to every unit, the root included.)
    for k, (root, fwd) in enumerate([(True, False), (False, True), (False, False), (True, True)]):
        add("cast_inputs" if (root, fwd) != (False, True) else "cast_root_false_forward_true", "cast", STRATEGIES[k % 3], k % 2 == 0, param_dtype=BF16,
            cast_root_forward_inputs=root, cast_forward_inputs=fwd)
    # _module_classes_to_ignore: BatchNorm gets its own unit without mixed precision.
    for s, uop in [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)]:
        add("module_classes_to_ignore", "bn", s, uop, param_dtype=BF16, buffer_dtype=BF16)
    add("module_classes_to_ignore", "bn", "FULL_SHARD", True, param_dtype=FP16, buffer_dtype=FP16,
        _module_classes_to_ignore=())
    return out


def _describe(cfg: dict[str, Any]) -> str:
    mp = ", ".join(f"{k}={v}" for k, v in cfg["mp"].items())
    return f"{{{cfg['model']}, {cfg['strategy']}, uop={cfg['uop']}, MP({mp})}}"


# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------

_COLLECTIVES = {
    "all_gather": "AG", "all_gather_into_tensor": "AG", "all_gather_single": "AG",
    "reduce_scatter_tensor": "RS", "reduce_scatter_single": "RS", "reduce_scatter": "RS",
    "all_reduce": "AR",
}


@contextlib.contextmanager
def _record_collectives(log: list[tuple[str, str]]) -> Iterator[None]:
    """Log (kind, dtype) of every all-gather / reduce-scatter / all-reduce issued."""
    # Older torch lacks the ``*_single`` names (added in 2.13): spy on those it has.
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def spy(name: str) -> Any:
        real = saved[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            t = args[1] if name != "all_reduce" else args[0]
            if isinstance(t, (list, tuple)):
                t = t[0]
            log.append((_COLLECTIVES[name], str(t.dtype)))
            return real(*args, **kwargs)

        return call

    for name in saved:
        setattr(dist, name, spy(name))
    # On gloo, fsdp_wrap carries its collectives by others (see
    # ``fsdp_wrap/comm/collectives.py``: a scratch gradient's reduce-scatter by an
    # all-reduce of it, over two ranks both by one exchange): log each call as
    # the collective it is.
    real_rs, real_ag = C.reduce_scatter_sum, C.all_gather_into

    def reduce_scatter_sum(output: Any, padded_input: Any, *args: Any, **kwargs: Any) -> Any:
        n = len(log)
        out = real_rs(output, padded_input, *args, **kwargs)
        del log[n:]
        log.append(("RS", str(padded_input.dtype)))
        return out

    def all_gather_into(output: Any, *args: Any, **kwargs: Any) -> Any:
        n = len(log)
        out = real_ag(output, *args, **kwargs)
        del log[n:]
        log.append(("AG", str(output.dtype)))
        return out

    C.reduce_scatter_sum = reduce_scatter_sum  # type: ignore[assignment]
    C.all_gather_into = all_gather_into  # type: ignore[assignment]
    try:
        yield
    finally:
        C.reduce_scatter_sum = real_rs  # type: ignore[assignment]
        C.all_gather_into = real_ag  # type: ignore[assignment]
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _record_inputs(model: nn.Module, cls: type[nn.Module], log: list[str]) -> None:
    """Log the dtype of the float inputs each (unwrapped) ``cls`` module receives."""
    for m in model.modules():
        if type(m) is cls or type(m) is CastNet:
            def hook(mod: nn.Module, args: Any) -> None:
                log.append(f"{type(mod).__name__}:" + ",".join(str(a.dtype) for a in args))
            m.register_forward_pre_hook(hook)


def _close(what: str, a: torch.Tensor | None, b: torch.Tensor | None, rtol: float) -> str | None:
    """None if ``a`` (torch) and ``b`` (ours) agree within ``rtol``, else why not."""
    bad = injected(what)
    if bad:
        return bad
    if a is None or b is None:
        return None if a is None and b is None else f"{what}: torch {shape_of(a)} vs ours {shape_of(b)}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{what}: torch {shape_of(a)} vs ours {shape_of(b)}"
    if a.numel() == 0:
        return None
    bound = ATOL + rtol * a.detach().float().abs()
    excess = ((a.detach().float() - b.detach().float()).abs() - bound).max()
    return None if float(excess) <= 0 else f"{what}: max |diff| {maxdiff(a, b):.3g} beyond rtol {rtol:g}"


def _buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n.replace("_fsdp_wrapped_module.", ""), b.detach().clone()) for n, b in model.named_buffers()]


def _full_sd(model: nn.Module, impl: str) -> dict[str, torch.Tensor]:
    api = fsdp_api(impl)
    with api.FullyShardedDataParallel.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        return model.state_dict()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, col: list[Any],
          impl: str, uop: bool, keep_low: bool) -> tuple[Any, ...]:
    """One training step; returns (loss, grads, params) as the optimizer saw them.

    With ``use_orig_params=True`` they are read in full through
    ``summon_full_params`` (``with_grads``), so the numerics are compared even
    where the two implementations lay out the shards differently (that is
    checked on its own, see ``layout``).
    """
    with _record_collectives(col):
        loss = loss_of(model(x))
        loss.backward()
    cls = fsdp_api(impl).FullyShardedDataParallel
    if uop and keep_low:
        # torch's summon_full_params(with_grads=True) cannot hold low-precision
        # grads; compare their dtypes (the values show in the next params).
        grads = [None if p.grad is None else torch.zeros(0, dtype=p.grad.dtype) for p in model.parameters()]
    else:
        ctx: Any = cls.summon_full_params(model, writeback=False, with_grads=True) if uop else contextlib.nullcontext()
        with ctx:
            grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    ctx = cls.summon_full_params(model, writeback=False) if uop else contextlib.nullcontext()
    with ctx:
        params = [p.detach().clone() for p in model.parameters()]
    return loss.detach(), grads, params


def _run_config(cfg: dict[str, Any]) -> list[str]:
    rank = dist.get_rank()
    tag = f"{rank_tag()} {_describe(cfg)}"
    group = cfg["group"]
    torch.manual_seed(cfg["idx"])
    name = cfg["model"]
    base = _new(name)
    models = []
    for impl in ("torch", "ours"):
        mp = fsdp_api(impl).MixedPrecision(**cfg["mp"])
        dev = {"device_id": torch.device(cfg["device"])} if cfg.get("device") else {}
        models.append(_build(name, impl, base, sharding_strategy=cfg["strategy"],
                             use_orig_params=cfg["uop"], mixed_precision=mp, **dev))
    ref, ours = models
    fails: list[str] = []
    names = [n for n, _ in ref.named_parameters()]
    if names != [n for n, _ in ours.named_parameters()]:
        # the same on every rank (construction is deterministic): no collective skipped unevenly
        return [f"{group}|{tag}: parameter names differ: {names} vs {[n for n, _ in ours.named_parameters()]}"]

    # Structure: which modules are units, and with which mixed-precision config.
    def units(m: nn.Module) -> list[tuple[str, Any]]:
        return [(n, str(u.mixed_precision.param_dtype)) for n, u in m.named_modules()
                if type(u).__name__ == "FullyShardedDataParallel"]
    if units(ref) != units(ours):
        fails.append(f"{group}|{tag}: units differ: torch {units(ref)} vs ours {units(ours)}")

    shapes = ([tuple(p.shape) for p in ref.parameters()], [tuple(p.shape) for p in ours.parameters()])
    if shapes[0] != shapes[1]:
        fails.append(f"layout|{tag}: optimizer-visible shapes: torch {shapes[0]} vs ours {shapes[1]}")

    inputs: tuple[list[str], list[str]] = ([], [])
    if name in LOCAL_MODELS:
        for m, log in zip((ref, ours), inputs):
            _record_inputs(m, LOCAL_MODELS[name][1], log)
    dt = cfg["mp"].get("param_dtype") or cfg["mp"].get("reduce_dtype") or FP32
    rtol = max(RTOL[dt], RTOL[cfg["mp"].get("reduce_dtype") or dt])
    # foreach=False: with keep_low_precision_grads the grads are bf16/fp16 next to
    # fp32 params, which the foreach kernels (CUDA's default) refuse, torch's FSDP too.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(1000 + 7919 * rank + cfg["idx"])
    for step in range(3):
        x = _input(name, gen)
        cols: tuple[list[Any], list[Any]] = ([], [])
        (l1, g1, p1), (l2, g2, p2) = (
            _step(m, o, x, c, impl, cfg["uop"], bool(cfg["mp"].get("keep_low_precision_grads"))) for m, o, c, impl in zip((ref, ours), opts, cols, ("torch", "ours"))
        )
        where = f"{group}|{tag} step {step}"
        errs = [_close("loss", l1, l2, rtol)]
        errs += [_close(f"grad of {names[i]}", a, b, rtol) for i, (a, b) in enumerate(zip(g1, g2))]
        errs += [_close(f"param {names[i]}", a, b, rtol) for i, (a, b) in enumerate(zip(p1, p2))]
        b1, b2 = _buffers(ref), _buffers(ours)
        if [n for n, _ in b1] != [n for n, _ in b2]:
            errs.append(f"buffer names: torch {[n for n, _ in b1]} vs ours {[n for n, _ in b2]}")
        errs += [_close(f"buffer {n}", a, b, rtol) for (n, a), (_, b) in zip(b1, b2)]
        # The same dtypes per kind of collective; ours may be fewer (gradient
        # buckets reduce several units in one), never more.
        # (Not counted: the first forward's replica check, fsdp_wrap/runtime/
        # guards.py check_replicas, gathers one int64 fingerprint per NO_SHARD
        # flat parameter; torch's FSDP1 has no such check and gathers no int64.)
        theirs = Counter(cols[0])
        mine = Counter(c for c in cols[1] if c[1] != str(torch.int64))
        if set(theirs) != set(mine) or any(mine[k] > theirs[k] for k in mine):
            errs.append(f"collective dtypes: torch {sorted(cols[0])} vs ours {sorted(cols[1])}")
        bad_master = [n for n, p in ours.named_parameters() if p.dtype != FP32]
        if bad_master:
            errs.append(f"optimizer-visible params not float32: {bad_master}")
        want = FP32
        if cfg["mp"].get("keep_low_precision_grads"):
            want = cfg["mp"]["param_dtype"]  # torch: the compute dtype, not reduce_dtype
        errs += [f"grad of {n} is {g.dtype}, want {want}" for n, g in zip(names, g2)
                 if g is not None and g.dtype != want]
        errs = [e for e in errs if e]
        if errs:
            fails.append(f"{where}: " + "; ".join(errs[:5]) + (f" (+{len(errs) - 5} more)" if len(errs) > 5 else ""))
        # agreed: a rank stopping alone would leave the others in the next step's collectives
        if any_rank(bool(errs)):
            break
    if inputs[0] != inputs[1]:
        fails.append(f"{group}|{tag}: unit input dtypes: torch {inputs[0]} vs ours {inputs[1]}")
    if group == "cast_inputs" and not inputs[1]:
        fails.append(f"{group}|{tag}: no inputs were recorded (the check is vacuous)")
    # FULL state dict: same keys/values as torch's, buffers in their original dtype.
    sd1, sd2 = _full_sd(ref, "torch"), _full_sd(ours, "ours")
    plain = {k: v.dtype for k, v in base.state_dict().items()}
    sd_errs: list[str] = []
    if list(sd1) != list(sd2):
        sd_errs.append(f"keys: torch {list(sd1)} vs ours {list(sd2)}")
    else:
        sd_errs += [e for e in (_close(f"[{k}]", sd1[k], sd2[k], rtol) for k in sd1) if e]
    wrong = {k: str(v.dtype) for k, v in sd2.items() if k in plain and v.dtype != plain[k]}
    if wrong:
        sd_errs.append(f"not in the original dtype: {wrong}")
    if sd_errs:
        fails.append(f"state_dict|{tag}: FULL_STATE_DICT: " + "; ".join(sd_errs[:5]))
    return fails


def _sweep(configs: list[dict[str, Any]],
           inject: Injection | None = None) -> tuple[list[str], dict[str, int]]:
    """The failures, and how many configurations ran."""
    warnings.simplefilter("ignore")
    ran = {"configs": 0}

    def one(cfg: dict[str, Any]) -> list[str]:
        fails = _run_config(cfg)
        ran["configs"] += 1
        return fails

    fails = run_configs(configs, one, lambda c: f"{c['group']}|{rank_tag()} {_describe(c)}", inject)
    return fails, ran


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------

_RESULTS: list[Any] = []
GROUPS = ["param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads", "cast_inputs",
          "module_classes_to_ignore"]

EXTRA_GROUPS = ["state_dict", "layout", "cast_root_false_forward_true", "keep_low_precision_grads_fp32_reduce"]



def _results(pool2: Any) -> list[Any]:
    if not _RESULTS:
        _RESULTS.extend(pool2.run(_sweep, _configs()))
    return _RESULTS


def _failures(pool2: Any, group: str) -> list[str]:
    return [f for fails, _ in _results(pool2) for f in fails if f.split("|", 1)[0] == group]


@pytest.mark.parametrize("group", GROUPS)
def test_mixed_precision_matches_torch(pool2: Any, group: str) -> None:
    fails = _failures(pool2, group)
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_full_state_dict_buffers_in_original_dtype(pool2: Any) -> None:
    """FULL state dicts hold buffers in their original dtype, as torch's do."""
    fails = _failures(pool2, "state_dict")
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_root_casts_inputs_when_only_cast_forward_inputs_is_set(pool2: Any) -> None:
    """torch's root casts when either flag is set (its pre-forward applies cast_forward_inputs too)."""
    fails = _failures(pool2, "cast_root_false_forward_true")
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_keep_low_precision_grads_with_fp32_reduce(pool2: Any) -> None:
    """torch leaves the grads in param_dtype even when the reduction ran in float32."""
    fails = _failures(pool2, "keep_low_precision_grads_fp32_reduce")
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_use_orig_params_shard_shapes_match_torch(pool2: Any) -> None:
    fails = _failures(pool2, "layout")
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def test_every_config_ran(pool2: Any) -> None:
    for fails, stats in _results(pool2):
        assert stats["configs"] == len(_configs())
        assert not [f for f in fails if f.split("|", 1)[0] not in GROUPS + EXTRA_GROUPS], fails


def test_configs_cover_every_field() -> None:
    configs = _configs()
    fields = {k for c in configs for k in c["mp"]}
    assert fields == {"param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads",
                      "cast_forward_inputs", "cast_root_forward_inputs", "_module_classes_to_ignore"}
    assert {c["mp"].get("param_dtype") for c in configs} >= {BF16, FP16, None}
    assert {(c["strategy"], c["uop"]) for c in configs if c["group"] == "param_dtype"} == {
        (s, u) for s in STRATEGIES for u in (False, True)
    }
