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

With ``use_orig_params=True`` a unit mixing frozen and trainable parameters
splits them into two flat parameters; unfreezing one of its frozen originals
afterwards would train in torch (one flat parameter) and silently not here,
so it is refused with a message naming the parameter and the fix.
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


def _unfreeze_orig_param_in_a_split_unit() -> list[str]:
    """use_orig_params=True: a parameter frozen at wrapping sits in the unit's
    frozen flat parameter; unfreezing it afterwards is refused on every rank at
    the next training forward (torch's one flat parameter would train it; here
    it would silently get no gradient).  Evaluation forwards stay allowed."""
    import fsdp_wrap

    torch.manual_seed(0)
    m = Three()
    m.b.weight.requires_grad_(False)  # the unit mixes frozen and trainable: it splits
    model = fsdp_wrap.FullyShardedDataParallel(m, use_orig_params=True)
    x = torch.randn(4, 5)
    model(x).sum().backward()
    m.b.weight.requires_grad_(True)
    with torch.no_grad():
        model(x)  # no gradient wanted: nothing to refuse
    try:
        model(x)
    except RuntimeError as e:
        return [str(e)]
    return []


def test_unfreezing_a_split_units_frozen_parameter_is_refused(pool2: Any) -> None:
    for rank, msgs in enumerate(pool2.run(_unfreeze_orig_param_in_a_split_unit)):
        assert len(msgs) == 1, (rank, msgs)
        msg = msgs[0]
        assert msg.startswith(f"(rank {rank}, FSDP unit '<root>') 'b.weight' requires grad now "
                              "but was frozen when its unit was wrapped"), msg
        assert "silently not train" in msg and "before wrapping" in msg, msg
        assert "_fsdp_wrapped_module" not in msg, msg
