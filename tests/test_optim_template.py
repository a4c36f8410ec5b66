"""A fresh optimizer given state shaped by a DCP checkpoint
(``fsdp_wrap.checkpoint.init_optim_state_from_checkpoint``), so that the FSDP1
recipe ``dcp.load({"optimizer": FSDP.optim_state_dict(model, optim)})`` reads
the whole optimizer state and resuming is exact.  The Accelerate and Trainer
runs of this path (through ``fsdp_wrap.install()``) are in test_frameworks.py.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_wrap
from fsdp_wrap.checkpoint import init_optim_state_from_checkpoint
from tests import _ckpt_common as C
from tests._sweep import Injection, run_sweep

FSDP = fsdp_wrap.FullyShardedDataParallel
SHARDED = fsdp_wrap.StateDictType.SHARDED_STATE_DICT

# Adam: lazily created moments; SGD with dampening: a zero momentum buffer is
# not the same as none (a template made by one zero step would be wrong);
# Rprop: per-element state that starts at the learning rate, not at zero.
OPTIMS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "sgd_dampened": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.5),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
}


def _configs(tmp: str) -> list[dict[str, Any]]:
    out = [dict(kind=kind, uop=uop, optim=o, steps=steps, strategy="FULL_SHARD")
           for kind in ("seq", "tied", "lora") for uop in (False, True)
           for o in OPTIMS for steps in (2, 0)
           if steps or (o == "adam" and kind == "seq")]
    # the other strategies (NO_SHARD's optimizer state is full tensors)
    out += [dict(kind="tied", uop=uop, optim="adam", steps=2, strategy=s)
            for s in ("SHARD_GRAD_OP", "NO_SHARD") for uop in (False, True)]
    for c in out:
        c["path"] = os.path.join(tmp, "-".join(str(c[k]) for k in
                                               ("kind", "uop", "optim", "steps", "strategy")))
    return out


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _one, inject=inject)


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    cfg = fsdp_wrap.FullOptimStateDictConfig(offload_to_cpu=False)
    with FSDP.state_dict_type(model, fsdp_wrap.StateDictType.FULL_STATE_DICT, None, cfg):
        return dict(FSDP.optim_state_dict(model, opt)["state"])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    return bool(a == b)


def _one(c: dict[str, Any], mesh: Any = None) -> list[str]:
    kind, uop, path = c["kind"], c["uop"], c["path"]
    tag = f"{kind} uop={uop} {c['strategy']} {c.get('form', '')} {c['optim']} after {c['steps']} steps"
    kw: dict[str, Any] = {"sharding_strategy": fsdp_wrap.ShardingStrategy[c["strategy"]]}
    if c.get("form") == "tuple":
        kw["process_group"] = (mesh.get_group("shard"), mesh.get_group("replicate"))
    elif c.get("form") == "mesh":
        kw["device_mesh"] = mesh
    src = C.wrap_ours(kind, uop, **kw)
    sopt = OPTIMS[c["optim"]](src.parameters())
    C.train(src, sopt, kind, range(c["steps"]))
    with FSDP.state_dict_type(src, SHARDED):
        dcp.save({"optimizer": FSDP.optim_state_dict(src, sopt)}, checkpoint_id=path)
    dst = C.wrap_ours(kind, uop, seed=3, **kw)
    with FSDP.state_dict_type(dst, fsdp_wrap.StateDictType.FULL_STATE_DICT):
        dst.load_state_dict(C.full_params(src), strict=False)
    dopt = OPTIMS[c["optim"]](dst.parameters())
    for g in dopt.param_groups:
        g["lr"] = 0.5  # (the checkpoint's groups must come back too)

    seeded = init_optim_state_from_checkpoint(dst, dopt, path)
    # (every parameter the checkpoint holds state for, including, with
    # use_orig_params, those without an element on this rank)
    problems = C.problem(f"{tag}: seeded {seeded} parameters", (seeded > 0) != (c["steps"] > 0))
    with FSDP.state_dict_type(dst, SHARDED):
        template = {"optimizer": FSDP.optim_state_dict(dst, dopt)}
        names = {f"optimizer.state.{fqn}.{n}"
                 for fqn, st in template["optimizer"]["state"].items() for n in st}
        stored = {k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
                  if k.startswith("optimizer.state.")}
        problems += C.problem(f"{tag}: template names {sorted(names ^ stored)} that the "
                              "checkpoint does not hold, or misses them", names != stored)
        dcp.load(template, checkpoint_id=path)
        dopt.load_state_dict(FSDP.optim_state_dict_to_load(dst, dopt, template["optimizer"]))
    # compared as FULL optimizer state dicts: every element of every parameter
    # (a flat shard's padding is not state: loading leaves it zero, as torch does)
    a, b = _full_state(src, sopt), _full_state(dst, dopt)
    differ = [(fqn, k) for fqn in set(a) | set(b)
              for k in set(a.get(fqn, {})) | set(b.get(fqn, {}))
              if not _same(a.get(fqn, {}).get(k), b.get(fqn, {}).get(k))]
    problems += C.problem(f"{tag}: optimizer state after loading differs at {differ[:4]}",
                          bool(differ))
    problems += C.problem(f"{tag}: lr not loaded", dopt.param_groups[0]["lr"] == 0.5)
    ref = C.train(src, sopt, kind, range(2, 5))
    got = C.train(dst, dopt, kind, range(2, 5))
    problems += C.problem(f"{tag}: resumed losses {got} vs {ref}", got != ref)
    dist.barrier()
    return problems


def test_template_from_checkpoint_resumes_exactly(pool2: Any, pool3: Any, tmp_path: Any) -> None:
    assert pool2.run(_sweep, _configs(str(tmp_path / "ws2"))) == [[], []]
    # 3 ranks: some parameters of "tied" and "lora" have fewer rows than ranks,
    # so a rank holds an empty chunk of their state (see state_dict/chunks.py)
    assert pool3.run(_sweep, _configs(str(tmp_path / "ws3"))) == [[], [], []]


def _hybrid_configs(tmp: str) -> list[dict[str, Any]]:
    return [dict(kind=kind, uop=uop, optim="adam", steps=2, strategy=s, form=form,
                 path=os.path.join(tmp, f"{kind}-{uop}-{s}-{form}"))
            for kind in ("seq", "tied") for uop in (False, True)
            for s in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") for form in ("tuple", "mesh")]


def _hybrid_sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    # (a collective: once, up front) 2 replicas of 2-rank shard groups
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return run_sweep(configs, lambda c: _one(c, mesh), inject=inject)


def test_template_from_checkpoint_under_hybrid_sharding(pool4: Any, tmp_path: Any) -> None:
    """4 ranks, 2 replicas of 2-rank shard groups, given as a process-group tuple
    (ShardedTensor state) or a 2-D device mesh (DTensor state)."""
    assert pool4.run(_hybrid_sweep, _hybrid_configs(str(tmp_path))) == [[]] * 4


def _without_template(tmp: str) -> list[str]:
    """The gap being closed: a fresh optimizer's own template reads no moments."""
    path = os.path.join(tmp, "plain")
    src = C.wrap_ours("seq", False)
    sopt = torch.optim.Adam(src.parameters(), lr=0.01)
    C.train(src, sopt, "seq", range(2))
    with FSDP.state_dict_type(src, SHARDED):
        dcp.save({"optimizer": FSDP.optim_state_dict(src, sopt)}, checkpoint_id=path)
    dst = C.wrap_ours("seq", False)
    dopt = torch.optim.Adam(dst.parameters(), lr=0.01)
    with FSDP.state_dict_type(dst, SHARDED):
        template = {"optimizer": FSDP.optim_state_dict(dst, dopt)}
    return C.problem(f"a fresh optimizer's template holds state {template['optimizer']['state']}",
                     bool(template["optimizer"]["state"]))


def test_fresh_optimizer_template_is_empty_without_it(pool2: Any, tmp_path: Any) -> None:
    assert pool2.run(_without_template, str(tmp_path)) == [[], []]
