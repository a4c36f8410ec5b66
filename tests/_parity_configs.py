"""The configuration grid of the parity sweeps (``tests/test_parity.py``): the
strategies, prefetch modes, clips, bucket caps and world sizes, and how they
are cycled so that every world size runs each (``_configs``).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", None]
CLIPS = [None, 2.0, math.inf]
MAX_NORM = {2.0: 0.05, math.inf: 0.01}  # small, so that clipping really scales
# bucket_cap_mb: default (1 MiB: one bucket), 0 (per unit: torch's order),
# 0.0005 MiB = 512 bytes (these models' units are 100-300 floats: a few buckets)
CAPS: list[float | None] = [None, 0.0, 0.0005]
WORLD_SIZES = [2, 3, 4]
# The default suite runs slim grids (every cap, strategy and model, and the
# state-dict checks); ``-m slow`` (CI) runs the rest of each full grid, so that
# the two together run every configuration of the full grids once (they ran the
# slim grids' configurations twice).  Oversubscribed ranks make each 3- and
# 4-rank config cost 3-5x a 2-rank one on a 2-core machine.
SWEEPS = [
    pytest.param((2, "slim"), id="2"),
    pytest.param((2, "rest"), id="2-rest", marks=pytest.mark.slow),
    pytest.param((3, "slim"), id="3"),
    pytest.param((4, "slim"), id="4"),
    pytest.param((3, "rest"), id="3-rest", marks=pytest.mark.slow),
    pytest.param((4, "rest"), id="4-rest", marks=pytest.mark.slow),
]


# ---------------------------------------------------------------------------
# configurations (built in the parent, shipped to the workers)
# ---------------------------------------------------------------------------


def _cycle(k: int) -> int:
    """0, 1, 2 for the k-th item of a product whose last axis has 3 values,
    without locking step with that axis."""
    return (k + k // 3) % 3


def _configs(ws: int = 2, part: str = "full") -> list[dict[str, Any]]:
    """The sweep; on 3+ ranks the transformer grid cycles backward_prefetch and
    the frozen grid the clip mode instead of crossing them (3x fewer configs,
    every other axis still crossed);
    on 4 ranks every third configuration and the state-dict ones run (the grid
    is for 2 and 3; 4 ranks adds a longer ring).

    ``part="slim"`` (the default suite): the state-dict checks (at 3 and 4
    ranks the transformer's) and every 2nd (2 ranks), 5th (3 ranks) or 4th (4
    ranks) of the others (every cap, strategy and group still runs: the
    not-vacuous test checks); ``part="rest"`` (``-m slow``): the full grid's
    other configurations; ``"full"``: both."""
    if part not in ("full", "slim", "rest"):
        raise ValueError(f"part must be 'full', 'slim' or 'rest', got {part!r}")
    out: list[dict[str, Any]] = []

    def add(**cfg: Any) -> None:
        i = len(out)
        cfg.setdefault("fp", i % 2 == 1)  # forward_prefetch on every other config
        cfg.setdefault("opt", ("adam", "sgd")[(i // 2) % 2])
        cfg.setdefault("accum", False)
        cfg.setdefault("sd", False)
        cfg["cap"] = CAPS[_cycle(i // 2)]
        cfg["idx"] = i
        out.append(cfg)

    # Full grid on the transformer (tied weights, buffer, nested units).
    prefetch = PREFETCH if ws == 2 else [PREFETCH[0]]
    for k, (s, uop, bp, ns, clip) in enumerate(
        itertools.product(STRATEGIES, [False, True], prefetch, [False, True], CLIPS)
    ):
        add(
            model="transformer",
            strategy=s,
            uop=uop,
            bp=bp if ws == 2 else PREFETCH[_cycle(k)],
            nosync=ns,
            clip=clip,
        )
    # Frozen unit of its own (both uop modes) and mixed frozen/trainable (uop=True);
    # on 3+ ranks the clip mode cycles instead of being crossed.
    clips = CLIPS if ws == 2 else [None]
    for k, (s, uop, ns, clip) in enumerate(
        itertools.product(STRATEGIES, [False, True], [False, True], clips)
    ):
        clip = clip if ws == 2 else CLIPS[_cycle(k)]
        add(model="frozen", strategy=s, uop=uop, bp=PREFETCH[_cycle(k)], nosync=ns, clip=clip)
    for k, (s, clip) in enumerate(itertools.product(STRATEGIES, CLIPS)):
        add(
            model="frozen_mixed",
            strategy=s,
            uop=True,
            bp=PREFETCH[_cycle(k)],
            nosync=k % 2 == 0,
            clip=clip,
        )
    # Manual deep nesting.
    for k, (s, uop, bp) in enumerate(itertools.product(STRATEGIES, [False, True], PREFETCH)):
        add(model="deep", strategy=s, uop=uop, bp=bp, nosync=k % 2 == 1, clip=CLIPS[_cycle(k)])
    # Gradient accumulation across iterations without zero_grad.
    for k, (m, s, uop) in enumerate(
        itertools.product(["transformer", "deep"], STRATEGIES, [False, True])
    ):
        add(
            model=m,
            strategy=s,
            uop=uop,
            bp=PREFETCH[k % 3],
            nosync=k % 2 == 0,
            clip=None,
            accum=True,
        )
    # State-dict checks: one config per (model, strategy, uop).
    seen: set[tuple[str, str, bool]] = set()
    for cfg in out:
        key = (cfg["model"], cfg["strategy"], cfg["uop"])
        if key not in seen and not cfg["accum"]:
            seen.add(key)
            cfg["sd"] = True
            if ws >= 3:
                # the state-dict checks compare trained values bit for bit, so
                # they run where the reduction order is torch's
                cfg["cap"] = 0.0
    if ws >= 4:
        out = [c for c in out if c["idx"] % 3 == 0 or c["sd"]]
    if part != "full":
        kept = [c for c in out if c["sd"] and (ws == 2 or c["model"] == "transformer")]
        rest = [c for c in out if c not in kept]
        kept += rest[0::2] if ws == 2 else rest[0::5] if ws == 3 else rest[2::4]
        slim = {c["idx"] for c in kept}
        out = [c for c in out if (c["idx"] in slim) == (part == "slim")]
    return out


def _describe(cfg: dict[str, Any]) -> str:
    keys = ("model", "strategy", "uop", "bp", "fp", "nosync", "clip", "opt", "accum", "cap")
    return "{" + ", ".join(f"{k}={cfg[k]}" for k in keys) + "}"
