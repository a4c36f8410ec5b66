"""A training step leaves no cyclic garbage beyond what the plain module's leaves.

Objects in a reference cycle are freed only by Python's cyclic collector, not
when their last user lets go: a per-unit cycle made every step (a nested
function that calls itself was one, in the walk over a unit's inputs and
outputs) keeps the collector busy on the training thread, and anything the
cycle refers to lives until a collection happens to run.

Each configuration runs the same steps on a plain replica and on fsdp_wrap
(2 ranks, nested units, a model whose units return dicts and tuples; every
strategy, ``use_orig_params`` and bf16, and with frozen parameters, CPU offload
or ``forward_prefetch``) with the collector off; ``gc.collect()`` then counts what was unreachable.  fsdp_wrap's
count must not exceed the plain module's.
"""

from __future__ import annotations

import copy
import gc
import itertools
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests._options_common import rank_tag, run_configs
from tests.models import fsdp_api, fsdp_kwargs, wrap_api

STEPS = 3


class _Pair(nn.Module):
    """Returns a dict holding a tuple: the walk over outputs recurses."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"out": (torch.tanh(self.a(x)), self.b(x)), "n": 2}


class _Model(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pairs = nn.ModuleList([_Pair(d) for _ in range(3)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.pairs:
            y = p(x)["out"]
            x = y[0] + y[1]
        return self.head(x)


def _garbage_of(step: Any) -> tuple[int, Counter[str]]:
    """What ``STEPS`` calls of ``step`` leave for the cyclic collector."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for i in range(STEPS):
            step(i)
        found = gc.collect()
        kinds = Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    return found, kinds


def _one(cfg: dict[str, Any]) -> list[str]:
    torch.manual_seed(0)
    base = _Model()
    if cfg.get("frozen"):  # (a unit's frozen flat parameter: freed by a hook on its inputs)
        for pair in base.pairs:
            pair.a.requires_grad_(False)
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    xs = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    kw: dict[str, Any] = {"sharding_strategy": cfg["strategy"], "use_orig_params": cfg["orig"],
                          "auto_wrap_policy": wrap_api("ours").ModuleWrapPolicy({_Pair})}
    for option in ("cpu_offload", "forward_prefetch"):
        if cfg.get(option):
            kw[option] = fsdp_api("ours").CPUOffload(True) if option == "cpu_offload" else True
    if cfg["bf16"]:
        kw["mixed_precision"] = fsdp_api("ours").MixedPrecision(param_dtype=torch.bfloat16)
    models = {"plain": copy.deepcopy(base),
              "ours": fsdp_api("ours").FullyShardedDataParallel(copy.deepcopy(base),
                                                                **fsdp_kwargs("ours", **kw))}
    counts = {}
    for name, model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(i: int, model: nn.Module = model, opt: Any = opt) -> None:
            opt.zero_grad(set_to_none=True)
            model(xs[i % 2]).float().pow(2).mean().backward()
            opt.step()

        step(0)  # (warm-up: lazily built state is not per-step garbage)
        step(1)
        counts[name] = _garbage_of(step)
    (plain, plain_kinds), (ours, ours_kinds) = counts["plain"], counts["ours"]
    if ours > plain:
        return [f"{rank_tag()} {cfg}: {ours} objects left for the cyclic collector in "
                f"{STEPS} steps, the plain module {plain}; kinds "
                f"{dict((ours_kinds - plain_kinds).most_common(6))}"]
    return []


def _sweep(configs: list[dict[str, Any]]) -> list[str]:
    # Everything alive now (the worker's imports, its process group) is moved
    # out of the collector's sight: each count's gc.collect() then walks what
    # the configurations made, not the whole heap (35 s -> 5 s for the sweep).
    gc.collect()
    gc.freeze()
    try:
        return run_configs(configs, _one)
    finally:
        gc.unfreeze()


def test_a_step_leaves_no_cyclic_garbage(pool2: Any) -> None:
    configs = [{"strategy": s, "orig": o, "bf16": m} for s, o, m in itertools.product(
        ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), (False, True), (False, True))]
    configs += [{"strategy": "FULL_SHARD", "orig": o, "bf16": False, extra: True}
                for o in (False, True) for extra in ("frozen", "cpu_offload", "forward_prefetch")]
    fails = [f for r in pool2.run(_sweep, configs) for f in r]
    assert not fails, "\n".join(fails)
