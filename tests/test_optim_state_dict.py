"""Optimizer state dicts: formats equal torch's FSDP1, round trips that resume
training exactly, parameters without state, the legacy APIs, and errors."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from fsdp_wrap.fully_sharded_data_parallel import OptimStateKeyType
from tests import _ckpt_common as C
from tests._sweep import Injection, run_sweep

FSDP = fsdp_wrap.FullyShardedDataParallel
TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")


def _tmod() -> Any:
    import torch.distributed.fsdp as tfsdp

    return tfsdp


def _mod(model: nn.Module) -> Any:
    return fsdp_wrap if isinstance(model, FSDP) else _tmod()


def _osd(model: nn.Module, opt: Any, sd_type: str, **ocfg: Any) -> dict[str, Any]:
    mod = _mod(model)
    cfg = getattr(mod, sd_type.split("_")[0].title() + "OptimStateDictConfig")(**ocfg)
    with mod.FullyShardedDataParallel.state_dict_type(
        model, getattr(mod.StateDictType, sd_type), None, cfg
    ):
        return mod.FullyShardedDataParallel.optim_state_dict(model, opt)


def _to_load(model: nn.Module, opt: Any, sd_type: str, osd: dict[str, Any], **ocfg: Any) -> Any:
    mod = _mod(model)
    cfg = getattr(mod, sd_type.split("_")[0].title() + "OptimStateDictConfig")(**ocfg)
    with mod.FullyShardedDataParallel.state_dict_type(
        model, getattr(mod.StateDictType, sd_type), None, cfg
    ):
        return mod.FullyShardedDataParallel.optim_state_dict_to_load(model, opt, osd)


def _desc_osd(osd: dict[str, Any]) -> Any:
    return (
        {k: C.describe_sd(v) for k, v in osd["state"].items()},
        [g["params"] for g in osd["param_groups"]],
    )


def _trained(kind: str, uop: bool, ours: bool, steps: int = 2, **kw: Any) -> tuple[nn.Module, Any]:
    model = (C.wrap_ours if ours else C.wrap_torch)(kind, uop, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    C.train(model, opt, kind, range(steps))
    return model, opt


# ---------------------------------------------------------------- formats


def _formats_configs() -> list[dict[str, Any]]:
    # ("tiny": one unit whose shard is one element, as many as Adam's 0-dim "step")
    return [dict(kind=kind, uop=uop) for kind in ("seq", "tied") for uop in (False, True)] + [
        dict(kind="tiny", uop=False)]


def _formats_match_torch(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _formats_one, inject=inject)


def _formats_one(c: dict[str, Any]) -> list[str]:
    kind, uop = c["kind"], c["uop"]
    problems = []
    ours, oopt = _trained(kind, uop, True)
    ref, ropt = _trained(kind, uop, False)
    for sd_type in TYPES:
        # torch aliases exp_avg/exp_avg_sq with offload_to_cpu on CPU: compare without
        kw = {"offload_to_cpu": False} if sd_type == "FULL_STATE_DICT" else {}
        # order-sensitive: key and entry order decide DCP's file layout
        a = C.describe_osd(_osd(ours, oopt, sd_type, **kw))
        b = C.describe_osd(_osd(ref, ropt, sd_type, **kw))
        problems += C.problem(f"{kind} uop={uop} {sd_type}: {a} vs {b}", a != b)
    full = _osd(ours, oopt, "FULL_STATE_DICT")  # default offload_to_cpu=True
    live = {
        s.untyped_storage().data_ptr()
        for st in oopt.state.values() for s in st.values() if s.dim() > 0
    }
    for fqn, st in full["state"].items():
        ptrs = [v.untyped_storage().data_ptr() for v in st.values() if v.dim() > 0]
        problems += C.problem(f"{kind} uop={uop} FULL offload: {fqn} values alias",
                              len(set(ptrs)) != len(ptrs) or bool(set(ptrs) & live))
    r0 = _osd(ours, oopt, "FULL_STATE_DICT", rank0_only=True)
    problems += C.problem(f"rank0_only gave {list(r0)}", (r0 == {}) != (dist.get_rank() != 0))
    a, b = _listed_in_reverse(ours, oopt), _listed_in_reverse(ref, ropt)
    problems += C.problem(f"{kind} uop={uop} a group listed in reverse: {a} vs {b}", a != b)
    return problems


def _listed_in_reverse(model: nn.Module, opt: Any) -> list[list[str]]:
    """The FQNs of each group of ``optim_state_dict(model, opt, given)`` where
    ``given`` lists its groups' parameters in reverse: torch names them in the
    order the given state dict lists them, not the optimizer's."""
    given = opt.state_dict()
    given["param_groups"] = [dict(g, params=g["params"][::-1]) for g in given["param_groups"]]
    mod = _mod(model)
    with mod.FullyShardedDataParallel.state_dict_type(model, mod.StateDictType.FULL_STATE_DICT):
        osd = mod.FullyShardedDataParallel.optim_state_dict(model, opt, given)
    return [list(g["params"]) for g in osd["param_groups"]]


def test_formats_match_torch(pool2: Any) -> None:
    assert pool2.run(_formats_match_torch, _formats_configs()) == [[], []]


# ------------------------------------------------------------ round trips


def _round_trip_configs() -> list[dict[str, Any]]:
    return [dict(kind=kind, uop=uop, sd_type=sd_type, ocfg=ocfg)
            for kind in ("seq", "tied") for uop in (False, True)
            for sd_type, ocfg in [(t, {}) for t in TYPES] + [("FULL_STATE_DICT", {"rank0_only": True})]]


def _round_trips(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _round_trip, inject=inject)


def _round_trip(c: dict[str, Any]) -> list[str]:
    kind, uop, sd_type, ocfg = c["kind"], c["uop"], c["sd_type"], c["ocfg"]
    src, sopt = _trained(kind, uop, True)
    msd = C.full_params(src)
    osd = _osd(src, sopt, sd_type, **ocfg)
    dst = C.wrap_ours(kind, not uop if sd_type != "LOCAL_STATE_DICT" else uop, seed=3)
    with FSDP.state_dict_type(dst, fsdp_wrap.StateDictType.FULL_STATE_DICT):
        dst.load_state_dict({k: v for k, v in msd.items()}, strict=False)
    dopt = torch.optim.Adam(dst.parameters(), lr=0.5)
    flat = _to_load(dst, dopt, sd_type, osd if osd else None, **ocfg)
    dopt.load_state_dict(flat)
    tag = f"{kind} uop={uop} {sd_type} {ocfg}"
    problems = C.problem(f"{tag}: hyperparameters not loaded", dopt.param_groups[0]["lr"] != 0.01)
    a = C.train(src, sopt, kind, range(2, 5))
    b = C.train(dst, dopt, kind, range(2, 5))
    problems += C.problem(f"{tag}: losses {b} vs {a}", max(abs(x - y) for x, y in zip(a, b)) > 1e-6)
    return problems


def test_round_trips_resume_exactly(pool2: Any, pool3: Any) -> None:
    assert pool2.run(_round_trips, _round_trip_configs()) == [[], []]
    assert pool3.run(_round_trips, _round_trip_configs()) == [[], [], []]


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 4)
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _frozen_and_unstepped() -> list[str]:
    """Frozen parameters and an optimizer that never stepped give valid state dicts."""
    from fsdp_wrap.wrap import ModuleWrapPolicy

    problems = []
    for uop in (False, True):
        torch.manual_seed(0)
        m = _Frozen()
        if uop:  # frozen parameters inside trainable units
            m.a.bias.requires_grad_(False)
            m.b.weight.requires_grad_(False)
        model = FSDP(m, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=C.CPU,
                     use_orig_params=uop)
        # (use_orig_params=False: unit ``b`` stays out of the optimizer instead;
        # a wholly frozen unit cannot be built yet, see the report)
        trainable = [p for n, p in model.named_parameters() if p.requires_grad and (uop or ".b." not in n)]
        opt = torch.optim.Adam(trainable, lr=0.01)
        for sd_type in TYPES:
            empty = _osd(model, opt, sd_type)
            if empty["state"]:
                problems.append(f"uop={uop} {sd_type}: unstepped state {list(empty['state'])}")
            _to_load(model, opt, sd_type, empty)
        x = torch.randn(3, 4)
        model(x).sum().backward()
        opt.step()
        for sd_type in TYPES:
            osd = _osd(model, opt, sd_type)
            want = {"a.weight", "c.weight", "c.bias"} | ({"b.bias"} if uop else {"a.bias"})
            if set(osd["state"]) != want:
                problems.append(f"uop={uop} {sd_type}: state keys {sorted(osd['state'])}")
            flat = _to_load(model, opt, sd_type, osd)
            before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
            opt.load_state_dict(flat)
            after = opt.state_dict()["state"]
            if set(before) != set(after) or any(
                not torch.equal(before[k][n], after[k][n]) for k in before for n in before[k]
            ):
                problems.append(f"uop={uop} {sd_type}: reload changed the optimizer state")
    return problems


def test_frozen_and_never_stepped_params(pool2: Any) -> None:
    assert pool2.run(_frozen_and_unstepped) == [[], []]


# --------------------------------------------------------------- legacy


def _legacy_match_torch() -> list[str]:
    problems = []
    tm = _tmod()
    for uop in (False, True):
        ours, oopt = _trained("seq", uop, True)
        ref, ropt = _trained("seq", uop, False)
        local = oopt.state_dict()
        a = FSDP.full_optim_state_dict(ours, oopt)
        if uop:  # torch's legacy call offloads, which aliases exp_avg/exp_avg_sq on CPU
            b = _osd(ref, ropt, "FULL_STATE_DICT", offload_to_cpu=False, rank0_only=True)
        else:
            b = tm.FullyShardedDataParallel.full_optim_state_dict(ref, ropt)
        if dist.get_rank() == 0 and _desc_osd(a) != _desc_osd(b) or dist.get_rank() and a != {}:
            problems.append(f"uop={uop} full_optim_state_dict differs")
        full = FSDP.full_optim_state_dict(ours, oopt, rank0_only=False)
        for name, got in (
            ("shard_full", FSDP.shard_full_optim_state_dict(full, ours, optim=oopt)),
            ("scatter_full", FSDP.scatter_full_optim_state_dict(a or None, ours, optim=oopt)),
            ("flatten_sharded", FSDP.flatten_sharded_optim_state_dict(
                FSDP.sharded_optim_state_dict(ours, oopt), ours, oopt)),
        ):
            if _desc_osd(got)[0] != _desc_osd(local)[0] or got["param_groups"] != local["param_groups"]:
                problems.append(f"uop={uop} {name} differs from the local optimizer state")
        s1 = _desc_osd(FSDP.sharded_optim_state_dict(ours, oopt))
        s2 = _desc_osd(tm.FullyShardedDataParallel.sharded_optim_state_dict(ref, ropt))
        if s1 != s2:
            problems.append(f"uop={uop} sharded_optim_state_dict differs")
    # rekey with a plain model, both directions
    plain = C.make_model("seq")
    popt = torch.optim.Adam(plain.parameters(), lr=0.01)
    plain(torch.randn(2, 4)).sum().backward()
    popt.step()
    raw = popt.state_dict()
    for key_type in ("PARAM_NAME", "PARAM_ID"):
        mine = FSDP.rekey_optim_state_dict(
            FSDP.rekey_optim_state_dict(raw, OptimStateKeyType.PARAM_NAME, plain),
            getattr(OptimStateKeyType, key_type), plain)
        theirs = tm.FullyShardedDataParallel.rekey_optim_state_dict(
            tm.FullyShardedDataParallel.rekey_optim_state_dict(
                raw, tm.OptimStateKeyType.PARAM_NAME, plain),
            getattr(tm.OptimStateKeyType, key_type), plain)
        if _desc_osd(mine) != _desc_osd(theirs):
            problems.append(f"rekey {key_type}: {_desc_osd(mine)[1]} vs {_desc_osd(theirs)[1]}")
    return problems


def test_legacy_apis_match_torch(pool2: Any) -> None:
    assert pool2.run(_legacy_match_torch) == [[], []]


# ---------------------------------------------------------------- errors


def _load_errors() -> list[str]:
    problems = []
    model, opt = _trained("seq", False, True, steps=1)
    for sd_type in TYPES:
        osd = _osd(model, opt, sd_type)
        bad = {"state": dict(osd["state"]), "param_groups": osd["param_groups"]}
        bad["state"]["nope.weight"] = bad["state"].pop("0.bias")
        bad["state"]["2.weight"] = {"exp_avg": torch.zeros(7, 7), "step": torch.tensor(1.0)}
        try:
            _to_load(model, opt, sd_type, bad)
            problems.append(f"{sd_type}: no error")
        except ValueError as e:
            msg = str(e)
            if "nope.weight" not in msg or "2.weight" not in msg or "_fsdp_wrapped" in msg:
                problems.append(f"{sd_type}: {msg}")
    return problems


def test_load_errors_list_every_mismatch(pool2: Any) -> None:
    assert pool2.run(_load_errors) == [[], []]


def _state_order_is_rank0s() -> list[str]:
    """Without use_orig_params rank 0's optimizer decides the order of "state"
    (as torch's FSDP1): with rank 1's optimizer listing the parameters the other
    way round, every rank's order is the one every rank gets when all list them
    alike."""
    orders = []
    for reverse_on_rank1 in (False, True):
        model = C.wrap_ours("seq", False)
        params = list(model.parameters())
        if reverse_on_rank1 and dist.get_rank() == 1:
            params = params[::-1]
        opt = torch.optim.Adam(params, lr=0.01)
        C.train(model, opt, "seq", range(1))
        orders.append(list(_osd(model, opt, "FULL_STATE_DICT", offload_to_cpu=False)["state"]))
    if len(orders[0]) < 2 or orders[1] != orders[0]:
        return [f"rank {dist.get_rank()}: {orders[1]}, not rank 0's order {orders[0]}"]
    return []


def test_state_order_is_rank0s_optimizer_order(pool2: Any) -> None:
    assert pool2.run(_state_order_is_rank0s) == [[], []]
