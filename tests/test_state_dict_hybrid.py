"""State dicts and optimizer state under HYBRID_SHARD / _HYBRID_SHARD_ZERO2
(4 ranks: 2 replicas x 2 shards), against torch's FSDP1 HSDP.

* Formats, value for value and in order: SHARDED is a ShardedTensor chunked
  over the shard group with global-rank placements (groups given as a
  ``(shard, replicate)`` tuple) or a DTensor ``(Replicate(), Shard(0))`` on the
  2-D mesh; FULL gives every rank the full dict (``rank0_only``: shard-group
  rank 0 of every replica for the model, global rank 0 only for the optimizer,
  as torch).
* Round trips of every state-dict type x use_orig_params x hybrid strategy x
  group form resume training exactly.
* DCP: the ``.metadata`` equals torch's (every chunk written once, not once
  per replica); a hybrid checkpoint resumes in FULL_SHARD on 2 ranks and a
  FULL_SHARD checkpoint resumes in hybrid on 4 ranks, equal to torch's FSDP1
  resuming the same files.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_wrap
from tests import _ckpt_common as C
from tests._sweep import Injection, run_sweep

HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
LR = 0.01


def _tmod() -> Any:
    import torch.distributed.fsdp as tfsdp

    return tfsdp


def _mod(impl: str) -> Any:
    return fsdp_wrap if impl == "ours" else _tmod()


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _build(impl: str, kind: str, uop: bool, strategy: str, form: str | None, mesh: Any,
           seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """``form``: "tuple" / "mesh" (hybrid groups) or None (default group)."""
    kw: dict[str, Any] = {"sharding_strategy": getattr(_mod(impl).ShardingStrategy, strategy)}
    if form == "tuple":
        kw["process_group"] = (mesh.get_group("shard"), mesh.get_group("replicate"))
    elif form == "mesh":
        kw["device_mesh"] = mesh
    model = (C.wrap_ours if impl == "ours" else C.wrap_torch)(kind, uop, seed=seed, **kw)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def _impl(model: torch.nn.Module) -> str:
    return "ours" if isinstance(model, fsdp_wrap.FullyShardedDataParallel) else "torch"


def _ctx(model: torch.nn.Module, sd_type: str, rank0_only: bool = False) -> Any:
    mod = _mod(_impl(model))
    cfg = ocfg = None
    if sd_type == "FULL_STATE_DICT":
        cfg = mod.FullStateDictConfig(rank0_only=rank0_only)
        # torch aliases exp_avg/exp_avg_sq with offload_to_cpu on CPU (reference section 12)
        ocfg = mod.FullOptimStateDictConfig(rank0_only=rank0_only, offload_to_cpu=False)
    return mod.FullyShardedDataParallel.state_dict_type(
        model, getattr(mod.StateDictType, sd_type), cfg, ocfg
    )


def _save(model: torch.nn.Module, opt: Any, sd_type: str, rank0_only: bool = False) -> dict[str, Any]:
    F = _mod(_impl(model)).FullyShardedDataParallel
    with _ctx(model, sd_type, rank0_only):
        return {"model": model.state_dict(), "optim": F.optim_state_dict(model, opt)}


def _load(model: torch.nn.Module, opt: Any, state: dict[str, Any], sd_type: str,
          rank0_only: bool = False) -> Any:
    F = _mod(_impl(model)).FullyShardedDataParallel
    with _ctx(model, sd_type, rank0_only):
        result = model.load_state_dict(state["model"])
        opt.load_state_dict(F.optim_state_dict_to_load(model, opt, state["optim"] or None))
    return result


# ------------------------------------------------------------- formats


def _formats_configs() -> list[dict[str, Any]]:
    return [dict(form=form, strategy=strategy, uop=uop, kind=kind)
            for form in ("tuple", "mesh") for strategy in HYBRID
            for uop in (False, True) for kind in ("seq", "tied")]


def _formats_match_torch(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    mesh = _mesh()  # a collective: once, up front
    return run_sweep(configs, lambda c: _formats_one(c, mesh), inject=inject)


def _formats_one(c: dict[str, Any], mesh: Any) -> list[str]:
    form, strategy, uop, kind = c["form"], c["strategy"], c["uop"], c["kind"]
    problems = []
    tag = f"[rank {dist.get_rank()}] {form} {strategy} uop={uop} {kind}"
    pair = [_build(impl, kind, uop, strategy, form, mesh) for impl in ("ours", "torch")]
    for model, opt in pair:
        C.train(model, opt, kind, range(2))
    for sd_type, r0 in (("SHARDED_STATE_DICT", False), ("FULL_STATE_DICT", False),
                        ("FULL_STATE_DICT", True)):
        a, b = (_save(m, o, sd_type, r0) for m, o in pair)
        problems += C.problem(f"{tag} {sd_type} r0={r0} model differs",
                              C.describe_ordered(a["model"]) != C.describe_ordered(b["model"]))
        problems += C.problem(f"{tag} {sd_type} r0={r0} optim differs",
                              C.describe_osd(a["optim"]) != C.describe_osd(b["optim"]))
        if sd_type == "SHARDED_STATE_DICT":
            want = "DT" if form == "mesh" else "ST"
            kinds = {C.describe(v)[0] for k, v in a["model"].items() if k not in ("buf", "scale")}
            problems += C.problem(f"{tag}: SHARDED values {kinds}, want {want}", kinds != {want})
        if r0:  # the model: shard rank 0 of every replica; optimizer: global rank 0
            problems += C.problem(f"{tag}: rank0_only model keys {list(a['model'])}",
                                  bool(a["model"]) != (dist.get_rank() % 2 == 0))
            problems += C.problem(f"{tag}: rank0_only optim {list(a['optim'])}",
                                  bool(a["optim"]) != (dist.get_rank() == 0))
    if form == "mesh":  # LOCAL is refused with a device mesh, by both
        # (before any collective, on every rank alike: the same model on every rank)
        msgs = []
        for model, _ in pair:
            try:
                _save(model, _, "LOCAL_STATE_DICT")
                msgs.append("no error")
            except RuntimeError as e:
                msgs.append(str(e))
        # torch < 2.13 shows its message as a tuple of strings;
        # compare the words, not the punctuation.  Ours starts with torch's
        # words, then adds the rank and the cause.
        words = [" ".join(re.sub(r"[()',.]", " ", m).split()) for m in msgs]
        problems += C.problem(f"{tag}: LOCAL with a mesh: {msgs}", (
            not words[0].startswith(words[1]) or f"[rank {dist.get_rank()}]" not in msgs[0]
            or "DeviceMesh is not compatible" not in msgs[1]))
    return problems


def test_hybrid_formats_match_torch(pool4: Any) -> None:
    assert pool4.run(_formats_match_torch, _formats_configs()) == [[]] * 4


# ---------------------------------------------------------- round trips


def _round_trip_configs() -> list[dict[str, Any]]:
    return [dict(form=form, strategy=strategy, uop=uop, sd_type=sd_type, r0=r0)
            for form in ("tuple", "mesh") for strategy in HYBRID for uop in (False, True)
            for sd_type, r0 in [(t, False) for t in TYPES] + [("FULL_STATE_DICT", True)]
            if not (sd_type == "LOCAL_STATE_DICT" and form == "mesh")]


def _round_trips(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """Save model + optimizer, load into a fresh model, both resume exactly.

    FULL and SHARDED load into the other use_orig_params mode and the other
    group form; LOCAL needs the same layout (and no mesh).
    """
    warnings.simplefilter("ignore")
    mesh = _mesh()  # a collective: once, up front
    return run_sweep(configs, lambda c: _round_trip(c, mesh), inject=inject)


def _round_trip(c: dict[str, Any], mesh: Any) -> list[str]:
    form, strategy, uop, sd_type, r0 = c["form"], c["strategy"], c["uop"], c["sd_type"], c["r0"]
    same = sd_type == "LOCAL_STATE_DICT"
    tag = f"[rank {dist.get_rank()}] {form} {strategy} uop={uop} {sd_type} r0={r0}"
    kind = "tied" if uop else "seq"
    src, sopt = _build("ours", kind, uop, strategy, form, mesh)
    C.train(src, sopt, kind, range(2))
    state = _save(src, sopt, sd_type, r0)
    if r0:  # rank0_only model dicts are loaded by broadcasting rank 0's
        objs = [state["model"] if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(objs, src=0)
        state["model"] = objs[0]
    other = form if same else ("mesh" if form == "tuple" else "tuple")
    dst, dopt = _build("ours", kind, uop if same else not uop, strategy, other, mesh, seed=7)
    # (load before the source trains on: LOCAL values are views of its shards)
    result = _load(dst, dopt, state, sd_type, r0)
    problems = C.problem(f"{tag}: {result}", bool(result.missing_keys or result.unexpected_keys))
    want = C.train(src, sopt, kind, range(2, 5))
    got = C.train(dst, dopt, kind, range(2, 5))
    problems += C.problem(f"{tag}: resumed losses {got} vs {want}",
                          max(abs(x - y) for x, y in zip(got, want)) > 1e-6)
    return problems


def test_hybrid_round_trips_resume_exactly(pool4: Any) -> None:
    assert pool4.run(_round_trips, _round_trip_configs()) == [[]] * 4


# ------------------------------------------------------------------ DCP


def _md_summary(path: str) -> Any:
    md = dcp.FileSystemReader(path).read_metadata()
    meta = {
        k: (type(v).__name__, [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(v, "chunks", [])])
        for k, v in md.state_dict_metadata.items()
    }
    storage = sorted(
        (k.fqn, tuple(k.offset or ()), v.relative_path, v.offset, v.length)
        for k, v in md.storage_data.items()
    )
    return meta, storage


def _dcp_save_configs(root: str) -> list[dict[str, Any]]:
    return [dict(root=root, form=form, uop=uop) for form in ("tuple", "mesh") for uop in (False, True)]


def _dcp_save_hybrid(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    """fsdp_wrap and torch save the same hybrid job: identical metadata, each chunk once."""
    warnings.simplefilter("ignore")
    mesh = _mesh()  # a collective: once, up front
    return run_sweep(configs, lambda c: _dcp_save_one(c, mesh), inject=inject)


def _dcp_save_one(c: dict[str, Any], mesh: Any) -> list[str]:
    form, uop = c["form"], c["uop"]
    summaries = []
    for impl in ("ours", "torch"):
        model, opt = _build(impl, "seq", uop, "HYBRID_SHARD", form, mesh)
        C.train(model, opt, "seq", range(2))
        path = os.path.join(c["root"], f"hsdp-{form}-{uop}-{impl}")
        dcp.save(_save(model, opt, "SHARDED_STATE_DICT"), checkpoint_id=path)
        summaries.append(_md_summary(path))
    tag = f"{form} uop={uop}"
    problems = C.problem(f"{tag}: metadata differs from torch's", summaries[0] != summaries[1])
    meta, storage = summaries[0]
    problems += C.problem(f"{tag}: 0.weight chunks {meta['model.0.weight']}",
                          sorted(meta["model.0.weight"][1]) != [((0, 0), (3, 4)), ((3, 0), (3, 4))])
    written = [s[:2] for s in storage]
    problems += C.problem(f"{tag}: some chunk is written more than once",
                          len(written) != len(set(written)))
    return problems


def _resume(impl: str, path: str, uop: bool, strategy: str, form: str | None) -> list[float]:
    """A fresh job loads a SHARDED DCP checkpoint (model + optimizer) and trains on."""
    warnings.simplefilter("ignore")
    mesh = _mesh() if form else None
    model, opt = _build(impl, "seq", uop, strategy, form, mesh, seed=11)
    C.train(model, opt, "seq", range(100, 101))  # optimizer state exists: a DCP template
    state = _save(model, opt, "SHARDED_STATE_DICT")
    dcp.load(state, checkpoint_id=path)
    _load(model, opt, state, "SHARDED_STATE_DICT")
    return C.train(model, opt, "seq", range(2, 5))


def _resume_both(path: str, uop: bool, strategy: str, form: str | None) -> list[list[float]]:
    return [_resume(impl, path, uop, strategy, form) for impl in ("ours", "torch")]


def _save_job(path: str, uop: bool, strategy: str, form: str | None) -> list[float]:
    """Train 2 steps, save; return the uninterrupted continuation's losses."""
    warnings.simplefilter("ignore")
    mesh = _mesh() if form else None
    model, opt = _build("ours", "seq", uop, strategy, form, mesh)
    C.train(model, opt, "seq", range(2))
    dcp.save(_save(model, opt, "SHARDED_STATE_DICT"), checkpoint_id=path)
    return C.train(model, opt, "seq", range(2, 5))


def test_hybrid_dcp_metadata_matches_torch(pool4: Any, tmp_path: Any) -> None:
    assert pool4.run(_dcp_save_hybrid, _dcp_save_configs(str(tmp_path))) == [[]] * 4


def _close(a: list[float], b: list[float]) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) <= 1e-6


def test_hybrid_dcp_resumes_in_other_layouts(pool2: Any, pool4: Any, tmp_path: Any) -> None:
    # hybrid (2 x 2) -> same hybrid job (other group form and uop), FULL_SHARD on 2 ranks
    for uop in (False, True):
        path = str(tmp_path / f"hsdp-{uop}")
        want = pool4.run(_save_job, path, uop, "HYBRID_SHARD", "mesh")[0]
        for ours, ref in pool4.run(_resume_both, path, not uop, "_HYBRID_SHARD_ZERO2", "tuple"):
            assert _close(ours, want) and _close(ref, want), (ours, ref, want)
        for ours, ref in pool2.run(_resume_both, path, uop, "FULL_SHARD", None):
            assert _close(ours, ref), (ours, ref)
    # FULL_SHARD on 2 ranks -> hybrid (2 x 2), both group forms
    path = str(tmp_path / "fs2")
    pool2.run(_save_job, path, True, "FULL_SHARD", None)
    for form in ("tuple", "mesh"):
        for ours, ref in pool4.run(_resume_both, path, False, "HYBRID_SHARD", form):
            assert _close(ours, ref), (form, ours, ref)
