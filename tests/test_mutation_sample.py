"""Mutants the tests once killed stay killed (``tools/mutation.py check``).

A seeded sample of the mutants recorded in ``tools/mutation_killed.json``
(each a small bug in comm/, checkpoint/, ...; docs/testing.rst, "Mutation
testing") runs against its module's fast test selection, within a time box;
one that survives now means a test stopped catching what it caught.  The seed
is ``$FSDP_WRAP_MUTATION_SEED``, else the day's date, so successive CI runs
sample different mutants; the output names it.  ``-m slow`` (a few minutes).
"""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNT, BUDGET_S = 2, 80


@pytest.mark.slow
def test_killed_mutants_stay_killed() -> None:
    seed = os.environ.get("FSDP_WRAP_MUTATION_SEED") or time.strftime("%Y%m%d")
    proc = run_bounded([sys.executable, os.path.join(REPO, "tools", "mutation.py"), "check",
                        "--seed", seed, "--count", str(COUNT), "--budget", str(BUDGET_S)],
                       timeout=BUDGET_S + 600, cwd=REPO)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"seed {seed}:\n{out}"
    ran = re.search(r"(\d+) recorded-killed mutants re-run, 0 survived", proc.stdout)
    assert ran is not None and int(ran.group(1)) > 0, f"seed {seed}: ran none\n{out}"
