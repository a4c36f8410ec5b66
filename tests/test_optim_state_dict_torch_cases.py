"""Optimizer state dicts in the cases torch's own FSDP1 tests look at: one "state"
order on every rank, ``None`` states, dicts without ``param_groups``, parameters
outside FSDP, ranks missing rank 0's states, ``_NamedOptimizer``, and torch's
error phrases.  torch's FSDP1 is the oracle."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests import _ckpt_common as C
from tests._sweep import Injection, run_sweep

FSDP = fsdp_wrap.FullyShardedDataParallel


def _tmod() -> Any:
    import torch.distributed.fsdp as tfsdp

    return tfsdp


def _mod(model: nn.Module) -> Any:
    return fsdp_wrap if isinstance(model, FSDP) else _tmod()


def _osd(model: nn.Module, opt: Any, sd_type: str, osd: Any = None) -> dict[str, Any]:
    mod = _mod(model)
    # torch aliases exp_avg/exp_avg_sq when it offloads on CPU: compare without
    cfg = mod.FullOptimStateDictConfig(offload_to_cpu=False) if sd_type == "FULL_STATE_DICT" else None
    with mod.FullyShardedDataParallel.state_dict_type(
        model, getattr(mod.StateDictType, sd_type), None, cfg
    ):
        return mod.FullyShardedDataParallel.optim_state_dict(model, opt, optim_state_dict=osd)


def _to_load(model: nn.Module, opt: Any, sd_type: str, osd: dict[str, Any]) -> Any:
    mod = _mod(model)
    with mod.FullyShardedDataParallel.state_dict_type(model, getattr(mod.StateDictType, sd_type)):
        return mod.FullyShardedDataParallel.optim_state_dict_to_load(model, opt, osd)


def _desc(state: dict[Any, Any]) -> Any:
    return {k: C.describe_sd(v) if isinstance(v, dict) else v for k, v in state.items()}


def _diff(a: Any, b: Any) -> str:
    """Where two ``describe_osd`` results first differ, briefly."""
    if not (isinstance(a, tuple) and isinstance(b, tuple)):
        return f"{str(a)[:300]} vs torch {str(b)[:300]}"
    ka, kb = [k for k, _ in a[0]], [k for k, _ in b[0]]
    if ka != kb:
        return f"state keys {ka} vs torch {kb}"
    for (k, va), (_, vb) in zip(a[0], b[0]):
        if [n for n, _ in va] != [n for n, _ in vb]:
            return f"{k}: entries {[n for n, _ in va]} vs torch {[n for n, _ in vb]}"
        for (n, x), (_, y) in zip(va, vb):
            if x != y:
                return f"{k}.{n}: {str(x)[:200]} vs torch {str(y)[:200]}"
    if a[1] != b[1]:
        return f"param_groups {a[1]} vs torch {b[1]}"
    return "equal"


# ------------------------------------------------------------------ order


def _order_configs() -> list[dict[str, Any]]:
    return [dict(uop=uop, kind=kind) for uop, kind in itertools.product((False, True), ("seq", "extra"))]


def _sharded_state_order(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """Rank 1's optimizer lists the parameters in reverse: "state" still comes out
    in one order on every rank, torch's (rank 0's optimizer order for flat
    parameters, sorted by FQN with use_orig_params)."""
    return run_sweep(configs, _order_one, inject=inject)


def _order_one(cfg: dict[str, Any]) -> list[str]:
    uop, kind = cfg["uop"], cfg["kind"]
    problems = []
    keys = {}
    for ours in (True, False):
        if kind == "seq":
            model = (C.wrap_ours if ours else C.wrap_torch)("seq", uop)
        else:  # with parameters outside FSDP
            model = _wrap_extra(ours, ["extra"], uop)
        params = list(model.parameters())
        opt = torch.optim.Adam(params[::-1] if dist.get_rank() == 1 else params, lr=0.01)
        for step in range(2):
            model(C.batch("seq", step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        for how in ("optim_state_dict", "sharded_optim_state_dict"):
            if how == "optim_state_dict":
                got = _osd(model, opt, "SHARDED_STATE_DICT")
            else:
                got = _mod(model).FullyShardedDataParallel.sharded_optim_state_dict(model, opt)
            keys[(ours, how)] = list(got["state"])
    for how in ("optim_state_dict", "sharded_optim_state_dict"):
        everyone: list[Any] = [None, None]
        dist.all_gather_object(everyone, keys[(True, how)])
        problems += C.problem(f"{kind} uop={uop} {how}: ranks differ: {everyone}",
                              everyone[0] != everyone[1])
        problems += C.problem(f"{kind} uop={uop} {how}: {keys[(True, how)]} vs torch {keys[(False, how)]}",
                              keys[(True, how)] != keys[(False, how)])
    return problems


def test_sharded_state_comes_out_in_one_order(pool2: Any) -> None:
    assert pool2.run(_sharded_state_order, _order_configs()) == [[], []]


# ------------------------------------------------------------- None state


def _none_state_loads() -> list[str]:
    """``momentum_buffer: None`` for every original of a flat parameter loads as torch."""
    problems = []
    got = {}
    for ours in (True, False):
        model = (C.wrap_ours if ours else C.wrap_torch)("seq", False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for sd_type in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            osd = _osd(model, opt, sd_type)  # never stepped: no state, named groups
            names = [n for g in osd["param_groups"] for n in g["params"]]
            osd["state"] = {n: {"momentum_buffer": None} for n in names}
            # No try/except around the collectives: an error (a failure either
            # way) raised on one rank only would leave the other waiting; the
            # pool reports it with its traceback instead.
            flat = _to_load(model, opt, sd_type, osd)
            opt.load_state_dict(flat)
            got[(ours, sd_type)] = _desc(flat["state"])
    for sd_type in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        if got.get((True, sd_type)) != got.get((False, sd_type)):
            problems.append(f"{sd_type}: {got.get((True, sd_type))} vs torch {got.get((False, sd_type))}")
    return problems


def test_none_state_values_load_as_torch(pool2: Any) -> None:
    assert pool2.run(_none_state_loads) == [[], []]


# ------------------------------------------------------ no param_groups


def _no_groups_configs() -> list[dict[str, Any]]:
    return [dict(uop=uop, sd_type=t) for uop in (False, True)
            for t in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")]


def _without_param_groups(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _no_groups_one, inject=inject)


def _no_groups_one(cfg: dict[str, Any]) -> list[str]:
    uop, sd_type = cfg["uop"], cfg["sd_type"]
    got = []
    for ours in (True, False):
        model = (C.wrap_ours if ours else C.wrap_torch)("seq", uop)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        C.train(model, opt, "seq", range(2))
        # (no try/except around the collectives: see _none_state_loads)
        out = _osd(model, opt, sd_type, {"state": opt.state_dict()["state"]})
        got.append((sorted(out), C.describe_osd({"param_groups": [], **out})))
        if "param_groups" in out:
            got[-1] = (sorted(out), C.describe_osd(out))
    return C.problem(f"uop={uop} {sd_type}: {got[0][0]} vs torch {got[1][0]}: "
                     f"{_diff(got[0][1], got[1][1])}", got[0] != got[1])


def test_optim_state_dict_given_no_param_groups(pool2: Any) -> None:
    assert pool2.run(_without_param_groups, _no_groups_configs()) == [[], []]


# ------------------------------------------------------ outside FSDP


class _WithExtra(nn.Module):
    """``body`` trained under FSDP; ``extra`` kept outside it (another parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        self.extra = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.body(x))


def _wrap_extra(ours: bool, ignore: list[str], uop: bool = False) -> nn.Module:
    m = _WithExtra()
    ignored = [m.get_submodule(n) for n in ignore]
    if ours:
        return FSDP(m, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=C.CPU,
                    ignored_modules=ignored, use_orig_params=uop)
    tm = _tmod()
    return tm.FullyShardedDataParallel(
        m, auto_wrap_policy=tm.wrap.ModuleWrapPolicy({nn.Linear}), device_id=C.CPU,
        ignored_modules=ignored, use_orig_params=uop,
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


_LOADERS = ("shard_full", "scatter_full", "flatten_sharded", "to_load")


def _load_with(name: str, F: Any, full: Any, sharded: Any, dst: nn.Module, dopt: Any) -> Any:
    if name == "shard_full":
        return F.shard_full_optim_state_dict(full, dst, optim=dopt)
    if name == "scatter_full":
        return F.scatter_full_optim_state_dict(full if dist.get_rank() == 0 else None, dst, optim=dopt)
    if name == "flatten_sharded":
        return F.flatten_sharded_optim_state_dict(sharded, dst, dopt)
    return _to_load(dst, dopt, "FULL_STATE_DICT", full)


def _loads_beside_params_outside_fsdp() -> list[str]:
    """Saved without ``extra``; loaded into a model whose optimizer also steps
    ``extra`` outside FSDP: the four loading APIs leave it alone, as torch."""
    problems = []
    results: dict[tuple[bool, str], Any] = {}
    for ours in (True, False):
        src = _wrap_extra(ours, ["extra"])
        sopt = torch.optim.Adam([p for n, p in src.named_parameters() if "extra" not in n], lr=0.01)
        _step(src, sopt)
        F = type(src)
        full = F.full_optim_state_dict(src, sopt, rank0_only=False)
        sharded = F.sharded_optim_state_dict(src, sopt)
        dst = _wrap_extra(ours, ["extra"])
        dopt = torch.optim.Adam(dst.parameters(), lr=0.01)
        for name in _LOADERS:
            # (no try/except around the collectives: see _none_state_loads)
            flat = _load_with(name, F, full, sharded, dst, dopt)
            # As torch: the groups list only what the checkpoint names ("extra" is
            # left for the caller to add, as torch's own test does)
            results[(ours, name)] = (_desc(flat["state"]), [g["params"] for g in flat["param_groups"]])
            if ours:
                n = sum(len(g["params"]) for g in dopt.param_groups)
                flat["param_groups"][0]["params"] = list(range(n))
                dopt.load_state_dict(flat)
    for name in _LOADERS:
        if results[(True, name)] != results[(False, name)]:
            problems.append(f"{name}: {results[(True, name)]} vs torch {results[(False, name)]}")
    return problems


def _saved_param_now_outside_fsdp() -> list[str]:
    """Saved while FSDP managed ``body.2``; loaded where it is outside FSDP: its
    chunked state arrives whole (torch would hand the optimizer the chunks)."""
    problems = []
    src = _wrap_extra(True, [])
    sopt = torch.optim.Adam(src.parameters(), lr=0.01)
    _step(src, sopt)
    full = FSDP.full_optim_state_dict(src, sopt, rank0_only=False)
    for how in ("flatten_sharded", "to_load_sharded", "shard_full"):
        dst = _wrap_extra(True, ["body.2"])
        dopt = torch.optim.Adam(dst.parameters(), lr=0.01)
        # No try/except (it went on to the next case's collectives after an
        # error on this rank alone): an error ends the task, reported by the pool.
        if how == "flatten_sharded":
            flat = FSDP.flatten_sharded_optim_state_dict(
                FSDP.sharded_optim_state_dict(src, sopt), dst, dopt)
        elif how == "to_load_sharded":
            flat = _to_load(dst, dopt, "SHARDED_STATE_DICT", _osd(src, sopt, "SHARDED_STATE_DICT"))
        else:
            flat = FSDP.shard_full_optim_state_dict(full, dst, optim=dopt)
        dopt.load_state_dict(flat)
        back = FSDP.full_optim_state_dict(dst, dopt, rank0_only=False)
        if C.describe_osd(back) != C.describe_osd(full):
            problems.append(f"{how}: reloaded state differs from the saved one")
    return problems


def test_parameters_outside_fsdp_when_loading(pool2: Any) -> None:
    assert pool2.run(_loads_beside_params_outside_fsdp) == [[], []]
    assert pool2.run(_saved_param_now_outside_fsdp) == [[], []]


# ------------------------------------------------ rank 0's states missing


def _missing_rank0_states() -> list[str]:
    """Rank 1's optimizer lacks a flat parameter rank 0's steps: both raise on every rank."""
    problems = []
    for ours in (True, False):
        model = (C.wrap_ours if ours else C.wrap_torch)("seq", False)
        params = list(model.parameters())
        opt = torch.optim.Adam(params[:-1] if dist.get_rank() == 1 else params, lr=0.01)
        C.train(model, opt, "seq", range(1))
        F = type(model)
        try:
            F.full_optim_state_dict(model, opt)
            problems.append(f"ours={ours}: no error")
        except RuntimeError as e:
            msg = str(e)
            want = ["optimizer states needed by rank 0's optimizer", "ank 1"]
            if ours:
                want += [f"rank {dist.get_rank()}", "2.weight", "use_orig_params=True"]
            problems += [f"ours={ours}: no {w!r} in: {msg}" for w in want if w not in msg]
            if ours and "_fsdp_wrapped" in msg:
                problems.append(f"unclean FQN in: {msg}")
    return problems


def test_full_optim_state_dict_refuses_ranks_missing_rank0_states(pool2: Any) -> None:
    assert pool2.run(_missing_rank0_states) == [[], []]


# ------------------------------------------------------- NamedOptimizer


def _named_configs() -> list[dict[str, Any]]:
    return [dict(uop=uop, sd_type=t) for uop in (False, True)
            for t in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")]


def _named_optimizer(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _named_one, inject=inject)


def _named_one(cfg: dict[str, Any]) -> list[str]:
    from torch.distributed.optim import _NamedOptimizer

    uop, sd_type = cfg["uop"], cfg["sd_type"]
    got = []
    for ours in (True, False):
        model = (C.wrap_ours if ours else C.wrap_torch)("seq", uop)
        opt = _NamedOptimizer(model.named_parameters(), torch.optim.Adam, module=model, lr=0.01)
        for step in range(2):
            model(C.batch("seq", step)).pow(2).mean().backward()
            opt.step()
            opt._optimizer.zero_grad()
        got.append(C.describe_osd(_osd(model, opt, sd_type)))
    problems = C.problem(f"uop={uop} {sd_type}: empty state", not got[0][0])
    problems += C.problem(f"uop={uop} {sd_type}: {_diff(got[0], got[1])}", got[0] != got[1])
    return problems


def test_named_optimizer_state(pool2: Any) -> None:
    assert pool2.run(_named_optimizer, _named_configs()) == [[], []]


# ------------------------------------------------------------- messages


def _scalar_state_mismatch() -> list[str]:
    """Originals of one flat parameter with different ``step``: torch's phrase,
    the clean FQNs and the fix, on every rank."""
    problems = []
    for ours in (True, False):
        model = (C.wrap_ours if ours else C.wrap_torch)("seq", False)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        C.train(model, opt, "seq", range(2))
        osd = _osd(model, opt, "FULL_STATE_DICT")
        osd["state"]["0.bias"]["step"] = torch.tensor(7.0)
        try:
            _to_load(model, opt, "FULL_STATE_DICT", osd)
            problems.append(f"ours={ours}: no error")
        except ValueError as e:
            msg = str(e)
            want = ["All unflattened parameters comprising a single flat parameter must have "
                    "scalar state with the same value and dtype", "step"]
            if ours:
                want += [f"rank {dist.get_rank()}", "0.bias", "0.weight", "use_orig_params=True"]
            problems += [f"ours={ours}: no {w!r} in: {msg}" for w in want if w not in msg]
    return problems


def test_scalar_state_mismatch_message(pool2: Any) -> None:
    assert pool2.run(_scalar_state_mismatch) == [[], []]


def _unmapped_state_copied() -> list[str]:
    """A state entry of no parameter is copied through with a warning, as torch."""
    problems = []
    for ours in (True, False):
        model = (C.wrap_ours if ours else C.wrap_torch)("seq", True)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        C.train(model, opt, "seq", range(1))
        local = opt.state_dict()
        local["state"]["my_counter"] = {"n": 3}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _osd(model, opt, "FULL_STATE_DICT", local)
        if out["state"].get("my_counter") != {"n": 3}:
            problems.append(f"ours={ours}: {list(out['state'])}")
        if not any("my_counter" in str(w.message) for w in caught):
            problems.append(f"ours={ours}: no warning")
    return problems


def test_unmapped_state_is_copied_with_a_warning(pool2: Any) -> None:
    assert pool2.run(_unmapped_state_copied) == [[], []]


def _torch_phrases() -> list[str]:
    """torch's phrases for a state dict without "state" and for mixed keys, with
    the rank and what to do in ours."""
    problems = []
    for ours in (True, False):
        model = (C.wrap_ours if ours else C.wrap_torch)("seq", False)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        C.train(model, opt, "seq", range(1))
        F, mod = type(model), _mod(model)
        cases = [
            ('`optim_state_dict` must have the keys "state"',
             lambda: _to_load(model, opt, "FULL_STATE_DICT", {"param_groups": []})),  # noqa: B023
            ("Invalid parameter keys",
             lambda: F.rekey_optim_state_dict(  # noqa: B023
                 {"state": {0: {}, "x": {}}, "param_groups": []},
                 mod.OptimStateKeyType.PARAM_NAME, model)),  # noqa: B023
        ]
        for phrase, call in cases:
            try:
                call()
                problems.append(f"ours={ours}: no error for {phrase!r}")
            except ValueError as e:
                want = [phrase] + ([f"rank {dist.get_rank()}", "; "] if ours else [])
                problems += [f"ours={ours}: no {w!r} in: {e}" for w in want if w not in str(e)]
    return problems


def test_errors_keep_torch_phrases(pool2: Any) -> None:
    assert pool2.run(_torch_phrases) == [[], []]
