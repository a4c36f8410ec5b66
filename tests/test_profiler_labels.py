"""Profiler labels: a trace of a step attributes every collective to its unit.

A step is profiled with ``torch.profiler`` on two gloo ranks; every c10d
operation the main thread issues (``c10d::send``, ``c10d::allgather_``, ...)
must lie inside an ``FSDP::all_gather`` / ``FSDP::post_backward_reduce``
label naming units of the model (the names come from the model's own
``named_modules``, not from the labels), every unit with parameters must be
named by a gather and a reduction, and every unit by its four hook labels.
Without a profiler no label is made (``record_function`` is never entered).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import fsdp_wrap as fw
import fsdp_wrap.comm.labels as L
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._sweep import Injection, injected, run_sweep


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), Block(8), Block(8), Block(8), nn.Linear(8, 3))


def _configs() -> list[dict[str, Any]]:
    return [
        dict(strategy="FULL_SHARD", batch=0, bucket=0),
        dict(strategy="FULL_SHARD", batch=1, bucket=1, use_orig_params=True),
        dict(strategy="SHARD_GRAD_OP", batch=0, bucket=1),
        dict(strategy="NO_SHARD", batch=0, bucket=0),
        dict(strategy="FULL_SHARD", batch=0, bucket=0, limit_all_gathers=False,
             forward_prefetch=True, backward_prefetch="BACKWARD_POST"),
    ]


COLLECTIVE_LABELS = (L.ALL_GATHER, L.POST_BACKWARD_REDUCE)
_UNITS = re.compile(r"^(FSDP::[a-z_]+)(?: \((.*)\)| for (.*))?$")


def _parse(name: str) -> tuple[str, list[str]] | None:
    m = _UNITS.match(name)
    if m is None:
        return None
    units = m.group(2) or m.group(3)
    return m.group(1), units.split(", ") if units else []


def _trace_problems(prof: Any, units: set[str], sharded: bool, where: str) -> list[str]:
    """What the trace of one step lacks (see the module docstring)."""
    fails: list[str] = []
    named: dict[str, set[str]] = {}
    issued = 0
    for e in prof.events():
        parsed = _parse(e.name)
        if parsed is not None:
            label, who = parsed
            named.setdefault(label, set()).update(who)
            stray = set(who) - units
            if stray:
                fails.append(f"{where}: {e.name!r} names no unit of the model: {sorted(stray)}")
        if not e.name.startswith("c10d::"):
            continue
        issued += 1
        parent = e.cpu_parent
        while parent is not None and (_parse(parent.name) or ("", []))[0] not in COLLECTIVE_LABELS:
            parent = parent.cpu_parent
        if parent is None:
            fails.append(f"{where}: {e.name} outside every FSDP collective label")
        elif not _parse(parent.name)[1]:  # type: ignore[index]
            fails.append(f"{where}: {e.name} under {parent.name!r}, which names no unit")
    if issued == 0:
        fails.append(f"{where}: the trace holds no c10d operation")
    with_params = units  # (every unit of the model holds parameters)
    expect = {L.POST_BACKWARD_REDUCE: with_params, L.PRE_FORWARD: units, L.POST_FORWARD: units,
              L.PRE_BACKWARD: units, L.POST_BACKWARD: with_params}
    if sharded:
        expect[L.ALL_GATHER] = with_params
    for label, want in expect.items():
        missing = want - named.get(label, set())
        if missing:
            fails.append(f"{where}: no {label} label for units {sorted(missing)}")
    return fails


def _run(cfg: dict[str, Any]) -> list[str]:
    cfg = dict(cfg)
    strategy, batch, bucket = cfg.pop("strategy"), cfg.pop("batch"), cfg.pop("bucket")
    if "backward_prefetch" in cfg:
        cfg["backward_prefetch"] = fw.BackwardPrefetch[cfg["backward_prefetch"]]
    model = fw.FullyShardedDataParallel(
        _net(), auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=fw.ShardingStrategy[strategy], all_gather_batch_mb=batch,
        bucket_cap_mb=bucket, **cfg)
    units = {clean_fqn(n) or L.ROOT_NAME for n, m in model.named_modules()
             if isinstance(m, fw.FullyShardedDataParallel)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())

    def step() -> None:
        model(torch.randn(4, 6, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    made = []
    real = L.record_function

    def counting(name: str) -> Any:
        made.append(name)
        return real(name)

    L.record_function = counting  # type: ignore[assignment]
    try:
        step()  # (lazy init, and the first iteration's order)
        step()
        quiet = list(made)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        L.record_function = real  # type: ignore[assignment]
    where = f"{strategy} batch={batch} bucket={bucket} {cfg}"
    fails = [f"{where}: labels made with no profiler running: {quiet[:3]}"] if quiet else []
    fails += _trace_problems(prof, units, strategy != "NO_SHARD", where)
    bad = injected(where)
    return fails + ([bad] if bad else [])


def _sweep(configs: list[dict[str, Any]], inject: Injection | None = None) -> list[str]:
    warnings.simplefilter("ignore")
    return run_sweep(configs, _run, inject=inject)


def test_a_trace_names_the_unit_of_every_collective(pool2: Any) -> None:
    assert pool2.run(_sweep, _configs()) == [[], []]
