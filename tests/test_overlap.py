"""``limit_all_gathers=False``: asynchronous CPU all-gathers that overlap compute.

With the default ``limit_all_gathers=True`` fsdp_wrap gathers synchronously on
CPU (gloo stages an asynchronous gather through an extra full-unit buffer);
with ``False`` prefetched gathers run on gloo's thread while the current unit
computes.  The numerics must not change: parity with torch's FSDP1 every step.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import torch
import torch.nn as nn

import fsdp_wrap as fw
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._sweep import Injection, any_rank, injected, run_sweep


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d + 3)
        self.fc2 = nn.Linear(d + 3, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), Block(7), Block(7), Block(7), nn.Linear(7, 3))


def _configs() -> list[dict[str, Any]]:
    grid = itertools.product(
        ["FULL_SHARD", "SHARD_GRAD_OP"], [False, True], ["BACKWARD_PRE", "BACKWARD_POST"], [False, True]
    )
    return [dict(strategy=s, uop=u, bp=b, fwd_prefetch=f) for s, u, b, f in grid]


def _run(cfg: dict[str, Any]) -> list[str]:
    from torch.distributed.fsdp import BackwardPrefetch as TBP
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TSS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    strategy, uop, bp, fwd_prefetch = cfg["strategy"], cfg["uop"], cfg["bp"], cfg["fwd_prefetch"]
    rank = torch.distributed.get_rank()
    fails: list[str] = []
    torch.manual_seed(0)
    base = _net()
    kw: dict[str, Any] = dict(use_orig_params=uop, forward_prefetch=fwd_prefetch, limit_all_gathers=False)
    ref = TorchFSDP(
        copy.deepcopy(base), auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"),
        sharding_strategy=TSS[strategy], backward_prefetch=TBP[bp], **kw,
    )
    ours = fw.FullyShardedDataParallel(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fw.ShardingStrategy[strategy], backward_prefetch=fw.BackwardPrefetch[bp], **kw,
    )
    handles = [m._handle for m in fw.FullyShardedDataParallel.fsdp_modules(ours) if m._handle]
    if not all(h.async_gathers for h in handles):
        fails.append(f"{strategy} uop={uop}: gathers are not asynchronous")
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(3):
        x = torch.randn(4, 5, generator=gen)
        losses = []
        for model, opt in zip((ref, ours), opts):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        where = f"{strategy} uop={uop} {bp} fwd_prefetch={fwd_prefetch} step {step}"
        bad = injected(where)
        if bad is None and not (abs(losses[0] - losses[1]) < 1e-5 and all(
            torch.allclose(a, b, atol=1e-5) for a, b in zip(ref.parameters(), ours.parameters())
        )):
            bad = f"{where}: {losses}"
        if bad:
            fails.append(bad)
        # agreed: a rank that saw a difference must not skip the others' next step
        if any_rank(bool(bad)):
            break
    return fails


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_sweep(configs, _run, inject=inject)


def test_async_cpu_gathers_match_torch(pool2: Any) -> None:
    assert pool2.run(_sweep, _configs()) == [[], []]


def _default_is_synchronous() -> bool:
    warnings.simplefilter("ignore")
    model = fw.FullyShardedDataParallel(_net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    return not any(m._handle.async_gathers for m in fw.FullyShardedDataParallel.fsdp_modules(model) if m._handle)


def test_default_cpu_gathers_are_synchronous(pool2: Any) -> None:
    assert pool2.run(_default_is_synchronous) == [True, True]
