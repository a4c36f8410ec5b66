"""2-D state dicts and optimizer state against torch's FSDP1 + TP (4 gloo ranks,
``dp=2 x tp=2``; docs/two_d.rst).

For each configuration torch's FSDP1 and fsdp_wrap train the same TP model
one step (bit-exact, tests/test_two_d.py), then:

* their model state dicts (FULL, FULL ``rank0_only``, SHARDED) and optimizer
  state dicts (FULL, SHARDED) are the same, value for value: same keys, same
  kind (DTensor or plain), same mesh and placements, equal local tensors;
* checkpoints move both ways: torch's SHARDED model and optimizer state
  loaded into a fresh fsdp_wrap model (and fsdp_wrap's into a fresh torch
  model, where torch's FSDP1 can load it: ``use_orig_params=True``), after
  which one more step on both sides must agree bit for bit; the same through
  ``torch.distributed.checkpoint`` (DCP) files;
* a DCP checkpoint of the 2-D model loads into a ``dp=4`` model without TP
  (DCP reshards) and gives the same full parameters;
* LOCAL_STATE_DICT is refused with torch's sentence; a FULL state dict of the
  unwrapped model (plain tensors, which torch's FSDP1 cannot load into its TP
  model) loads into fsdp_wrap's.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import compare_step, loss_of, rank_tag, run_configs, train_step
from tests._sweep import Injection, any_rank, injected
from tests._two_d_common import TPNet, data_gen, make_input, mesh_2d, mesh_3d, tp_model, wrap
from tests.models import fsdp_api


def _same(what: str, a: Any, b: Any) -> str | None:
    """None if ``a`` (torch's) and ``b`` (ours) are the same value, exactly."""
    from torch.distributed.tensor import DTensor

    bad = injected(what)
    if bad:
        return bad

    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return f"{what}: torch {type(a).__name__} vs ours {type(b).__name__}"
    if isinstance(a, DTensor):
        if (tuple(a.placements), a.device_mesh, a.shape) != (tuple(b.placements), b.device_mesh, b.shape):
            return (f"{what}: torch {a.placements} {a.device_mesh} {tuple(a.shape)} vs ours "
                    f"{b.placements} {b.device_mesh} {tuple(b.shape)}")
        a, b = a.to_local(), b.to_local()
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"{what}: torch {a.shape}/{a.dtype} vs ours {getattr(b, 'shape', type(b))}"
        return None if torch.equal(a.detach().cpu(), b.detach().cpu()) else f"{what}: values differ"
    return None if a == b else f"{what}: torch {a!r} vs ours {b!r}"


def _same_dict(what: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    if list(a) != list(b):
        return [f"{what}: keys torch {list(a)} vs ours {list(b)}"]
    out = []
    for k in a:
        if isinstance(a[k], dict):
            out += _same_dict(f"{what}[{k}]", a[k], b[k])
        else:
            err = _same(f"{what}[{k}]", a[k], b[k])
            if err:
                out.append(err)
    return out


def _meshes(cfg: dict[str, Any]) -> tuple[Any, Any]:
    if cfg.get("hybrid"):
        m = mesh_3d()
        return m["tp"], m["rep", "shard"]
    m = mesh_2d()
    return m["tp"], m["dp"]


def _build(impl: str, cfg: dict[str, Any], seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    tp_mesh, fsdp_mesh = _meshes(cfg)
    model = wrap(impl, tp_model(tp_mesh, seed), device_mesh=fsdp_mesh, use_orig_params=cfg["uop"],
                 sharding_strategy=cfg["strategy"], nested=cfg.get("nested", False))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    return train_step(model, opt, loss_of(model(x)))


def _dicts(impl: str, model: nn.Module, opt: torch.optim.Optimizer | None, sd_type: str,
           rank0_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts (``opt=None``: the model's only)."""
    api = fsdp_api(impl)
    T = api.StateDictType
    if sd_type == "FULL":
        cfgs = (api.FullStateDictConfig(rank0_only=rank0_only),
                api.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only))
    else:
        cfgs = (api.ShardedStateDictConfig(), api.ShardedOptimStateDictConfig())
    cls = api.FullyShardedDataParallel
    with cls.state_dict_type(model, T[f"{sd_type}_STATE_DICT"], *cfgs):
        out = model.state_dict(), {} if opt is None else cls.optim_state_dict(model, opt)
    # Copied at once: torch's FULL optimizer state of TP parameters without
    # use_orig_params are DTensors that copy.deepcopy refuses ("invalid python
    # storage"), over local tensors that can be read now.
    return _clone(out) if impl == "torch" else out


def _clone(value: Any) -> Any:
    """A deep copy of a state dict, DTensors rebuilt from copies of their local tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().clone(), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def _load(impl: str, model: nn.Module, opt: torch.optim.Optimizer, sd_type: str,
          msd: dict[str, Any], osd: dict[str, Any]) -> None:
    api = fsdp_api(impl)
    cls = api.FullyShardedDataParallel
    with cls.state_dict_type(model, api.StateDictType[f"{sd_type}_STATE_DICT"]):
        model.load_state_dict(msd)
        opt.load_state_dict(cls.optim_state_dict_to_load(model, opt, osd))


def _results(pairs: list[tuple[nn.Module, torch.optim.Optimizer]],
             x: torch.Tensor) -> list[tuple[Any, ...]]:
    return [_step(m, o, x) for m, o in pairs]


def _scratch() -> str:
    path = [tempfile.mkdtemp(prefix="fsdp_wrap_2d_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    return str(path[0])


def _copied(what: str, pair: tuple[dict[str, Any], dict[str, Any]],
            fails: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A deep copy of a (model, optimizer) state-dict pair, taken at once (the
    models go on training); values that cannot be copied are reported."""
    try:
        return _clone(pair)  # type: ignore[no-any-return]
    except RuntimeError as e:
        fails.append(f"{what}: {e}")
        return pair


def _init_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (zero gradients, learning rate 0), so a
    DCP load has a template to fill, as DCP's own state-dict helpers do."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad()


def _dcp_round(writer_pair: tuple[nn.Module, torch.optim.Optimizer], writer: str, reader: str,
               cfg: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``writer``'s SHARDED model and optimizer state through DCP files into a fresh
    ``reader`` model."""
    import torch.distributed.checkpoint as dcp

    path = _scratch()
    msd, osd = _dicts(writer, *writer_pair, "SHARDED")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    fresh = _build(reader, cfg, seed=9)
    _init_optim_state(*fresh)
    tmsd, tosd = _dicts(reader, *fresh, "SHARDED")
    state = {"model": tmsd, "optim": tosd}
    dcp.load(state, checkpoint_id=path)
    _load(reader, *fresh, "SHARDED", state["model"], state["optim"])
    return fresh


def _formats(cfg: dict[str, Any]) -> list[str]:
    tag = f"{rank_tag()} {cfg}"
    fails: list[str] = []
    (tm, to), (om, oo) = _build("torch", cfg), _build("ours", cfg)
    gen = data_gen(cfg["idx"])
    x = make_input(gen)
    _step(tm, to, x)
    _step(om, oo, x)
    saved: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for sd_type, r0 in (("FULL", False), ("SHARDED", False), ("FULL", True)):
        o_msd, o_osd = _dicts("ours", om, oo, sd_type, r0)
        if r0 and cfg["uop"]:
            # torch's FSDP1 + TP hangs here (rank 0 alone redistributes each
            # TP-sharded state over the TP group): rank 0 must get the full
            # dict, the others nothing.
            t_msd, _ = _dicts("torch", tm, None, sd_type, r0)
            full_osd = saved["FULL"][1] if dist.get_rank() == 0 else {}
            fails += _same_dict(f"{tag} optim rank0_only vs torch's FULL", full_osd, o_osd)
            t_osd = o_osd
        else:
            t_msd, t_osd = _dicts("torch", tm, to, sd_type, r0)
        fails += _same_dict(f"{tag} {sd_type} rank0_only={r0} model", t_msd, o_msd)
        fails += _same_dict(f"{tag} {sd_type} rank0_only={r0} optim", t_osd, o_osd)
        if not r0:
            saved[sd_type] = _copied(f"{tag} torch's {sd_type}", (t_msd, t_osd), fails)
    if any_rank(bool(fails)):
        return fails
    ours_sharded = _copied(f"{tag} our SHARDED", _dicts("ours", om, oo, "SHARDED"), fails)
    # Into fsdp_wrap: fresh models (other initial values) load torch's
    # checkpoints and must then step exactly as the model they came from.
    into_ours: list[tuple[str, tuple[nn.Module, torch.optim.Optimizer]]] = []
    for sd_type in ("SHARDED", "FULL"):
        fresh = _build("ours", cfg, seed=7)
        _load("ours", *fresh, sd_type, *saved[sd_type])
        into_ours.append((f"torch's {sd_type} loaded into ours", fresh))
    into_ours.append(("DCP torch -> ours", _dcp_round((tm, to), "torch", "ours", cfg)))
    into_ours.append(("DCP ours -> ours", _dcp_round((om, oo), "ours", "ours", cfg)))
    # Into torch (use_orig_params=True: without it torch cannot load optimizer
    # state with TP): ours must load exactly as torch's own checkpoint does.
    # (Not as the source model steps: torch's FSDP1 + TP misplaces some
    # TP-sharded optimizer state loading its own SHARDED checkpoint.)
    into_torch: list[tuple[str, tuple[nn.Module, torch.optim.Optimizer],
                           tuple[nn.Module, torch.optim.Optimizer]]] = []
    if cfg["uop"]:
        pair = []
        for src in (saved["SHARDED"], ours_sharded):
            fresh = _build("torch", cfg, seed=7)
            _load("torch", *fresh, "SHARDED", *_clone(src))
            pair.append(fresh)
        into_torch.append(("ours SHARDED loaded into torch", pair[0], pair[1]))
        into_torch.append(("DCP ours -> torch", _dcp_round((tm, to), "torch", "torch", cfg),
                           _dcp_round((om, oo), "ours", "torch", cfg)))
    x = make_input(gen)
    want = _results([(tm, to)], x)[0]
    names = [n for n, _ in tm.named_parameters()]
    for what, loaded in into_ours:
        fails += compare_step(f"{tag} {what}", names, want, _results([loaded], x)[0], 0.0)
    for what, own, loaded in into_torch:
        fails += compare_step(f"{tag} {what}", names, *_results([own, loaded], x), 0.0)
    return fails


def _full_of(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _extras(cfg: dict[str, Any]) -> list[str]:
    """LOCAL refused; a plain FULL state dict loads; DCP reshards 2-D <-> 1-D."""
    import torch.distributed.checkpoint as dcp

    import fsdp_wrap

    tag = f"{rank_tag()} extras"
    fails: list[str] = []
    FSDP, T = fsdp_wrap.FullyShardedDataParallel, fsdp_wrap.StateDictType
    # LOCAL_STATE_DICT with a device mesh: torch's sentence (the model then
    # stays LOCAL, as torch's: a fresh one).
    try:
        local_model = _build("ours", cfg)[0]
        with FSDP.state_dict_type(local_model, T.LOCAL_STATE_DICT):
            local_model.state_dict()
        fails.append(f"{tag}: LOCAL_STATE_DICT was not refused")
    except RuntimeError as e:
        if not str(e).startswith("Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not "
                                 "compatible with LOCAL_STATE_DICT."):
            fails.append(f"{tag}: LOCAL_STATE_DICT refused with {e}")
    # The unwrapped model's state dict (plain tensors) loads into the TP model.
    model, opt = _build("ours", cfg)
    torch.manual_seed(5)
    plain = TPNet()
    with FSDP.state_dict_type(model, T.FULL_STATE_DICT):
        model.load_state_dict(plain.state_dict())
        got = model.state_dict()
    for k, v in plain.state_dict().items():
        if not torch.equal(_full_of(got[k]), v):
            fails.append(f"{tag}: plain FULL load, {k} differs")
    _step(model, opt, make_input(data_gen(cfg["idx"])))
    # DCP: 2-D (dp=2 x tp=2) -> 1-D (dp=4, no TP) and back.
    from torch.distributed.device_mesh import init_device_mesh

    flat_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    torch.manual_seed(3)
    other = wrap("ours", TPNet(), device_mesh=flat_mesh, use_orig_params=cfg["uop"],
                 sharding_strategy=cfg["strategy"], nested=cfg.get("nested", False))
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2)
    _init_optim_state(other, other_opt)
    for (src, src_opt), (dst, dst_opt), what in (((model, opt), (other, other_opt), "2-D -> 1-D"),
                                                 ((other, other_opt), (model, opt), "1-D -> 2-D")):
        path = _scratch()
        msd, osd = _dicts("ours", src, src_opt, "SHARDED")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        tmsd, tosd = _dicts("ours", dst, dst_opt, "SHARDED")
        state = {"model": tmsd, "optim": tosd}
        dcp.load(state, checkpoint_id=path)
        _load("ours", dst, dst_opt, "SHARDED", state["model"], state["optim"])
        a, b = _dicts("ours", src, src_opt, "FULL"), _dicts("ours", dst, dst_opt, "FULL")
        for k, v in a[0].items():
            if not torch.equal(_full_of(v), _full_of(b[0][k])):
                fails.append(f"{tag} DCP {what}: parameter {k} differs")
        for k, st in a[1]["state"].items():
            for n, v in st.items():
                if not torch.equal(_full_of(v), _full_of(b[1]["state"][k][n])):
                    fails.append(f"{tag} DCP {what}: optimizer state {k}.{n} differs")
    return fails


def _configs() -> list[dict[str, Any]]:
    out = [
        dict(strategy="FULL_SHARD", uop=True, nested=True),
        dict(strategy="FULL_SHARD", uop=False),
        dict(strategy="HYBRID_SHARD", uop=True, hybrid=True, nested=True),
    ]
    return [dict(c, idx=i) for i, c in enumerate(out)]


def _formats_sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_configs(configs, _formats, inject=inject)


def test_state_dicts_match_torch_and_move_both_ways(pool4: Any) -> None:
    results = pool4.run(_formats_sweep, _configs())
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails)


def _extras_task() -> list[str]:
    warnings.simplefilter("ignore")
    return _extras(dict(strategy="FULL_SHARD", uop=False, nested=True, idx=0))


def test_local_refused_plain_full_loads_dcp_reshards(pool4: Any) -> None:
    fails = [f for r in pool4.run(_extras_task) for f in r]
    assert not fails, "\n".join(fails)


# ---------------------------------------------------------------------------
# whole weights: summon_full_params, iter_full_weights, full checkpoints
# ---------------------------------------------------------------------------


def _whole(value: Any) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _weights(cfg: dict[str, Any]) -> list[str]:
    import fsdp_wrap
    from fsdp_wrap.checkpoint import load_full_checkpoint, save_full_checkpoint

    tag = f"{rank_tag()} weights {cfg}"
    fails: list[str] = []
    FSDP = fsdp_wrap.FullyShardedDataParallel
    (tm, to), (om, oo) = _build("torch", cfg), _build("ours", cfg)
    x = make_input(data_gen(cfg["idx"]))
    _step(tm, to, x)
    _step(om, oo, x)
    # summon_full_params: the same parameters as torch's (DTensors for TP ones),
    # a change written back alike.
    tcls = fsdp_api("torch").FullyShardedDataParallel
    for writeback in (True, False):
        with tcls.summon_full_params(tm, writeback=writeback), \
                FSDP.summon_full_params(om, writeback=writeback):
            t_params, o_params = dict(tm.named_parameters()), dict(om.named_parameters())
            fails += _same_dict(f"{tag} summon_full_params", t_params, o_params)
            with torch.no_grad():
                for params in (t_params, o_params):
                    params["blocks.0.up.weight"].add_(1.0)
                    params["inp.weight"].mul_(2.0)
        fails += _same_dict(f"{tag} after summon(writeback={writeback})",
                            _dicts("torch", tm, None, "FULL")[0], _dicts("ours", om, None, "FULL")[0])
    if cfg["uop"]:  # with_grads: the gradients gathered over dp, DTensors for TP ones
        for m in (tm, om):
            loss_of(m(x)).backward()
        with tcls.summon_full_params(tm, with_grads=True), \
                FSDP.summon_full_params(om, with_grads=True):
            fails += _same_dict(f"{tag} summon_full_params(with_grads=True) gradients",
                                {n: p.grad for n, p in tm.named_parameters()},
                                {n: p.grad for n, p in om.named_parameters()})
        to.zero_grad()
        oo.zero_grad()
    if any_rank(bool(fails)):
        return fails
    # The whole weights: the FULL state dict's values gathered over TP too.
    want = {k: _whole(v) for k, v in _dicts("ours", om, None, "FULL")[0].items()}
    for rank0_only in (False, True):
        got = dict(fsdp_wrap.iter_full_weights(om, rank0_only=rank0_only))
        expect = want if not rank0_only or dist.get_rank() == 0 else {}
        # (in unit order, documented: a nested unit's names after its parent's own)
        if set(got) != set(expect) or any(not torch.equal(got[k], expect[k]) for k in got):
            bad = [k for k in expect if k not in got or not torch.equal(got[k], expect[k])]
            fails.append(f"{tag} iter_full_weights(rank0_only={rank0_only}) differs from "
                         f"the FULL state dict's values, gathered whole: {bad or list(got)}")
    # A full checkpoint (plain safetensors of the whole weights) into fresh 2-D
    # models: by load_full_checkpoint and by load_pretrained.
    path = _scratch()
    save_full_checkpoint(om, path + "/ckpt")
    for loader in ("load_full_checkpoint", "load_pretrained"):
        fresh, _ = _build("ours", cfg, seed=11)
        if loader == "load_full_checkpoint":
            load_full_checkpoint(fresh, path + "/ckpt")
        else:
            fsdp_wrap.load_pretrained(fresh, path + "/ckpt")
        fails += _same_dict(f"{tag} {loader}", _dicts("ours", om, None, "FULL")[0],
                            _dicts("ours", fresh, None, "FULL")[0])
    # The memory plan of the TP model over the dp group: each rank's parameter
    # shards as the wrapped model holds them.
    from tests._two_d_common import Mlp

    planned = fsdp_wrap.plan(tp_model(_meshes(cfg)[0]), world_size=2, device="cpu",
                             auto_wrap_policy=fsdp_wrap.wrap.ModuleWrapPolicy({Mlp})
                             if cfg.get("nested") else None,
                             sharding_strategy=fsdp_wrap.ShardingStrategy[cfg["strategy"]],
                             use_orig_params=cfg["uop"])
    held = sum(h.local_shard.numel() * h.local_shard.element_size()
               for st in om._all_fsdp_states for h in st._handles)
    by_rank = {m.rank: m.params_device for m in planned.per_rank}
    dp_rank = dist.get_rank() // 2
    if by_rank.get(dp_rank, by_rank[0]) != held:
        fails.append(f"{tag} plan: {by_rank} bytes of parameter shards, the model holds {held}")
    if dist.get_rank() == 0:
        import glob

        from safetensors.torch import load_file

        stored: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(path + "/ckpt/*.safetensors")):
            stored.update(load_file(f))
        if set(stored) != set(want) or any(not torch.equal(stored[k], want[k]) for k in want):
            fails.append(f"{tag} save_full_checkpoint's files differ from the whole weights")
    return fails


def _weights_task() -> list[str]:
    warnings.simplefilter("ignore")
    configs = [dict(strategy="FULL_SHARD", uop=True, nested=True, idx=0),
               dict(strategy="SHARD_GRAD_OP", uop=False, idx=1)]
    return run_configs(configs, _weights)


def test_summon_iter_full_weights_full_checkpoints(pool4: Any) -> None:
    fails = [f for r in pool4.run(_weights_task) for f in r]
    assert not fails, "\n".join(fails)
