"""The step timeline: ``$FSDP_WRAP_TRACE`` profiles, ``fsdp_wrap.cli.timeline`` reads and draws.

* On two gloo ranks, a model trained with ``FSDP_WRAP_TRACE`` set writes one
  profile per rank holding exactly the asked steps; the timeline read from
  them has every rank's steps, every unit's gathers and reductions named
  (the units from the model's own modules), exposed communication within
  each step, and the forward before the backward; the picture and the merged
  trace are written.
* The exposed-communication arithmetic on a hand-made trace (the numbers
  worked out by hand in the test).
* ``fsdp-wrap trace`` end to end on the demo (``-m slow``: it spawns ranks).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_wrap as fw
import fsdp_wrap.cli.timeline as tl
from fsdp_wrap.runtime import step_trace
from fsdp_wrap.runtime.names import clean_fqn
from fsdp_wrap.wrap import ModuleWrapPolicy
from tests._proc import run_bounded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _profile_steps(directory: str) -> list[str]:
    """Train 5 steps with FSDP_WRAP_TRACE=directory and 1 warm-up, 3 profiled;
    the model's unit names."""
    warnings.simplefilter("ignore")
    os.environ[step_trace.ENV_DIR] = directory
    os.environ[step_trace.ENV_STEPS] = "1,3"
    try:
        model = fw.FullyShardedDataParallel(
            nn.Sequential(nn.Linear(4, 8), Block(8), Block(8), nn.Linear(8, 2)),
            auto_wrap_policy=ModuleWrapPolicy({Block}), bucket_cap_mb=0, all_gather_batch_mb=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            with torch.no_grad():
                model(torch.randn(2, 4))  # (evaluation: not a step)
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        del os.environ[step_trace.ENV_DIR], os.environ[step_trace.ENV_STEPS]
    return sorted(clean_fqn(n) or "<root>" for n, m in model.named_modules()
                  if isinstance(m, fw.FullyShardedDataParallel))


def test_profiled_steps_read_back_as_a_timeline(pool2: Any, tmp_path: Any) -> None:
    units = pool2.run(_profile_steps, str(tmp_path))[0]
    files = sorted(os.listdir(tmp_path))
    assert files == ["trace_rank0.json", "trace_rank1.json"], files
    timeline = tl.load(str(tmp_path))
    assert [r.rank for r in timeline.ranks] == [0, 1]
    assert sorted(timeline.units) == units
    for r in timeline.ranks:
        assert len(r.steps) == 3, [s.step for s in r.steps]
        for s in r.steps:
            assert 0 < s.exposed_ms < s.ms and s.forward_ms > 0 and s.backward_ms > 0, s
        named = {(c.kind, u) for c in r.comms for u in c.units}
        assert {u for k, u in named if k == "gather"} == set(units)  # (the eval forward frees the root)
        assert {u for k, u in named if k == "reduce"} == set(units)
        kinds = [name for name, _, _ in r.phases]
        assert kinds == ["forward", "backward", "other"] * 3
    summary = timeline.summary()
    assert "step 3:" in summary and "exposed communication" in summary
    tl.merge_traces([str(tmp_path / f) for f in files], str(tmp_path / "trace.json"))
    with open(tmp_path / "trace.json") as f:
        merged = json.load(f)
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    pytest.importorskip("matplotlib")
    tl.plot_timeline(timeline, str(tmp_path / "timeline.png"), "test")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def _event(name: str, start_ms: float, end_ms: float) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": start_ms * 1000, "dur": (end_ms - start_ms) * 1000,
            "pid": 1, "tid": 1}


def test_exposed_communication_on_a_hand_made_trace(tmp_path: Any) -> None:
    """Step [0, 10) ms: an asynchronous gather of 'a' issued in [1, 2), waited for
    in [5, 6); a reduction of 'a' and 'b' in [5.5, 7); forward until the first
    pre-backward at 4, backward until the callback ends at 8.  Exposed:
    [1, 2) + [5, 7) = 3 ms; 'a''s gather in flight from 1 to 6."""
    events = [
        _event("ProfilerStep#0", 0, 10),
        _event("FSDP::all_gather (a)", 1, 2),
        _event("FSDP::pre_backward (a)", 4, 4.5),
        _event("FSDP::all_gather_wait (a)", 5, 6),
        _event("FSDP::post_backward_reduce (a, b)", 5.5, 7),
        _event("FSDP::root_post_backward_callback", 7.5, 8),
    ]
    with open(tmp_path / "trace_rank0.json", "w") as f:
        json.dump({"baseTimeNanoseconds": 0, "traceEvents": events}, f)
    timeline = tl.load(str(tmp_path))
    (step,) = timeline.ranks[0].steps
    assert step.ms == pytest.approx(10) and step.exposed_ms == pytest.approx(3)
    assert step.forward_ms == pytest.approx(4) and step.backward_ms == pytest.approx(4)
    gather = timeline.ranks[0].comms[0]
    assert (gather.units, gather.in_flight_until) == (("a",), pytest.approx(6))
    assert timeline.units == ["a", "b"]


@pytest.mark.slow
def test_fsdp_wrap_trace_on_the_demo(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    proc = run_bounded([sys.executable, "-m", "fsdp_wrap", "trace", "--out", str(tmp_path),
                        "--layers", "2", "--width", "32", "--warmup", "1", "--steps", "2",
                        "--prefetch-ahead", "2"], cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2:" in proc.stdout and "exposed communication" in proc.stdout
    for name in ("timeline.png", "trace.json", "trace_rank0.json", "trace_rank1.json"):
        assert (tmp_path / name).exists(), name
