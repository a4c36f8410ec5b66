"""FSDP2's explicit controls on fsdp_wrap units (fsdp_wrap/runtime/explicit/).

Three references, on two gloo ranks:

* **FSDP2 itself** (``torch.distributed.fsdp.fully_shard``) on the same model,
  one unit per ``Linear``, where FSDP2 has the behaviour: every all-gather and
  reduce-scatter is recorded (torch's ``dist.all_gather_single`` /
  ``reduce_scatter_single`` for FSDP2, ``fsdp_wrap.comm.collectives`` for
  fsdp_wrap, with batching and buckets off so each unit has its own), and
  so is each layer's forward computation, and both must issue the same
  collectives, of the same sizes, in the same order among the computations
  (a prefetch shows as a gather before the computation it runs ahead of),
  and reach the same losses and parameters, bit for bit.  The layers
  have distinct even widths, so a gather's size names its unit in both.
* **fsdp_wrap's own defaults**: an explicit schedule equal to the default one
  (``[next unit]`` for ``forward_prefetch=True``, ``[previous unit]`` for
  ``BACKWARD_PRE``, ``reshard_after_forward`` as the strategy says, the divide
  factor equal to the world size) changes no collective and no bit.
* **Misuse** gets ``ValueError``/``TypeError``/``RuntimeError`` with torch's
  sentence where FSDP2 has one, before any collective, on every rank.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap as fw
import fsdp_wrap.comm.collectives as C
from fsdp_wrap._compat import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._sweep import Injection, injected, run_sweep

WIDTHS = [6, 8, 10, 12, 14]  # even: FSDP2's padding (dim 0) and fsdp_wrap's (flat) agree


_LOG: list[list[tuple[str, int]]] = []  # the log being recorded (see _recording)


class Lin(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _LOG:  # (when a unit computes, among the collectives)
            _LOG[0].append(("compute", self.weight.numel() + self.bias.numel()))
        return super().forward(x)

    def scaled(self, x: torch.Tensor, s: float) -> torch.Tensor:
        """A method outside ``forward`` that reads the parameters."""
        return self.forward(x) * s


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Lin(WIDTHS[i], WIDTHS[i + 1]) for i in range(4))
        self.head = Lin(WIDTHS[-1], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _units(model: nn.Module) -> list[nn.Module]:
    return [*model.layers, model.head]  # type: ignore[attr-defined]


@contextmanager
def _recording() -> Iterator[list[tuple[str, int]]]:
    """Every all-gather (output size) and reduce-scatter (input size), FSDP2's and fsdp_wrap's."""
    log: list[tuple[str, int]] = []
    real = {"ag": getattr(dist, ALL_GATHER_SINGLE), "rs": getattr(dist, REDUCE_SCATTER_SINGLE),
            "cag": C.all_gather_into, "crs": C.reduce_scatter_sum}

    def ag(*a: Any, **k: Any) -> Any:
        log.append(("gather", (k.get("output_tensor") if "output_tensor" in k else a[0]).numel()))
        return real["ag"](*a, **k)

    def rs(*a: Any, **k: Any) -> Any:
        log.append(("reduce", (k["input"] if "input" in k else a[1]).numel()))
        return real["rs"](*a, **k)

    def cag(output: torch.Tensor, *a: Any, **k: Any) -> Any:
        log.append(("gather", output.numel()))
        return real["cag"](output, *a, **k)

    def crs(output: torch.Tensor, padded: torch.Tensor, *a: Any, **k: Any) -> Any:
        log.append(("reduce", padded.numel()))
        return real["crs"](output, padded, *a, **k)

    _LOG.append(log)
    setattr(dist, ALL_GATHER_SINGLE, ag)
    setattr(dist, REDUCE_SCATTER_SINGLE, rs)
    C.all_gather_into, C.reduce_scatter_sum = cag, crs  # type: ignore[assignment]
    try:
        yield log
    finally:
        _LOG.clear()
        setattr(dist, ALL_GATHER_SINGLE, real["ag"])
        setattr(dist, REDUCE_SCATTER_SINGLE, real["rs"])
        C.all_gather_into, C.reduce_scatter_sum = real["cag"], real["crs"]  # type: ignore[assignment]


# ------------------------------------------------------------ against FSDP2

def _set(mode: str, model: nn.Module) -> None:
    """The same explicit calls on FSDP2's model and on fsdp_wrap's."""
    u = _units(model)
    if mode == "forward_two_ahead":
        for i in range(4):
            u[i].set_modules_to_forward_prefetch(u[i + 1 : i + 3])
    elif mode == "backward_two_ahead":
        for i in range(1, 5):
            u[i].set_modules_to_backward_prefetch(list(reversed(u[max(0, i - 2) : i])))
    elif mode == "root_lists":  # (a root without parameters of its own)
        model.set_modules_to_forward_prefetch(u[:2])
        model.set_modules_to_backward_prefetch([u[4], u[3]])
    elif mode == "keep_one_after_forward":
        u[1].set_reshard_after_forward(False)
    elif mode == "keep_all_after_forward":
        model.set_reshard_after_forward(False)  # (recurse=True: every unit)
    elif mode == "no_unshard_in_backward":
        u[0].set_unshard_in_backward(False)  # (its input needs no grad: its weight is not read)
    elif mode == "divide_factor_fp16":
        for unit in u:
            unit.set_gradient_divide_factor(3.0)


FSDP2_MODES = ["default", "forward_two_ahead", "backward_two_ahead", "root_lists",
               "keep_one_after_forward",
               "keep_all_after_forward", "no_unshard_in_backward", "divide_factor_fp16",
               "unshard_then_forward", "forward_method"]


def _step(mode: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          first: bool) -> Any:
    u = _units(model)
    if mode == "forward_method" and not first:
        # (only the method: FSDP1 and FSDP2 both count a forward without grad
        # in the next backward's prefetch order, each its own way)
        with torch.no_grad():
            return u[3].scaled(torch.tanh(x[:, :1].repeat(1, 12)), 2.0).sum().item()
    if mode == "unshard_then_forward":
        handle = u[2].unshard(async_op=True)  # (before the forward: its gather comes first)
        if handle is None:
            raise AssertionError("unshard(async_op=True) returned no handle")
        u[3].unshard()
        u[3].reshard()
    loss = model(x).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if mode == "forward_method":  # (after the first step: the root is the model's)
        with torch.no_grad():
            return loss.item(), u[3].scaled(torch.tanh(x[:, :1].repeat(1, 12)), 2.0).sum().item()
    return loss.item()


def _full_params(model: nn.Module, fsdp2: bool) -> list[torch.Tensor]:
    if fsdp2:
        return [p.full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    with fw.FullyShardedDataParallel.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _against_fsdp2(mode: str) -> list[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    fp16 = mode == "divide_factor_fp16"
    torch.manual_seed(0)
    base = Net()
    theirs = copy.deepcopy(base)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float16 if fp16 else None)
    for unit in _units(theirs):
        fully_shard(unit, mp_policy=policy)
    fully_shard(theirs, mp_policy=policy)
    ours = fw.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Lin}), all_gather_batch_mb=0,
        bucket_cap_mb=0, mixed_precision=fw.MixedPrecision(reduce_dtype=torch.float16)
        if fp16 else None)
    x = torch.randn(3, WIDTHS[0], generator=torch.Generator().manual_seed(dist.get_rank()))
    fails: list[str] = []
    runs = []
    for model, fsdp2 in ((theirs, True), (ours, False)):
        _set(mode, model)
        if mode == "forward_method":
            (torch_register if fsdp2 else fw.register_fsdp_forward_method)(
                _units(model)[3], "scaled")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        results, logs = [], []
        for i in range(3):
            with _recording() as log:
                results.append(_step(mode, model, opt, x, first=i == 0))
            logs.append(list(log))
        runs.append((results, logs, _full_params(model, fsdp2)))
    (r2, l2, p2), (r1, l1, p1) = runs
    where = f"against FSDP2, {mode}"
    bad = injected(where)
    if bad:
        fails.append(bad)
    for step, (a, b) in enumerate(zip(l2, l1)):
        if a != b:
            fails.append(f"{where} step {step}: collectives differ\n FSDP2:     {a}\n fsdp_wrap: {b}")
    if r2 != r1:
        fails.append(f"{where}: results differ: FSDP2 {r2}, fsdp_wrap {r1}")
    if not all(torch.equal(a, b) for a, b in zip(p2, p1)):
        fails.append(f"{where}: parameters differ after 3 steps")
    if mode == "forward_method" and l1[1] != [("gather", 182), ("compute", 182)]:
        fails.append(f"{where}: the registered method gathered {l1[1]}, not layers.3 alone")
    return fails


def _sweep_fsdp2(modes: list[str], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_sweep(modes, _against_fsdp2, inject=inject)


def test_same_collectives_and_results_as_fsdp2(pool2: Any) -> None:
    assert pool2.run(_sweep_fsdp2, FSDP2_MODES) == [[], []]


# ------------------------------------------------- against fsdp_wrap's defaults

class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d + 2), nn.Linear(d + 2, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _LOG:
            _LOG[0].append(("compute", id(type(self))))
        return x + self.fc2(torch.relu(self.fc1(x)))


def _block_net() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), *[Block(8) for _ in range(4)], nn.Linear(8, 3))


DEFAULT_CONFIGS = [
    dict(strategy="FULL_SHARD"),  # (batched gathers and buckets on: fsdp_wrap's defaults)
    dict(strategy="FULL_SHARD", limit_all_gathers=False, all_gather_batch_mb=0),
    dict(strategy="SHARD_GRAD_OP", use_orig_params=True),
]


def _default_equivalents(cfg: dict[str, Any]) -> list[str]:
    """Defaults vs explicit calls that spell the same schedule out."""
    cfg = dict(cfg)
    strategy = fw.ShardingStrategy[cfg.pop("strategy")]
    torch.manual_seed(0)
    base = _block_net()

    def build(**kw: Any) -> fw.FullyShardedDataParallel:
        return fw.FullyShardedDataParallel(copy.deepcopy(base),
                                           auto_wrap_policy=ModuleWrapPolicy({Block}),
                                           sharding_strategy=strategy, **cfg, **kw)

    default = build(forward_prefetch=True)
    explicit = build(forward_prefetch=False)
    # The default order: the root, then the blocks; backward the reverse.
    units = fw.FullyShardedDataParallel.fsdp_modules(explicit)
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 1:
            unit.set_modules_to_backward_prefetch([units[i - 1]])
        if i > 0:  # (the root's default is to keep its parameters after forward)
            unit.set_reshard_after_forward(strategy is fw.ShardingStrategy.FULL_SHARD,
                                           recurse=False)
        unit.set_unshard_in_backward(True)
        unit.set_gradient_divide_factor(dist.get_world_size())
    units[0].set_modules_to_backward_prefetch([units[-1]])
    gen = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(4, 5, generator=gen) for _ in range(3)]
    runs = []
    for model in (default, explicit):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        logs = []
        for x in xs:
            with _recording() as log:
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            logs.append(list(log))
        # (from the second step: forward_prefetch follows the first step's
        # order, so it prefetches nothing in the first; a list does at once)
        runs.append((logs[1:], _full_params(model, False)))
    where = f"defaults vs explicit, {strategy.name} {cfg}"
    fails = [f"{where}: collectives (among the blocks' computations) differ\n"
             f" {runs[0][0]}\n {runs[1][0]}"] if runs[0][0] != runs[1][0] else []
    if not all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])):
        fails.append(f"{where}: parameters differ")
    bad = injected(where)
    return fails + ([bad] if bad else [])


def _sweep_defaults(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_sweep(configs, _default_equivalents, inject=inject)


def test_explicit_default_schedule_changes_nothing(pool2: Any) -> None:
    assert pool2.run(_sweep_defaults, DEFAULT_CONFIGS) == [[], []]


# ------------------------------------------------------------------ misuse

def _raises(fn: Any, exc: type[BaseException], *parts: str) -> str:
    """"" if ``fn()`` raises ``exc`` whose message holds every part, else what happened."""
    try:
        fn()
    except exc as e:
        missing = [p for p in parts if p not in str(e)]
        return f"message lacks {missing}: {e}" if missing else ""
    except BaseException as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {e}"
    return "did not raise"


def _misuse() -> dict[str, str]:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = fw.FullyShardedDataParallel(Net(), auto_wrap_policy=ModuleWrapPolicy({Lin}))
    other = fw.FullyShardedDataParallel(Net(), auto_wrap_policy=ModuleWrapPolicy({Lin}))
    u = _units(model)
    rank = f"[rank {dist.get_rank()}]"
    out = {
        "not a unit": _raises(lambda: u[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
                              ValueError, "Expects FSDPModule but got", rank),
        "not a list": _raises(lambda: u[0].set_modules_to_forward_prefetch(u[1]), ValueError,
                              "expects a list of FSDP units"),
        "itself": _raises(lambda: u[1].set_modules_to_backward_prefetch([u[1]]), ValueError,
                          "cycle", "'layers.1' -> 'layers.1'"),
        "raf not bool": _raises(lambda: u[0].set_reshard_after_forward(1), ValueError,
                                "reshard_after_forward should be a bool, got <class 'int'>"),
        "factor": _raises(lambda: u[0].set_gradient_divide_factor(0.0), ValueError,
                          "positive finite number"),
        "event": _raises(lambda: model.set_post_optim_event(object()), TypeError, "torch.Event"),
        "no method": _raises(lambda: fw.register_fsdp_forward_method(u[0], "nope"), ValueError,
                             "does not have a method nope"),
    }
    u[0].set_modules_to_forward_prefetch([u[1]])
    out["cycle"] = _raises(lambda: u[1].set_modules_to_forward_prefetch([u[0]]), ValueError,
                           "cycle", "'layers.1' -> 'layers.0' -> 'layers.1'")
    kept = u[1]._fsdp_state._explicit.forward_prefetch
    out["cycle left unset"] = "the cycle was kept" if kept else ""
    fw.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not a unit: nothing (FSDP2's)
    # Phases: a setting changed, or reshard(), while a unit runs forward/backward.
    seen: dict[str, str] = {}

    def in_forward(module: nn.Module, args: Any) -> None:
        seen["set in forward"] = _raises(lambda: u[3].set_modules_to_backward_prefetch([u[2]]),
                                         ValueError, "during forward/backward")
        seen["reshard in forward"] = _raises(lambda: u[1].reshard(), ValueError,
                                             "reshard() expects IDLE", "'layers.1'")

    hook = u[1].module.register_forward_pre_hook(in_forward)
    model(torch.randn(2, WIDTHS[0])).sum().backward()
    hook.remove()
    out.update(seen)
    out["another model"] = _raises(lambda: u[0].set_modules_to_forward_prefetch(
        [_units(other)[1]]), ValueError, "of another model")
    # A CPU event is taken and dropped by the next forward, which runs as before.
    model.set_post_optim_event(torch.Event(device="cpu"))
    model(torch.randn(2, WIDTHS[0])).sum().backward()
    out["event dropped"] = "" if model._fsdp_state._explicit.post_optim_event is None else "event kept"
    bad = injected("misuse")
    if bad:
        out["injected"] = bad
    return {k: v for k, v in out.items() if v}


def _ranks_disagree() -> str:
    """Rank 0 sets a forward prefetch list, rank 1 none: both raise at the first
    forward (lazy init), none hangs."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = fw.FullyShardedDataParallel(Net(), auto_wrap_policy=ModuleWrapPolicy({Lin}))
    if dist.get_rank() == 0:
        _units(model)[0].set_modules_to_forward_prefetch([_units(model)[2]])
    return _raises(lambda: model(torch.randn(2, WIDTHS[0])), RuntimeError,
                   "explicit controls differ between rank", "'layers.0'", "layers.2")


def test_misuse_is_refused_with_a_clear_error(pool2: Any) -> None:
    assert pool2.run(_misuse) == [{}, {}]
    assert pool2.run(_ranks_disagree) == ["", ""]


@pytest.mark.parametrize("name", ["UnshardHandle", "register_fsdp_forward_method"])
def test_exported(name: str) -> None:
    assert name in fw.__all__ and hasattr(fw, name)
