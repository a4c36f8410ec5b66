"""Train with torch's FSDP1, checkpoint, resume with fsdp_wrap (and the reverse):
the resumed losses equal those of the torch job continuing without a break.

Checkpoints are real files: DCP SHARDED (model + optimizer) and FULL
(``torch.save`` of rank 0's full state dicts).  Resharding 2 -> 3 and 4 -> 2 is
checked against torch's FSDP1 resuming from the same checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_wrap
from tests import _ckpt_common as C
from tests._sweep import Injection, run_sweep

LR = 0.01


def _mod(model: torch.nn.Module) -> Any:
    if isinstance(model, fsdp_wrap.FullyShardedDataParallel):
        return fsdp_wrap
    import torch.distributed.fsdp as tfsdp

    return tfsdp


def _build(impl: str, kind: str, uop: bool, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    model = (C.wrap_ours if impl == "ours" else C.wrap_torch)(kind, uop, seed=seed)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def _ctx(model: torch.nn.Module, fmt: str) -> Any:
    mod = _mod(model)
    if fmt == "dcp":
        return mod.FullyShardedDataParallel.state_dict_type(model, mod.StateDictType.SHARDED_STATE_DICT)
    return mod.FullyShardedDataParallel.state_dict_type(
        model, mod.StateDictType.FULL_STATE_DICT,
        mod.FullStateDictConfig(rank0_only=True),
        mod.FullOptimStateDictConfig(rank0_only=True, offload_to_cpu=False),
    )


def _save(model: torch.nn.Module, opt: Any, fmt: str, path: str) -> None:
    F = _mod(model).FullyShardedDataParallel
    with _ctx(model, fmt):
        state = {"model": model.state_dict(), "optim": F.optim_state_dict(model, opt)}
    if fmt == "dcp":
        dcp.save(state, checkpoint_id=path)
    elif dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save(state, os.path.join(path, "full.pt"))
    dist.barrier()


def _resume(impl: str, kind: str, uop: bool, fmt: str, path: str) -> tuple[torch.nn.Module, Any]:
    model, opt = _build(impl, kind, uop, seed=11)
    C.train(model, opt, kind, range(100, 101))  # optimizer state exists: a DCP template
    F = _mod(model).FullyShardedDataParallel
    with _ctx(model, fmt):
        if fmt == "dcp":
            state = {"model": model.state_dict(), "optim": F.optim_state_dict(model, opt)}
            # (torch's FSDP1, lora at 3 ranks: a rank holding no row of a
            # parameter lists no shard for its state, DCP drops it from that
            # rank's template, then misreads the checkpoint as a pre-2.4 one
            # and fails.  fsdp_wrap gives such a rank an empty shard, so its
            # template is complete: strict.)
            planner = dcp.DefaultLoadPlanner(allow_partial_load=kind == "lora" and impl == "torch")
            dcp.load(state, checkpoint_id=path, planner=planner)
        else:
            state = torch.load(os.path.join(path, "full.pt"), weights_only=False) if dist.get_rank() == 0 else {"model": {}, "optim": None}
        if fmt == "dcp":
            model.load_state_dict(state["model"])
        else:  # rank0_only: every rank loads rank 0's full model through a broadcast dict
            objs = [state["model"] if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(objs, src=0)
            model.load_state_dict(objs[0])
        opt.load_state_dict(F.optim_state_dict_to_load(model, opt, state["optim"]))
    return model, opt


def _interop_configs(root: str) -> list[dict[str, Any]]:
    return [dict(root=root, kind=kind, uop=uop, fmt=fmt, saver=saver, loader=loader)
            for kind in ("seq", "tied") for uop in (False, True) for fmt in ("dcp", "full")
            for saver, loader in (("torch", "ours"), ("ours", "torch"))] + _lora_configs(root)


def _lora_configs(root: str) -> list[dict[str, Any]]:
    """LoRA-shaped units: torch's FSDP1 runs them with use_orig_params=True only
    (one flat parameter per unit); fsdp_wrap splits them, with either setting."""
    return [dict(root=root, kind="lora", uop=uop, fmt=fmt, saver=saver, loader=loader)
            for fmt in ("dcp", "full")
            for saver, loader, uop in (("torch", "ours", True), ("ours", "torch", False),
                                       ("ours", "torch", True))]


def _interop(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _interop_one, inject=inject)


def _interop_one(c: dict[str, Any], k: int = 2, more: int = 3) -> list[str]:
    kind, uop, fmt, saver, loader = c["kind"], c["uop"], c["fmt"], c["saver"], c["loader"]
    path = os.path.join(c["root"], f"{kind}-{uop}-{fmt}-{saver}")
    src, sopt = _build(saver, kind, uop)
    C.train(src, sopt, kind, range(k))
    _save(src, sopt, fmt, path)
    # the original job continues without a break (the reference)
    want = C.train(src, sopt, kind, range(k, k + more))
    # Resume with the other use_orig_params mode.  (torch's FULL optimizer
    # state from use_orig_params=False shares one ``step`` tensor between the
    # parameters of a flat parameter; torch.save keeps the sharing, and
    # torch's own use_orig_params=True load then steps it once per
    # parameter: torch -> torch diverges there, fsdp_wrap copies.)
    # (lora: torch resumes with use_orig_params=True, the only way it runs it;
    # fsdp_wrap resumes torch's checkpoint with use_orig_params=False)
    resume_uop = True if kind == "lora" and loader == "torch" else not uop
    dst, dopt = _resume(loader, kind, resume_uop, fmt, path)
    got = C.train(dst, dopt, kind, range(k, k + more))
    return C.problem(f"{kind} uop={uop} {fmt} {saver}->{loader}: {got} vs {want}",
                     max(abs(a - b) for a, b in zip(got, want)) > 1e-5)


def test_torch_fsdp1_and_fsdp_wrap_resume_each_other(pool2: Any, tmp_path: Any) -> None:
    assert pool2.run(_interop, _interop_configs(str(tmp_path))) == [[], []]


def _save_job(path: str, uop: bool, kind: str = "seq") -> None:
    model, opt = _build("ours", kind, uop)
    C.train(model, opt, kind, range(2))
    _save(model, opt, "dcp", path)


def _resume_job(path: str, uop: bool, kind: str = "seq") -> list[list[float]]:
    out = []
    for impl in ("ours", "torch"):
        model, opt = _resume(impl, kind, uop or kind == "lora", "dcp", path)
        out.append(C.train(model, opt, kind, range(2, 5)))
    return out


def test_reshard_2_to_3_and_4_to_2(pool2: Any, pool3: Any, pool4: Any, tmp_path: Any) -> None:
    for uop in (False, True):
        a = str(tmp_path / f"ws2-{uop}")
        pool2.run(_save_job, a, uop)
        for ours, ref in pool3.run(_resume_job, a, not uop):
            assert max(abs(x - y) for x, y in zip(ours, ref)) <= 1e-5, (ours, ref)
        b = str(tmp_path / f"ws4-{uop}")
        pool4.run(_save_job, b, uop)
        for ours, ref in pool2.run(_resume_job, b, uop):
            assert max(abs(x - y) for x, y in zip(ours, ref)) <= 1e-5, (ours, ref)


def test_split_units_reshard_2_to_3(pool2: Any, pool3: Any, tmp_path: Any) -> None:
    """fsdp_wrap's split LoRA units saved (DCP SHARDED, model and optimizer) at 2
    ranks resume at 3 in fsdp_wrap and in torch's FSDP1 (use_orig_params=True,
    one flat parameter per unit) with the same losses."""
    for uop in (False, True):
        a = str(tmp_path / f"lora-ws2-{uop}")
        pool2.run(_save_job, a, uop, "lora")
        for ours, ref in pool3.run(_resume_job, a, not uop, "lora"):
            assert max(abs(x - y) for x, y in zip(ours, ref)) <= 1e-5, (ours, ref)


def _save_trained(path: str, kind: str, uop: bool) -> list[float]:
    model, opt = _build("ours", kind, uop)
    C.train(model, opt, kind, range(2))
    _save(model, opt, "dcp", path)
    return C.train(model, opt, kind, range(2, 4))


def _resume_both(path: str, kind: str, uop: bool) -> dict[str, list[float]]:
    out = {}
    for impl in ("torch", "ours"):
        model, opt = _resume(impl, kind, uop, "dcp", path)
        out[impl] = C.train(model, opt, kind, range(2, 4))
    return out


def test_empty_chunks_saved_at_3_ranks_read_at_2(pool2: Any, pool3: Any, tmp_path: Any) -> None:
    """fsdp_wrap's sharded optimizer state at 3 ranks lists an empty shard for a
    rank past a small parameter's last row (torch's FSDP1 lists none); torch's
    FSDP1 and fsdp_wrap read that checkpoint at 2 ranks and resume alike."""
    for uop in (False, True):
        path = str(tmp_path / f"tied-ws3-{uop}")
        want = pool3.run(_save_trained, path, "tied", uop)[0]
        for got in pool2.run(_resume_both, path, "tied", not uop):
            for impl, losses in got.items():
                # (2 ranks after 3: the cross-rank sums regroup, hence the tolerance
                # of the other resume tests here rather than equality)
                assert max(abs(a - b) for a, b in zip(losses, got["torch"])) <= 1e-5, (uop, got)
                assert len(losses) == len(want), (impl, losses, want)


# ------------------------------------------------- 2 -> 3 ranks and back


def _resume_train_save(path_in: str, fmt_in: str, path_out: str, fmt_out: str, impl: str,
                       uop: bool, steps: tuple[int, int]) -> list[float]:
    """Resume ``impl`` from ``path_in`` at this pool's world size, train, save to ``path_out``."""
    model, opt = _resume(impl, "seq", uop, fmt_in, path_in)
    losses = C.train(model, opt, "seq", range(*steps))
    if path_out:
        _save(model, opt, fmt_out, path_out)
    return losses


def test_resume_at_3_ranks_and_back_full_sharded_and_offline(
    pool2: Any, pool3: Any, tmp_path: Any
) -> None:
    """Optimizer state across world sizes: saved at 2 ranks, resumed and trained at 3,
    saved again, resumed at 2; FULL (rank 0's torch.save), SHARDED (DCP) and the
    3-rank DCP checkpoint consolidated by the offline tool into one FULL file.  At
    each stage torch's FSDP1 follows the same path from the same files: the losses
    must agree (the tolerance of the other resume tests here)."""
    from fsdp_wrap.checkpoint import offline

    for fmt in ("full", "dcp"):
        start = str(tmp_path / f"{fmt}-ws2")
        pool2.run(_save_job_fmt, start, fmt)
        at3: dict[str, list[float]] = {}
        for impl in ("ours", "torch"):
            at3[impl] = pool3.run(_resume_train_save, start, fmt, str(tmp_path / f"{fmt}-{impl}-ws3"),
                                  fmt, impl, True, (2, 4))[0]
        assert max(abs(a - b) for a, b in zip(at3["ours"], at3["torch"])) <= 1e-5, (fmt, at3)
        back: dict[str, list[float]] = {}
        for impl in ("ours", "torch"):
            back[impl] = pool2.run(_resume_train_save, str(tmp_path / f"{fmt}-{impl}-ws3"), fmt, "",
                                   fmt, impl, True, (4, 6))[0]
        assert max(abs(a - b) for a, b in zip(back["ours"], back["torch"])) <= 1e-5, (fmt, back)
        if fmt == "dcp":
            # the offline tool: the 3-rank DCP checkpoint as one FULL file, resumed at 2 ranks
            full_dir = tmp_path / "dcp-ours-ws3-consolidated"
            full_dir.mkdir()
            offline.consolidate(str(tmp_path / "dcp-ours-ws3"), str(full_dir / "full.pt"))
            tool = pool2.run(_resume_train_save, str(full_dir), "full", "", "full", "ours", True,
                             (4, 6))[0]
            assert max(abs(a - b) for a, b in zip(tool, back["torch"])) <= 1e-5, (tool, back)


def _save_job_fmt(path: str, fmt: str) -> None:
    model, opt = _build("ours", "seq", True)
    C.train(model, opt, "seq", range(2))
    _save(model, opt, fmt, path)
