"""Tutorial 2 (sharded DCP checkpoint, restart, exact resumption) as a user runs it.

The script's own check is the oracle: job 2's losses must equal job 1's
uninterrupted ones.  ``--skip-optimizer-state`` proves that check can fail.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tests.test_tutorials as tutorials
from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tutorials", "02_checkpoint_resume.py")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return run_bounded(
        [sys.executable, SCRIPT, *args], cwd=REPO, env=env, timeout=120,
    )


def _losses(stdout: str, job: int) -> dict[int, float]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith(f"job {job} step "):
            step, rest = line[len(f"job {job} step ") :].split(":", 1)
            out[int(step)] = float(rest.split()[1])
    return out


def test_resume_continues_exactly() -> None:
    proc = tutorials._run(SCRIPT)  # the default run, shared with tests/test_tutorials.py
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert "job 1: saved a sharded checkpoint at step 4" in lines
    assert "job 2: resumed (model and optimizer) at step 4" in lines
    assert lines[-1] == "resumed losses match the uninterrupted run exactly: OK"
    one, two = _losses(proc.stdout, 1), _losses(proc.stdout, 2)
    assert sorted(one) == list(range(8)) and sorted(two) == [4, 5, 6, 7]
    assert all(two[s] == one[s] for s in two), (one, two)
    assert one[7] < one[0] / 5, one  # it does learn


@pytest.mark.slow  # a second 2-rank run of the script (15 s on 2 cores); CI runs it
def test_resume_without_optimizer_state_is_reported() -> None:
    proc = _run("--skip-optimizer-state")
    assert proc.returncode == 1, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.splitlines()[-1] == "resumed losses differ from the uninterrupted run: FAILED"
    one, two = _losses(proc.stdout, 1), _losses(proc.stdout, 2)
    assert two[4] == one[4]  # the model itself was restored exactly
    assert two[5] != one[5]  # Adam's moments were not
