"""Model state dicts: SHARDED / LOCAL formats against torch's FSDP1, round trips,
DCP save/load both ways between torch's FSDP1 and fsdp_wrap, resharding, errors.

Hybrid strategies (4 ranks): tests/test_state_dict_hybrid.py.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import fsdp_wrap
from tests import _ckpt_common as C
from tests._sweep import Injection, run_sweep

FSDP = fsdp_wrap.FullyShardedDataParallel
SDT = fsdp_wrap.StateDictType


def _torch() -> Any:
    import torch.distributed.fsdp as tfsdp

    return tfsdp


def _step(model: torch.nn.Module, kind: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    C.train(model, opt, kind, range(1))


def _sd(model: torch.nn.Module, sd_type: str, **cfg: Any) -> dict[str, Any]:
    mod = fsdp_wrap if isinstance(model, FSDP) else _torch()
    config = None
    if cfg:
        config = getattr(mod, sd_type.split("_")[0].title() + "StateDictConfig")(**cfg)
    with mod.FullyShardedDataParallel.state_dict_type(
        model, getattr(mod.StateDictType, sd_type), config
    ):
        return model.state_dict()


def _load(model: torch.nn.Module, sd_type: str, sd: dict[str, Any], strict: bool = True) -> Any:
    mod = fsdp_wrap if isinstance(model, FSDP) else _torch()
    with mod.FullyShardedDataParallel.state_dict_type(model, getattr(mod.StateDictType, sd_type)):
        return model.load_state_dict(sd, strict=strict)


# ------------------------------------------------------------- formats


def _formats_configs(kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    return [dict(kind=kind, uop=uop, mesh=use_mesh)
            for kind in kinds for uop in (False, True) for use_mesh in (False, True)]


def _formats_match_torch(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """SHARDED (ShardedTensor and DTensor) and LOCAL equal torch's, value for value."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # a collective: once, up front
    return run_sweep(configs, lambda c: _formats_one(c, mesh), inject=inject)


def _formats_one(c: dict[str, Any], mesh: Any) -> list[str]:
    kind, uop, use_mesh = c["kind"], c["uop"], c["mesh"]
    problems = []
    kw = {"device_mesh": mesh} if use_mesh else {}
    ours, ref = C.wrap_ours(kind, uop, **kw), C.wrap_torch(kind, uop, **kw)
    _step(ours, kind)
    _step(ref, kind)
    types = ["SHARDED_STATE_DICT"] if use_mesh else ["SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]
    for sd_type in types:
        a = C.describe_sd(_sd(ours, sd_type))
        b = C.describe_sd(_sd(ref, sd_type))
        if sd_type == "LOCAL_STATE_DICT" and uop:
            # torch adds the 1-D original views, which it cannot load back;
            # fsdp_wrap emits only the _flat_param keys (and buffers).
            b = {k: v for k, v in b.items() if k.endswith("_flat_param") or v[0] == "T" and k in a}
        tag = f"{kind} uop={uop} mesh={use_mesh} {sd_type}"
        problems += C.problem(f"{tag}: keys {list(a)} vs {list(b)}",
                              list(a) != list(b) and sorted(a) != sorted(b))
        for k in b:
            problems += C.problem(f"{tag} {k}: {a.get(k)} vs {b[k]}", a.get(k) != b[k])
        if sd_type == "SHARDED_STATE_DICT":
            want = "DT" if use_mesh else "ST"
            bad = [k for k, v in a.items() if k not in ("buf", "scale") and v[0] != want]
            problems += C.problem(f"{kind} uop={uop} {sd_type}: not {want}: {bad}", bool(bad))
    return problems


@pytest.mark.parametrize("ws", [2, 4])
def test_sharded_and_local_formats_match_torch(ws: int, pool2: Any, pool4: Any) -> None:
    # 4 ranks: trailing ranks hold no chunk of the 3-row parameters
    pool, kinds = (pool2, ("seq", "tied")) if ws == 2 else (pool4, ("seq",))
    assert pool.run(_formats_match_torch, _formats_configs(kinds)) == [[]] * ws


def _every_rank_holds_a_shard() -> list[str]:
    """At 4 ranks the 3-row parameters of "seq" leave rank 3 without a row:
    torch's FSDP1 lists no shard for it, fsdp_wrap an empty one (so that a DCP
    load template keeps the key on every rank), in the model and the optimizer
    state dicts alike."""
    ours = C.wrap_ours("seq", False)
    opt = torch.optim.Adam(ours.parameters(), lr=0.01)
    C.train(ours, opt, "seq", range(1))
    with FSDP.state_dict_type(ours, SDT.SHARDED_STATE_DICT):
        sd = ours.state_dict()
        osd = FSDP.optim_state_dict(ours, opt)
    values = {k: v for k, v in sd.items() if k != "buf"}
    values.update({f"{k}.{n}": v for k, st in osd["state"].items() for n, v in st.items()
                   if n != "step"})
    problems = []
    for k, v in values.items():
        listed = [list(m.shard_sizes) for m in v.metadata().shards_metadata]
        mine = [list(s.metadata.shard_sizes) for s in v.local_shards()]
        problems += C.problem(f"{k}: {len(listed)} shards listed, {len(mine)} held here",
                              len(listed) != dist.get_world_size() or len(mine) != 1)
    small = values["2.weight"]  # 3 rows over 4 ranks: rank 3 holds none
    rows = small.local_shards()[0].tensor.shape[0]
    problems += C.problem(f"2.weight: rank {dist.get_rank()} holds {rows} rows",
                          rows != (0 if dist.get_rank() == 3 else 1))
    return problems


def test_every_rank_holds_a_shard(pool4: Any) -> None:
    assert pool4.run(_every_rank_holds_a_shard) == [[]] * 4


def _use_dtensor_flag_and_offload() -> list[str]:
    problems = []
    ours = C.wrap_ours("seq", False)
    sd = _sd(ours, "SHARDED_STATE_DICT", _use_dtensor=True, offload_to_cpu=True)
    from torch.distributed.tensor import DTensor

    if not isinstance(sd["0.weight"], DTensor) or sd["0.weight"].shape != (6, 4):
        problems.append(f"_use_dtensor gave {type(sd['0.weight'])}")
    full = C.full_params(ours)
    if not torch.equal(sd["0.weight"].full_tensor(), full["0.weight"]):
        problems.append("DTensor value differs")
    ours2 = C.wrap_ours("seq", False, seed=3)
    with FSDP.state_dict_type(ours2, SDT.SHARDED_STATE_DICT, fsdp_wrap.ShardedStateDictConfig(_use_dtensor=True)):
        ours2.load_state_dict(sd)
    if any(not torch.equal(v, C.full_params(ours2)[k]) for k, v in full.items()):
        problems.append("_use_dtensor round trip differs")
    return problems


def test_use_dtensor_without_mesh(pool2: Any) -> None:
    assert pool2.run(_use_dtensor_flag_and_offload) == [[], []]


# ---------------------------------------------------------- round trips


def _round_trip_configs() -> list[dict[str, Any]]:
    return [dict(kind=kind, uop=uop, strategy=strategy)
            for kind in ("seq", "tied") for uop in (False, True)
            for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]


def _round_trips(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _round_trip, inject=inject)


def _round_trip(c: dict[str, Any]) -> list[str]:
    kind, uop, strategy = c["kind"], c["uop"], c["strategy"]
    problems = []
    st = getattr(fsdp_wrap.ShardingStrategy, strategy)
    src = C.wrap_ours(kind, uop, sharding_strategy=st)
    _step(src, kind)
    want = C.full_params(src)
    for sd_type in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sd = _sd(src, sd_type)
            dst = C.wrap_ours(kind, uop, seed=5, sharding_strategy=st)
            result = _load(dst, sd_type, sd)
        tag = f"{kind} uop={uop} {strategy} {sd_type}"
        problems += C.problem(f"{tag}: {result}", bool(result.missing_keys or result.unexpected_keys))
        got = C.full_params(dst)
        problems += C.problem(f"{tag}: values differ after load", sorted(got) != sorted(want) or any(
            not torch.equal(got[k], want[k]) for k in want))
        no_shard_warned = any("full_state_dict will be returned" in str(w.message) for w in caught)
        problems += C.problem(f"{tag}: NO_SHARD warning {no_shard_warned}",
                              (strategy == "NO_SHARD" and sd_type != "FULL_STATE_DICT") != no_shard_warned)
        problems += C.problem(f"{tag}: NO_SHARD did not fall back to FULL", strategy == "NO_SHARD" and any(
            C.describe(v)[0] != "T" for v in sd.values()))
        # the loaded model trains on identically to the source
        a = C.train(src, torch.optim.SGD(src.parameters(), lr=0.1), kind, range(5, 6))
        b = C.train(dst, torch.optim.SGD(dst.parameters(), lr=0.1), kind, range(5, 6))
        problems += C.problem(f"{tag}: loss after load {b} vs {a}", abs(a[0] - b[0]) > 1e-6)
        want = C.full_params(src)
    return problems


def test_round_trips_every_type_and_strategy(pool2: Any, pool3: Any) -> None:
    assert pool2.run(_round_trips, _round_trip_configs()) == [[], []]
    assert pool3.run(_round_trips, _round_trip_configs()) == [[], [], []]


# -------------------------------------------------------------- DCP


def _dcp_save(model: torch.nn.Module, path: str) -> dict[str, list[float]]:
    sd = _sd(model, "SHARDED_STATE_DICT")
    dcp.save({"model": sd}, checkpoint_id=path)
    return {k: v.flatten().tolist() for k, v in C.full_params(model).items()}


def _dcp_load(model: torch.nn.Module, path: str) -> dict[str, list[float]]:
    sd = {"model": _sd(model, "SHARDED_STATE_DICT")}
    dcp.load(sd, checkpoint_id=path)
    result = _load(model, "SHARDED_STATE_DICT", sd["model"])
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(str(result))
    return {k: v.flatten().tolist() for k, v in C.full_params(model).items()}


def _dcp_interop_configs(root: str) -> list[dict[str, Any]]:
    """torch saves -> fsdp_wrap loads, fsdp_wrap saves -> torch loads, both uop modes."""
    return [dict(root=root, kind=kind, uop=save_uop, saver=saver, loader=loader)
            for kind in ("seq", "tied") for save_uop in (False, True)
            for saver, loader in (("torch", "ours"), ("ours", "torch"), ("ours", "ours"))]


def _dcp_interop(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _dcp_interop_one, inject=inject)


def _dcp_interop_one(c: dict[str, Any]) -> list[str]:
    wrappers = {"torch": C.wrap_torch, "ours": C.wrap_ours}
    kind, save_uop, saver, loader = c["kind"], c["uop"], c["saver"], c["loader"]
    path = os.path.join(c["root"], f"{kind}-{save_uop}-{saver}-{loader}")
    src = wrappers[saver](kind, save_uop)
    _step(src, kind)
    want = _dcp_save(src, path)
    dst = wrappers[loader](kind, not save_uop, seed=9)
    got = _dcp_load(dst, path)
    return C.problem(f"{kind} uop={save_uop} {saver}->{loader}: values differ", got != want)


def test_dcp_interop_with_torch_fsdp(pool2: Any, tmp_path: Any) -> None:
    assert pool2.run(_dcp_interop, _dcp_interop_configs(str(tmp_path))) == [[], []]


def _dcp_save_ours(path: str, uop: bool) -> dict[str, list[float]]:
    src = C.wrap_ours("seq", uop)
    _step(src, "seq")
    return _dcp_save(src, path)


def _dcp_load_ours(path: str, uop: bool) -> dict[str, list[float]]:
    return _dcp_load(C.wrap_ours("seq", uop, seed=4), path)


def test_dcp_reshard_2_to_3_and_4(pool2: Any, pool3: Any, pool4: Any, tmp_path: Any) -> None:
    for uop in (False, True):
        path = str(tmp_path / f"uop{uop}")
        want = pool2.run(_dcp_save_ours, path, uop)[0]
        assert pool3.run(_dcp_load_ours, path, not uop) == [want] * 3
        assert pool4.run(_dcp_load_ours, path, uop) == [want] * 4


# ------------------------------------------------------------- errors


def _load_errors() -> list[str]:
    out = []
    for sd_type in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        for uop in (False, True):
            model = C.wrap_ours("seq", uop)
            sd = _sd(model, sd_type)
            bad = dict(sd)
            key = "0._flat_param" if sd_type == "LOCAL_STATE_DICT" else "0.bias"
            del bad[key]
            bad["nope.weight"] = torch.zeros(1)
            if sd_type != "LOCAL_STATE_DICT":
                bad["0.weight"] = _sd(C.wrap_ours("seq", uop), sd_type)["2.weight"]  # (3, 6) for (6, 4)
            try:
                _load(model, sd_type, bad)
                out.append(f"{sd_type} uop={uop}: no error")
            except RuntimeError as e:
                msg = str(e)
                must = [key, "nope.weight"] + ([] if sd_type == "LOCAL_STATE_DICT" else ["0.weight"])
                if "_fsdp_wrapped_module" in msg or any(m not in msg for m in must):
                    out.append(f"{sd_type} uop={uop}: {msg}")
            result = _load(model, sd_type, {k: v for k, v in sd.items() if k != key}, strict=False)
            if result.missing_keys != [key] or result.unexpected_keys:
                out.append(f"{sd_type} uop={uop} strict=False: {result}")
    return out


def test_load_errors_name_clean_fqns_in_one_error(pool2: Any) -> None:
    assert pool2.run(_load_errors) == [[], []]


def _mismatched_calls() -> list[str]:
    model = C.wrap_ours("seq", False)
    sd_type = "FULL_STATE_DICT" if dist.get_rank() == 0 else "SHARDED_STATE_DICT"
    try:
        _sd(model, sd_type)
    except RuntimeError as e:
        return ["collective" in str(e) and "state_dict(SHARDED_STATE_DICT)" in str(e)]
    return ["no error"]


def _local_with_mesh() -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = C.wrap_ours("seq", False, device_mesh=mesh)
    try:
        _sd(model, "LOCAL_STATE_DICT")
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_collective_misuse_fails_fast(pool2: Any) -> None:
    assert pool2.run(_mismatched_calls) == [[True], [True]]
    msgs = pool2.run(_local_with_mesh)
    assert all("DeviceMesh is not compatible with LOCAL_STATE_DICT" in m for m in msgs)
