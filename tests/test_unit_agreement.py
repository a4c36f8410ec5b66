"""The lazy-init check that every rank built the same FSDP units compares what the
collectives depend on (flat shapes, dtypes, strategy), not names: ranks that ignore
different modules with identical managed shapes train as in torch's FSDP1, while
a real mismatch still fails on every rank before any collective."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap

CPU = torch.device("cpu")


def _model(out2: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, out2))


def _train(fsdp: Any, model: nn.Module) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step + 7 * dist.get_rank()))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    with fsdp.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _different_ignored_modules() -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    problems = []
    rank = dist.get_rank()
    for how in ("ignored_modules", "ignored_states"):
        got = []
        for fsdp in (TorchFSDP, fsdp_wrap.FullyShardedDataParallel):
            m = _model()
            ignored = [m[rank]] if how == "ignored_modules" else list(m[rank].parameters())
            # No try/except around training (collectives): an error raised on one
            # rank only would leave the other waiting; it ends the task, and the
            # pool reports it from every rank that raised.
            got.append(_train(fsdp, fsdp(m, device_id=CPU, **{how: ignored})))
        if not all(torch.allclose(a, b) for a, b in zip(*got)):
            problems.append(f"{how}: parameters differ from torch's")
    return problems


def _real_mismatch() -> list[str]:
    """A unit whose flat shape differs between ranks still raises, naming both."""
    m = _model(out2=3 if dist.get_rank() == 0 else 5)
    model = fsdp_wrap.FullyShardedDataParallel(
        m, device_id=CPU, auto_wrap_policy=fsdp_wrap.wrap.ModuleWrapPolicy({nn.Linear})
    )
    try:
        model(torch.randn(2, 4))
    except RuntimeError as e:
        msg = str(e)
        want = ["differ", "rank 0", "rank 1", "'2'", "(3, 4)", "(5, 4)"]
        return [f"message misses {w!r}: {msg}" for w in want if w not in msg]
    return ["no error for units of different shapes"]


def test_ranks_ignoring_different_modules_with_equal_shapes(pool2: Any) -> None:
    assert pool2.run(_different_ignored_modules) == [[], []]
    # ... while units of different shapes are still refused
    assert pool2.run(_real_mismatch) == [[], []]
