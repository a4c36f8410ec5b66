"""Step-by-step parity with torch's FSDP1 on real gloo groups (2, 3 and 4 ranks).

For every configuration one model is deep-copied into torch's FSDP1 and into
fsdp_wrap.  Both train in lockstep on different data per rank; after every
step the loss, every gradient, every parameter the optimizer sees and the
clip norm are compared.  How closely depends on one question: does fsdp_wrap
add each gradient element across ranks in the same order as torch?

* **Same order: bit-exact.**  At 2 ranks a sum of two numbers does not
  depend on order; without buckets (``bucket_cap_mb=0``) fsdp_wrap issues
  torch's own per-unit collective.  Every other operation is torch's on the
  same tensors, so any difference at all is a bug.
* **Bucketed, 3 or more ranks: bounded against float64.**  A bucket puts a
  unit's gradient at another offset of the message, and gloo's ring starts
  each chunk's sum at a different rank, so elements are rounded differently
  (as with DDP's buckets).  Then torch's and fsdp_wrap's trajectories are
  both fp32 approximations of the same exact one; each is compared with a
  float64 replicated model (:class:`Exact64`) under the bound of
  :func:`fp32_bound`, and torch's FSDP1 must meet the same bound, which
  checks the bound itself.

Configurations cycle through three bucket caps (the default, where every unit
of these small models shares one bucket; 0, torch's order; and a cap that
splits them into a few buckets), so every world size runs each.  Each world
size runs its sweep in one ``pool.run``; the workers return a list of
failures (config + what differed), so one broken configuration reads clearly.

The grid is in ``tests/_parity_configs.py``, one configuration's run and its
comparisons in ``tests/_parity_run.py``.  Also here: FULL_STATE_DICT equality with torch's (keys, order, values), with
``rank0_only`` and ``offload_to_cpu`` (torch's offload crashes on a CPU
device, so ours is compared against torch's non-offloaded dict), and
``load_state_dict`` round trips in both directions followed by more training.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch

from tests._dist import get_pool
from tests._parity_configs import (
    CAPS,
    STRATEGIES,
    SWEEPS,
    WORLD_SIZES,
    _configs,
)
from tests._parity_run import (
    _full_sd,
    _group,
    _sweep,
)
from tests.models import build, new_model

# ---------------------------------------------------------------------------
# tests: one pool.run per world size and group of configs (so that ``-k``
# runs one group alone: the mutation tool's fast selections, tools/mutation.py)
# ---------------------------------------------------------------------------

_RESULTS: dict[tuple[int, str, str], list[tuple[list[tuple[str, str]], dict[str, float]]]] = {}
GROUPS = ["transformer", "frozen", "frozen_mixed", "deep", "accumulation"]


def _results(
    request: pytest.FixtureRequest, sweep: tuple[int, str], group: str
) -> list[tuple[list[tuple[str, str]], dict[str, float]]]:
    """Each rank's ``(failures, counters)`` for ``group``'s configs of ``sweep``."""
    ws, part = sweep
    key = (ws, part, group)
    if key not in _RESULTS:
        pool = request.getfixturevalue(f"pool{ws}")
        _RESULTS[key] = pool.run(_sweep, [c for c in _configs(ws, part) if _group(c) == group])
        for rank, (_, stats) in enumerate(_RESULTS[key]):
            print(
                f"[ws {ws} {part} {group} rank {rank}] "
                + ", ".join(
                    f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()
                )
            )
    return _RESULTS[key]


def _check(request: pytest.FixtureRequest, sweep: tuple[int, str], group: str) -> None:
    ws = sweep[0]
    configs = [c for c in _configs(*sweep) if _group(c) == group]
    results = _results(request, sweep, group)
    failures = [f for fails, _ in results for g, f in fails if g == group]
    assert not failures, (
        f"{len(failures)} parity failure(s) in {group} (world size {ws}):\n" + "\n".join(failures)
    )
    for rank, (_, stats) in enumerate(results):
        assert stats[f"configs:{group}"] == len(configs), (rank, stats)


@pytest.mark.parametrize("sweep", SWEEPS)
def test_sweep_is_not_vacuous(request: pytest.FixtureRequest, sweep: tuple[int, str]) -> None:
    configs = _configs(*sweep)
    assert {c["cap"] for c in configs} == set(CAPS), sweep
    assert {c["strategy"] for c in configs} == set(STRATEGIES), sweep
    assert {_group(c) for c in configs} == set(GROUPS), sweep
    per_group = [_results(request, sweep, g) for g in GROUPS]
    for rank in range(sweep[0]):
        stats: dict[str, float] = {}
        for results in per_group:
            for k, v in results[rank][1].items():
                stats[k] = stats.get(k, 0) + v
        assert stats["sd_checked"] == sum(
            c["sd"] for c in configs if c["model"] not in BROKEN_GROUPS
        ), (rank, stats)
        assert stats["clipped"] > 0 and stats["grads_seen"] > 0, (rank, stats)


def test_configs_cover_the_grid() -> None:
    configs = _configs()
    tr = {
        (c["strategy"], c["uop"], c["bp"], c["nosync"], c["clip"])
        for c in configs
        if c["model"] == "transformer" and not c["accum"]
    }
    assert len(tr) == 3 * 2 * 3 * 2 * 3
    assert {c["fp"] for c in configs} == {False, True}
    assert {c["opt"] for c in configs} == {"adam", "sgd"}
    assert {(c["model"], c["uop"]) for c in configs} >= {
        ("frozen", False),
        ("frozen", True),
        ("frozen_mixed", True),
        ("deep", False),
        ("deep", True),
    }
    assert any(c["accum"] and c["nosync"] for c in configs)
    # the default suite's slim grid and -m slow's rest: every configuration of
    # the full grid exactly once between them
    for ws in WORLD_SIZES:
        full = [c["idx"] for c in _configs(ws)]
        slim, rest = ([c["idx"] for c in _configs(ws, part)] for part in ("slim", "rest"))
        assert sorted(slim + rest) == full and slim and rest, ws


# Groups with a known library bug (xfail, strict) until the fix lands.
BROKEN_GROUPS: dict[str, str] = {}


@pytest.mark.parametrize("sweep", SWEEPS)
@pytest.mark.parametrize(
    "group",
    [
        pytest.param(g, marks=pytest.mark.xfail(strict=True, reason=BROKEN_GROUPS[g]))
        if g in BROKEN_GROUPS
        else g
        for g in GROUPS
    ],
)
def test_parity(request: pytest.FixtureRequest, sweep: tuple[int, str], group: str) -> None:
    _check(request, sweep, group)


def test_parity_world_size_1_accumulation() -> None:
    """NO_SHARD at world size 1 (what every strategy becomes there) with gradients
    accumulated across steps and under ``no_sync``: torch adds new gradients to
    the old ones before reducing; adding after the reduction rounds differently
    (seen at 3e-5), so the order must be torch's."""
    configs = [c for c in _configs(2) if c["accum"] or (c["model"] == "deep" and c["nosync"])]
    pool = get_pool(1)
    fails = [f for fails, _ in pool.run(_sweep, configs) for _, f in fails]
    assert not fails, f"{len(fails)} failure(s):\n" + "\n".join(fails)


def _rank0_only_no_shard() -> list[tuple[str, bool, list[str], list[str]]]:
    warnings.simplefilter("ignore")
    out = []
    for model, uop in itertools.product(["transformer", "deep"], [False, True]):
        torch.manual_seed(0)
        base = new_model(model)
        keys = []
        for impl in ("torch", "ours"):
            m = build(model, impl, base, sharding_strategy="NO_SHARD", use_orig_params=uop)
            keys.append(list(_full_sd(m, impl, rank0_only=True)))
        out.append((model, uop, keys[0], keys[1]))
    return out


def test_rank0_only_with_no_shard_returns_empty_off_rank0(pool2: Any) -> None:
    """Deliberate difference: torch's NO_SHARD ignores ``rank0_only`` and returns the
    full dict on every rank; fsdp_wrap honours it (rank 0 gets torch's keys, others {})."""
    for rank, res in enumerate(pool2.run(_rank0_only_no_shard)):
        for model, uop, torch_keys, our_keys in res:
            assert torch_keys, (rank, model, uop)
            expected = torch_keys if rank == 0 else []
            assert our_keys == expected, (rank, model, uop, torch_keys, our_keys)
