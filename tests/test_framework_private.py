"""torch's private FSDP1 names that RL trainers use, under ``install()``, on 2 ranks.

Each name is exercised the way the framework uses it (verl 0.9.1's
``offload_fsdp_model_to_cpu`` / ``load_fsdp_model_to_gpu``, its eval-mode
exit, its layered LoRA summon; PEFT's ``get_peft_model_state_dict`` inside
``summon_full_params``), once on torch's FSDP1 and once on fsdp_wrap, and the
results compared: values read, and the training that follows (losses
bit-exact: the same operations in the same order).

The mesh configurations compare torch's private unit state as torch's own
2-D tests read it (``_get_module_fsdp_state(model)._fsdp_extension``): the
state lookups and each unit's extension, for units given a mesh sliced from a
larger one (FSDP with tensor parallelism, or HSDP of a 3-D mesh), a root
mesh, or process groups only.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._sweep import Injection, injected, run_sweep

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


#: mesh configurations (see _unit_states): how each unit gets its groups.
MESHES = ("dp of dp x tp", "dp of dp x tp, TP model", "1-D mesh", "HSDP, 2-D root mesh",
          "HSDP, 2-D of a 3-D mesh", "default group", "HSDP, group pair")


def _configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=u) for s, u in itertools.product(("FULL_SHARD", "NO_SHARD"), (False, True))] \
        + [dict(mesh=m) for m in MESHES]


def _bad(what: str, failed: bool) -> list[str]:
    hit = injected(what)
    return [hit] if hit else [what] if failed else []


def _pair(cfg: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    """torch's FSDP1 and fsdp_wrap over the same model (built before install)."""
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    base = _model()
    theirs = tfsdp.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=TorchPolicy({Block}), device_id=CPU,
        sharding_strategy=tfsdp.ShardingStrategy[cfg["strategy"]], use_orig_params=cfg["uop"])
    ours = fsdp_wrap.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp_wrap.ShardingStrategy[cfg["strategy"]], use_orig_params=cfg["uop"])
    return theirs, ours


def _offload_and_load(model: nn.Module) -> list[str]:
    """verl's offload then load of an FSDP1 root, call for call (its asserts
    kept as checks); on this CPU-only machine both moves go to the CPU."""
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    out = []
    for _ in ("offload", "load"):
        _lazy_init(model, model)
        out.append(f"is_root {model._is_root}")
        for handle in model._all_handles:
            if handle._offload_params:
                continue
            flat = handle.flat_param
            out.append(f"ptr {flat.data.data_ptr() == flat._local_shard.data_ptr()} "
                       f"id {id(flat.data) != id(flat._local_shard)} "
                       f"size {flat.data.size() == flat._local_shard.size()}")
            handle.flat_param_to(CPU, non_blocking=True)
            flat._local_shard = flat.data
            out.append(f"after {id(flat._local_shard) != id(flat.data)}")
    return out


def _train(model: nn.Module, steps: range) -> list[tuple[float, float]]:
    """verl's update-actor shape: two micro-batches, the first under
    ``no_sync``, ``clip_grad_norm_``, Adam."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        micro = [torch.randn(2, 8, generator=g) for _ in range(2)]
        with model.no_sync():
            model(micro[0]).pow(2).mean().backward()
        loss = model(micro[1]).pow(2).mean()
        loss.backward()
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), norm.item()))
    return losses


def _train_pair(theirs: nn.Module, ours: nn.Module, steps: range) -> bool:
    """Whether both train alike.  torch's trains uninstalled: install() points
    the module-level name ``FullyShardedDataParallel`` that torch's own methods
    look their units up by at fsdp_wrap's class, and torch's ``no_sync()``
    then finds no unit and syncs every micro-batch (docs/testing.rst)."""
    import fsdp_wrap

    fsdp_wrap.uninstall()
    try:
        t = _train(theirs, steps)
    finally:
        fsdp_wrap.install(verbose=False)
    return t == _train(ours, steps)


def _summoned_state_dict(model: nn.Module, layered: bool) -> dict[str, torch.Tensor]:
    """The inner module's state dict inside a summon (PEFT's call), or verl's
    layered summon: each nested unit made a root for its own summon."""
    FSDP = type(model)
    if not layered:
        with FSDP.summon_full_params(model, writeback=False):
            return {k: v.clone() for k, v in model.module.state_dict().items()}
    out = {}
    for name, sub in model.named_modules():
        if name and isinstance(sub, FSDP):
            sub._is_root = True
            with FSDP.summon_full_params(sub, writeback=False):
                clean = name.replace("_fsdp_wrapped_module.", "")
                out.update({f"{clean}.{n.replace('_fsdp_wrapped_module.', '')}": p.detach().clone()
                            for n, p in sub.named_parameters()})
            sub._is_root = False
    return out


def _summoned_sharded(model: nn.Module) -> dict[str, tuple[list[int], torch.Tensor]]:
    """SHARDED_STATE_DICT inside a summon (verl's engine sets SHARDED, then its
    LoRA sync reads the adapters inside summon_full_params): each value's
    offsets and this rank's chunk."""
    from torch.distributed.fsdp import StateDictType  # (before install(): torch's)

    FSDP = type(model)
    out: dict[str, tuple[list[int], torch.Tensor]] = {}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        with FSDP.summon_full_params(model, writeback=False):
            for k, v in model.module.state_dict().items():
                if hasattr(v, "local_shards"):
                    shards = v.local_shards()
                    out[k] = (list(shards[0].metadata.shard_offsets) if shards else [],
                              shards[0].tensor.clone() if shards else torch.empty(0))
                else:
                    out[k] = ([], v.clone())
    return out


def _kept_past_summon(model: nn.Module) -> list[str]:
    """What a weight sync keeps from inside a summon (``p.detach().cpu()``, on
    CPU the parameter itself) is still the summoned value after the exit
    (fsdp_wrap only: torch's FSDP1 frees that storage, a segfault on CPU)."""
    FSDP = type(model)
    with FSDP.summon_full_params(model, writeback=False):
        kept = {n: p.detach().cpu() for n, p in model.named_parameters()}
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.ones(2, 8)).sum()  # (a gather into the unit's buffers)
    return [n for n in values if not torch.equal(kept[n], values[n])]


def _forward_with_stale_root_flag(model: nn.Module) -> str:
    """verl's layered summon leaving a nested unit marked as root: the next
    forward's error (torch: an AttributeError from its root pre-forward)."""
    with torch.no_grad():
        model(torch.ones(2, 8))  # (the tree set up: the nested unit is not a root)
    nested = [m for n, m in model.named_modules() if n and isinstance(m, type(model))][0]
    nested._is_root = True
    try:
        model(torch.ones(2, 8))
        return "no error"
    except AttributeError as e:
        return str(e)
    finally:
        nested._is_root = False


def _read(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    state = _lazy_init(model, model)
    out: dict[str, Any] = {"returns itself": state is model}
    out["handles"] = [(h._offload_params, h.flat_param._local_shard.clone()) for h in model._all_handles]
    dev = model._device_handle
    out["device handle"] = (dev.is_available(), callable(dev.synchronize), callable(dev.current_stream))
    return out


def _one(cfg: dict[str, Any]) -> list[str]:
    import fsdp_wrap

    if "mesh" in cfg:
        return _unit_states(cfg["mesh"])
    name = f"{cfg['strategy']} uop={cfg['uop']}"
    theirs, ours = _pair(cfg)
    spare = _pair(cfg)  # (for the stale root flag: a failed forward leaves torch's mid-way)
    sharded = cfg["strategy"] != "NO_SHARD"  # (NO_SHARD gives FULL, with a warning)
    fsdp_wrap.install(verbose=False)
    try:
        fails: list[str] = []
        a, b = _read(theirs), _read(ours)
        fails += _bad(f"{name}: lazy init {a['returns itself']} {b['returns itself']}",
                      not (a["returns itself"] and b["returns itself"]))
        fails += _bad(f"{name}: handles {len(a['handles'])} vs {len(b['handles'])}",
                      len(a["handles"]) != len(b["handles"]))
        for (ta, tl), (oa, ol) in zip(a["handles"], b["handles"]):
            fails += _bad(f"{name}: _offload_params {ta} {oa} / _local_shard {tl} {ol}",
                          ta != oa or not torch.equal(tl, ol))
        fails += _bad(f"{name}: _device_handle {a['device handle']} {b['device handle']}",
                      a["device handle"] != b["device handle"])
        moves = [_offload_and_load(m) for m in (theirs, ours)]
        fails += _bad(f"{name}: offload/load {moves}", moves[0] != moves[1])
        fails += _bad(f"{name}: train after offload", not _train_pair(theirs, ours, range(2)))
        for m in (theirs, ours):  # verl's eval-mode exit: the root's handle resharded
            with torch.no_grad():
                m(torch.ones(2, 8))
            if cfg["strategy"] != "NO_SHARD":  # (verl: only when sharded; torch asserts so)
                m._handle.reshard(True)
        fails += _bad(f"{name}: train after reshard", not _train_pair(theirs, ours, range(2, 4)))
        for layered in (False, True):
            sds = [_summoned_state_dict(m, layered) for m in (theirs, ours)]
            same = sorted(sds[0]) == sorted(sds[1]) and all(torch.equal(v, sds[1][k]) for k, v in sds[0].items())
            fails += _bad(f"{name} layered={layered}: summoned {sorted(sds[0])} vs {sorted(sds[1])}", not same)
        if sharded:
            # (uninstalled: install() points torch's class's module-level names at fsdp_wrap's)
            fsdp_wrap.uninstall()
            sh = [_summoned_sharded(m) for m in (theirs, ours)]
            fsdp_wrap.install(verbose=False)
            same = sorted(sh[0]) == sorted(sh[1]) and all(
                sh[0][k][0] == sh[1][k][0] and torch.equal(sh[0][k][1], sh[1][k][1]) for k in sh[0])
            fails += _bad(f"{name}: SHARDED inside summon {sorted(sh[0])} vs {sorted(sh[1])}", not same)
        fails += _bad(f"{name}: train after summons", not _train_pair(theirs, ours, range(4, 5)))
        fails += _bad(f"{name}: kept past summon {_kept_past_summon(ours)}", bool(_kept_past_summon(ours)))
        stale = [_forward_with_stale_root_flag(m) for m in spare]
        fails += _bad(f"{name}: stale root flag: {stale}",
                      "'_all_handles'" not in stale[0] or not stale[1].startswith("'Block' object has no "
                      "attribute '_all_handles' [rank") or "FSDP unit '0'" not in stale[1]
                      or "_is_root=True" not in stale[1])
        fails += _refused(ours, name)
        return fails
    finally:
        fsdp_wrap.uninstall()


def _refused(ours: nn.Module, name: str) -> list[str]:
    from torch.distributed.fsdp import _runtime_utils, _unshard_param_utils

    try:
        _runtime_utils._reshard(ours, ours._handle, True)
        msg = "no error"
    except NotImplementedError as e:
        msg = str(e)
    fails = _bad(f"{name}: refusal {msg}",
                 not ("_runtime_utils._reshard()" in msg and "_refused" in msg and "reshard(True)" in msg))
    try:  # (verl's recipe/vla: keyword arguments, the state from _get_module_fsdp_state)
        _unshard_param_utils._unshard_params_for_summon(
            module=ours, state=ours, writeback=False, rank0_only=False, offload_to_cpu=False,
            with_grads=False)
        msg = "no error"
    except NotImplementedError as e:
        msg = str(e)
    return fails + _bad(f"{name}: refusal {msg}", not ("_unshard_params_for_summon()" in msg
                                                        and "summon_full_params(module)" in msg))


def _mesh_kwargs(kind: str) -> dict[str, Any]:
    """The constructor arguments (groups, strategy) of mesh configuration ``kind``
    on 2 ranks; every rank builds the same meshes (their groups are collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind.startswith("dp of dp x tp"):
        mesh = init_device_mesh("cpu", (2, 1) if "TP" not in kind else (1, 2), mesh_dim_names=("dp", "tp"))
        return dict(device_mesh=mesh["dp"], tp_mesh=mesh["tp"] if "TP" in kind else None)
    if kind == "1-D mesh":
        return dict(device_mesh=init_device_mesh("cpu", (2,)))
    hybrid = dict(sharding_strategy="HYBRID_SHARD")
    if kind == "HSDP, 2-D root mesh":
        return dict(hybrid, device_mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("rep", "shard")))
    if kind == "HSDP, 2-D of a 3-D mesh":
        mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("rep", "shard", "tp"))
        return dict(hybrid, device_mesh=mesh["rep", "shard"])
    if kind == "HSDP, group pair":
        mesh = init_device_mesh("cpu", (1, 2))
        return dict(hybrid, process_group=(mesh.get_group(1), mesh.get_group(0)))
    return {}


def _tp(model: nn.Module, tp_mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {f"{i}.{n}": (ColwiseParallel() if n == "a" else RowwiseParallel()) for i in (0, 1) for n in "ab"}
    return parallelize_module(model, tp_mesh, plan)


def _state_reads(model: nn.Module, lookup: Any, composable: Any) -> list[Any]:
    """What torch's 2-D tests and DCP read of each unit's private state, in
    module order (types and identities: extension objects are per process)."""
    out: list[Any] = []
    for name, m in model.named_modules():
        if not isinstance(m, type(model)):
            out.append((name, "not a unit", lookup(m), composable(m)))
            continue
        state = lookup(m)
        ext = getattr(state, "_fsdp_extension", "missing")
        handle = getattr(ext, "device_handle", None)
        out.append((name, state is m, composable(m) is m, type(ext).__name__, ext is state._fsdp_extension,
                    type(handle).__name__, handle is not None and handle.is_available(),
                    getattr(ext, "compute_stream", None)))
    return out


def _unit_states(kind: str) -> list[str]:
    """``_get_module_fsdp_state`` / ``_get_module_state`` and ``_fsdp_extension``
    of torch's units and of fsdp_wrap's (built alike, read under install()),
    then nothing of it left once uninstalled."""
    import torch.distributed._composable_state as composable
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.fsdp._common_utils as common
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    import fsdp_wrap
    from fsdp_wrap.wrap import ModuleWrapPolicy

    kwargs = _mesh_kwargs(kind)
    tp_mesh = kwargs.pop("tp_mesh", None)
    strategy = kwargs.pop("sharding_strategy", "FULL_SHARD")
    models = [_model() if tp_mesh is None else _tp(_model(), tp_mesh) for _ in range(2)]
    theirs = tfsdp.FullyShardedDataParallel(
        models[0], auto_wrap_policy=TorchPolicy({Block}), device_id=CPU,
        sharding_strategy=tfsdp.ShardingStrategy[strategy], **kwargs)
    ours = fsdp_wrap.FullyShardedDataParallel(
        models[1], auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fsdp_wrap.ShardingStrategy[strategy], **kwargs)
    torch_lookups = (common._get_module_fsdp_state, composable._get_module_state)
    fsdp_wrap.install(verbose=False)
    try:
        from torch.distributed.fsdp._common_utils import _get_module_fsdp_state

        reads = [_state_reads(m, _get_module_fsdp_state, composable._get_module_state) for m in (theirs, ours)]
    finally:
        fsdp_wrap.uninstall()
    fails = _bad(f"{kind}: unit states\n  torch's   {reads[0]}\n  fsdp_wrap {reads[1]}", reads[0] != reads[1])
    left = [(common._get_module_fsdp_state, composable._get_module_state) != torch_lookups,
            common._get_module_fsdp_state(ours) is not None, hasattr(ours, "_fsdp_extension")]
    return fails + _bad(f"{kind}: left after uninstall() {left}", any(left))


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_sweep(configs, _one, inject=inject)


def test_private_surface_behaves_as_torch(pool2: Any) -> None:
    for fails in pool2.run(_sweep, _configs()):
        assert not fails, "\n".join(fails[:10])
