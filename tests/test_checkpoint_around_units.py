"""Activation checkpointing wrapped AROUND FSDP units (``checkpoint_wrapper(FSDP(l))``,
``checkpoint_wrapper(nn.Sequential(FSDP(l), ...))``), with and without an FSDP root,
gradients accumulating across iterations (no ``zero_grad``): parity with torch's FSDP1.

Without an FSDP root each unit is its own root, and the checkpoint's recomputation
runs the root's forward inside the backward."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from tests._sweep import Injection, injected, run_sweep

CPU = torch.device("cpu")


def _model(fsdp: Any, strategy: Any, shape: str, root: bool, impl: Any, uop: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    l1, l2, l3 = nn.Linear(6, 6, bias=False), nn.Linear(6, 6), nn.Linear(6, 3)
    kw = {"sharding_strategy": strategy, "use_orig_params": uop, "device_id": CPU}
    if shape == "around_unit":
        m: nn.Module = nn.Sequential(
            checkpoint_wrapper(fsdp(l1, **kw), checkpoint_impl=impl), nn.ReLU(),
            checkpoint_wrapper(fsdp(l2, **kw), checkpoint_impl=impl), l3,
        )
    else:
        m = nn.Sequential(
            checkpoint_wrapper(nn.Sequential(fsdp(l1, **kw), nn.ReLU(), fsdp(l2, **kw)),
                               checkpoint_impl=impl),
            l3,
        )
    return fsdp(m, **kw) if root else m


def _steps(model: nn.Module, fsdp: Any, uop: bool) -> list[list[torch.Tensor]]:
    """Per step: every full parameter and (use_orig_params, where torch's summon
    gives gradients) every full gradient; two accumulated backwards per step, no
    zero_grad ever, so each step's parameters also reflect the accumulation."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for _ in range(2):
            model(x).sum().backward()
        snap = []
        with fsdp.summon_full_params(model, with_grads=uop):
            for p in model.parameters():
                snap.append(p.detach().clone())
                if uop:
                    snap.append(p.grad.detach().clone() if p.grad is not None else torch.zeros(0))
        out.append(snap)
        opt.step()
    with fsdp.summon_full_params(model):
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _configs() -> list[dict[str, Any]]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return [dict(shape=shape, root=root, impl=impl.name, ss=ss, uop=uop)
            for shape, root, impl, ss, uop in itertools.product(
                ("around_unit", "around_seq"), (False, True), tuple(CheckpointImpl),
                ("FULL_SHARD", "SHARD_GRAD_OP"), (False, True))]


def _around_units_match_torch(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    return run_sweep(configs, _one, inject=inject)


def _one(c: dict[str, Any]) -> list[str]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchSS

    shape, root, impl, ss, uop = c["shape"], c["root"], CheckpointImpl[c["impl"]], c["ss"], c["uop"]
    tag = f"{shape} root={root} {impl.name} {ss} uop={uop}"
    ref = _steps(_model(TorchFSDP, getattr(TorchSS, ss), shape, root, impl, uop), TorchFSDP, uop)
    ours_fsdp = fsdp_wrap.FullyShardedDataParallel
    # (no try/except: an error on one rank only went on into the next
    # configuration's collectives; it ends the task instead)
    got = _steps(
        _model(ours_fsdp, getattr(fsdp_wrap.ShardingStrategy, ss), shape, root, impl, uop),
        ours_fsdp, uop,
    )
    for step, (a, b) in enumerate(zip(ref, got)):
        bad = injected(f"{tag}: step {step}")
        if bad is None and (len(a) != len(b) or any(
            x.shape != y.shape or not torch.allclose(x, y, rtol=1e-5, atol=1e-6)
            for x, y in zip(a, b)
        )):
            bad = f"{tag}: step {step} parameters or gradients differ"
        if bad:
            return [bad]  # (only comparisons are left: nothing the other ranks wait for)
    return []


def test_checkpoint_wrapper_around_units_accumulating(pool2: Any) -> None:
    assert pool2.run(_around_units_match_torch, _configs()) == [[], []]
