"""Tutorial 3 (bf16 mixed precision + CPU offload) runs and its checks hold.

The run is shared with ``tests/test_tutorials.py`` (one subprocess per
session); this file checks what the tutorial claims, line by line.
"""

from __future__ import annotations

import os
import re

from tests.test_tutorials import REPO, _run

PATH = os.path.join(REPO, "tutorials", "03_mixed_precision_offload.py")

CHECKS = [
    "master parameters are float32",
    "master parameters live on CPU",
    "forward computes with bf16 weights",
    "gradients reach the optimizer in float32",
    "full state dict is float32",
    "the loss went down",
]


def test_tutorial_03_runs_and_reports_ok() -> None:
    proc = _run(PATH)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert lines[-1] == "mixed precision with CPU offload, 10 steps: OK", proc.stdout
    for check in CHECKS:
        assert f"check: {check}" in lines, (check, proc.stdout)


def test_tutorial_03_trains() -> None:
    proc = _run(PATH)
    losses = [float(m.group(1)) for m in re.finditer(r"^step \d+: loss ([0-9.]+)$", proc.stdout, re.M)]
    assert len(losses) == 10, proc.stdout
    assert losses[-1] < 0.1 * losses[0], losses
