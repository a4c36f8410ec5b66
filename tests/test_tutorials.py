"""Every tutorial runs as a user would run it: a subprocess that spawns its own ranks."""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys

import pytest

from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(REPO, "tutorials", "[0-9][0-9]_*.py")))
FIRST = os.path.join(REPO, "tutorials", "01_first_training.py")
# Tutorials whose library paths other default-suite tests already cover run
# under ``-m slow`` (CI runs them): each costs 15-35 s of rank start-up on 2 cores.
SLOW = {"04_pretrained_weight_sync.py", "05_lora_finetune.py"}


def _param(path: str) -> object:
    name = os.path.basename(path)
    return pytest.param(path, id=name, marks=[pytest.mark.slow] if name in SLOW else [])


@functools.cache
def _run(path: str) -> subprocess.CompletedProcess[str]:
    """Run one tutorial once per session (tests share the result)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # run as a user would, not as torchrun
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return run_bounded(
        [sys.executable, path], cwd=REPO, env=env, timeout=180
    )


def test_tutorials_exist() -> None:
    assert FIRST in TUTORIALS


@pytest.mark.parametrize("path", [_param(p) for p in TUTORIALS])
def test_tutorial_runs(path: str) -> None:
    proc = _run(path)
    assert proc.returncode == 0, f"{path} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.splitlines()[-1].endswith("OK"), proc.stdout


def test_first_training_learns_and_round_trips() -> None:
    proc = _run(FIRST)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 8 and losses[-1] < losses[0] / 10, losses
    assert "restored model matches the trained model: OK" in lines


@pytest.mark.slow  # shares tutorial 5's run (slow, above)
def test_lora_tutorial_reloads_the_adapter_in_one_process() -> None:
    path = os.path.join(REPO, "tutorials", "05_lora_finetune.py")
    proc = _run(path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("evaluation loss:"))
    # "base B, base + reloaded adapter A, FSDP model F": A == F and A < B
    base, reloaded, fsdp_model = (float(part.split()[-1]) for part in line.split(","))
    assert reloaded == fsdp_model < base, line
