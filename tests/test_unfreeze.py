"""Freezing and unfreezing whole flat parameters between iterations, torch's FSDP1 as the oracle.

Progressive unfreezing with ``use_orig_params=False``: the user-visible
parameters are the flat parameters, and ``requires_grad_`` on them between
iterations decides which units train.  torch registers a flat parameter's
gradient hook in each pre-forward, so a unit frozen at construction and
unfrozen later has its gradient reduced from then on.  fsdp_wrap once hooked
only what trained at construction: the unfrozen unit's gradient stayed
unreduced (each rank kept its own) and, with another unit reduced beside it,
the ranks' collectives no longer paired.  Compared here: every flat
parameter's sharded gradient after each iteration, bit for bit with torch
(2 ranks, the same reduction order), for FULL_SHARD, SHARD_GRAD_OP and
NO_SHARD, with the default bucket cap and with buckets off.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from tests.models import fsdp_cls, fsdp_kwargs, wrap_api


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 7)
        self.c = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _run(impl: str, strategy: str) -> list[list[torch.Tensor | None]]:
    torch.manual_seed(0)
    base = Three()
    for p in base.b.parameters():
        p.requires_grad_(False)  # frozen at construction
    model = fsdp_cls(impl)(
        base, auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}),
        **fsdp_kwargs(impl, sharding_strategy=strategy),
    )
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    out = []
    # iteration 1: b frozen; 2: b unfrozen (flat parameter requires_grad_); 3: a frozen
    for step in range(3):
        if step == 1:
            for p in model.b.parameters():
                p.requires_grad_(True)
        if step == 2:
            for p in model.a.parameters():
                p.requires_grad_(False)
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, 5, generator=gen)).square().sum().backward()
        out.append(_grads(model))
    return out


def _sweep() -> list[tuple[str, str, str]]:
    fails = []
    for cap in ("0", None):
        prev = os.environ.pop("FSDP_WRAP_BUCKET_CAP_MB", None)
        if cap is not None:
            os.environ["FSDP_WRAP_BUCKET_CAP_MB"] = cap
        try:
            for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
                theirs, ours = _run("torch", strategy), _run("ours", strategy)
                for step, (t, o) in enumerate(zip(theirs, ours)):
                    same = len(t) == len(o) and all(
                        (x is None and y is None)
                        or (x is not None and y is not None and torch.equal(x, y))
                        for x, y in zip(t, o))
                    if not same:
                        fails.append((f"cap={cap}", strategy, f"iteration {step + 1}: "
                                      f"torch {t} ours {o}"))
        finally:
            os.environ.pop("FSDP_WRAP_BUCKET_CAP_MB", None)
            if prev is not None:
                os.environ["FSDP_WRAP_BUCKET_CAP_MB"] = prev
    return fails


def test_unfreeze_between_iterations_matches_torch(pool2: Any) -> None:
    for rank, fails in enumerate(pool2.run(_sweep)):
        assert not fails, f"rank {rank}: {fails}"
