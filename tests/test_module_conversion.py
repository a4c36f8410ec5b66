"""Whole-module operations on a wrapped model, against torch's FSDP1 (2 ranks).

* ``FSDP(model).half()`` (or ``.double()``) before the first forward converts
  the flat parameters, so the model trains in that dtype, in both
  ``use_orig_params`` modes, as torch's does.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
import torch.distributed as dist

from tests._options_common import compare_step, loss_of, rank_tag, run_configs, train_step
from tests.models import build, make_input, new_model

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _convert_run(cfg: dict[str, Any]) -> list[str]:
    warnings.simplefilter("ignore")
    tag = f"{rank_tag()} {cfg}"
    torch.manual_seed(0)
    base = new_model("transformer")
    kw = dict(sharding_strategy=cfg["strategy"], use_orig_params=cfg["uop"])
    models = {impl: getattr(build("transformer", impl, base, **kw), cfg["to"])()
              for impl in ("torch", "ours")}
    dtype = {"half": torch.float16, "double": torch.float64}[cfg["to"]]
    opts = {i: torch.optim.SGD(m.parameters(), lr=0.1) for i, m in models.items()}
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    names = [n for n, _ in models["ours"].named_parameters()]
    fails = []
    dtypes = {i: sorted({str(p.dtype) for p in m.parameters()}) for i, m in models.items()}
    if dtypes["torch"] != dtypes["ours"] or dtypes["ours"] != [str(dtype)]:
        fails.append(f"{tag}: parameter dtypes torch {dtypes['torch']} vs ours {dtypes['ours']}")
    for step in range(2):
        x = make_input("transformer", gen)
        res = {}
        for i, m in models.items():
            out = m(x)
            if out.dtype != dtype:
                fails.append(f"{tag} step {step}: {i} computed in {out.dtype}")
            res[i] = train_step(m, opts[i], loss_of(out))
        fails += compare_step(f"{tag} step {step}", names, res["torch"], res["ours"])
    return fails


def _convert_configs() -> list[dict[str, Any]]:
    return [dict(strategy=s, uop=u, to=t)
            for s, u, t in itertools.product(STRATEGIES, (False, True), ("half", "double"))]


def _convert_sweep(configs: list[dict[str, Any]]) -> list[str]:
    return run_configs(configs, _convert_run)


def test_half_after_wrapping_trains_in_half_as_torch(pool2: Any) -> None:
    fails = [f for r in pool2.run(_convert_sweep, _convert_configs()) for f in r]
    assert not fails, "\n".join(fails[:20])
