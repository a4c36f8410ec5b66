"""``torch.distributed.optim._apply_optimizer_in_backward`` with FSDP (2 ranks, torch as oracle).

* ``use_orig_params=True``: each original parameter's optimizers step right
  after its unit's gradient is reduced, inside backward, and its gradient is
  then freed; parameters match torch's FSDP1 step by step (and a plain
  optimizer stepping after backward).
* ``use_orig_params=False``: refused at lazy init, before any collective (see
  ``tests/test_errors.py``, case ``optim_in_backward_flat``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import fsdp_cls, fsdp_kwargs, wrap_api


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(impl: str, strategy: str, in_backward: bool) -> list[dict[str, Any]]:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = fsdp_cls(impl)(
        _model(), auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}),
        **fsdp_kwargs(impl, use_orig_params=True, sharding_strategy=strategy),
    )
    opt_kwargs = {"lr": 0.05, "momentum": 0.9}
    if in_backward:
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), opt_kwargs)
        optim = None
    else:
        optim = torch.optim.SGD(model.parameters(), **opt_kwargs)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    steps = []
    for _ in range(3):
        model(torch.randn(4, 6, generator=gen)).pow(2).sum().backward()
        if optim is not None:
            optim.step()
            optim.zero_grad(set_to_none=True)
        steps.append({
            n: (p.detach().clone(), p.grad) for n, p in model.named_parameters()
        })
    return steps


def _compare(strategy: str) -> dict[str, Any]:
    return {
        "torch": _train("torch", strategy, True),
        "ours": _train("ours", strategy, True),
        "ours_plain": _train("ours", strategy, False),
    }


def test_optimizer_in_backward_matches_torch(pool2: Any) -> None:
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for res in pool2.run(_compare, strategy):
            for step, (ref, ours, plain) in enumerate(zip(res["torch"], res["ours"], res["ours_plain"])):
                assert list(ours) == list(ref), (strategy, list(ours), list(ref))
                for name in ref:
                    torch.testing.assert_close(ours[name][0], ref[name][0], rtol=0, atol=0,
                                               msg=f"{strategy} step {step} {name}")
                    torch.testing.assert_close(ours[name][0], plain[name][0],
                                               msg=f"{strategy} step {step} {name} (plain)")
                    # The gradient was consumed inside backward.
                    assert ours[name][1] is None and ref[name][1] is None, (strategy, name)
