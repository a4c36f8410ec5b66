"""Smoke tests of the by-hand tools in ``benchmarks/`` (``bench_fsdp.py``, ``step_cost.py``,
the GPU part's ``gpu_unit_cost.py`` and ``profile_cuda.py`` in their CPU forms, ``bench_nodes.py``):
they run and print their tables.

Toy sizes, few steps, a subset of the configurations.  Nothing here looks at a
timing: the benchmark's numbers are for ``docs/performance/``, not for CI.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests._proc import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_fsdp.py")


@pytest.mark.slow  # a smoke run of a by-hand tool (benchmarks/), in CI with -m slow
def test_benchmark_runs_and_prints_tables(tmp_path):
    out_json = tmp_path / "raw.json"
    cmd = [
        sys.executable, SCRIPT, "--tiny", "--quick", "--workloads", "small",
        "--frameworks", "torch_fsdp1,fsdp_wrap,fsdp2,ddp", "--strategies", "FULL_SHARD,NO_SHARD",
        "--orig", "false", "--mem-frameworks", "torch_fsdp1,fsdp_wrap", "--steps", "2", "--warmup", "1", "--mem-steps", "1",
        "--json", str(out_json),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = run_bounded(cmd, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # Step-time table: its columns and one row per framework.
    for column in ("strategy", "orig", "framework", "median ms", "/fsdp1", "/ddp", "MiB/step",
                   "x params / limit", "colls", "build ms"):
        assert column in out, column
    for row in ("torch_fsdp1", "fsdp_wrap", "fsdp2", "ddp"):
        assert f" {row} " in out, row
    # Memory table and the targets summary.
    for column in ("step peak MiB", "fwd+bwd MiB", "build peak MiB", "resident MiB"):
        assert column in out, column
    assert "targets" in out and "step vs torch FSDP1" in out
    # Collective bytes are counted at the c10d ops: FULL_SHARD moves about 3x
    # the parameter bytes (a little less: the root stays gathered after
    # forward) and NO_SHARD all-reduces exactly 1x.
    raw = json.loads(out_json.read_text())
    res = raw["interleaved"]["small"]
    param_bytes = res["params"] * 4
    fs = sum(res["colls"]["fsdp_wrap/FULL_SHARD/F"]["bytes"].values()) / param_bytes
    ns = sum(res["colls"]["fsdp_wrap/NO_SHARD/F"]["bytes"].values()) / param_bytes
    assert 2.5 < fs <= 3.1, fs
    assert abs(ns - 1.0) < 0.01, ns
    # Same weights and data: every framework's first loss is the same.
    losses = list(res["first_loss"].values())
    assert max(losses) - min(losses) < 1e-5, res["first_loss"]


@pytest.mark.slow  # a smoke run of a by-hand tool (benchmarks/), in CI with -m slow
def test_step_cost_runs_with_its_extra_rows():
    script = os.path.join(ROOT, "benchmarks", "step_cost.py")
    proc = run_bounded([sys.executable, script, "--variants", "ddp,fsdp_wrap/FULL_SHARD/F",
                        "--rounds", "2", "--warmup", "1", "--no-comm", "--waiting", "--phases"],
                       timeout=240, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in ("ddp/-/-", "ddp/-/-/nocomm", "fsdp_wrap/FULL_SHARD/F/nocomm",
                "fsdp_wrap/FULL_SHARD/F/waiting", "fsdp_wrap/FULL_SHARD/F: in flight / waiting"):
        assert row in proc.stdout, row
    # --phases: each configuration's three phases on each of the two ranks
    for key in ("ddp/-/-", "fsdp_wrap/FULL_SHARD/F/nocomm"):
        num = r"\d+\.\d"
        phase = rf"{num} / {num} / {num}"
        assert re.search(rf"^  {re.escape(key)}: rank 0 {phase};  rank 1 {phase}$",
                         proc.stdout, re.M), proc.stdout


@pytest.mark.slow  # a smoke run of a by-hand tool (benchmarks/), in CI with -m slow
def test_gpu_tools_run_on_the_cpu():
    """``gpu_unit_cost.py`` and ``profile_cuda.py --host`` (the GPU part's tools)
    in their CPU smoke forms: their tables and columns are there."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    unit = run_bounded([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_unit_cost.py"),
                        "--device", "cpu", "--tiny", "--rounds", "2", "--hook-rows", "no",
                        "--keys", "plain/-/-,fsdp_wrap/FULL_SHARD/T"],
                       timeout=240, env=env, cwd=ROOT)
    assert unit.returncode == 0, unit.stdout[-3000:] + unit.stderr[-3000:]
    for text in ("step ms", "host ms", "cpu ms", "cudaMalloc", "/plain", "fsdp_wrap/FULL_SHARD/T",
                 "interleaved rounds", "targets"):
        assert text in unit.stdout, text
    alone = run_bounded([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_unit_cost.py"),
                         "--device", "cpu", "--tiny", "--rounds", "2", "--hook-rows", "no",
                         "--schedule", "alone", "--no-peaks",
                         "--keys", "plain/-/-,fsdp_wrap/FULL_SHARD/F"],
                        timeout=240, env=env, cwd=ROOT)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert "one model at a time" in alone.stdout and "ratio of medians" in alone.stdout
    assert "fsdp_wrap/FULL_SHARD/F: step" in alone.stdout
    host = run_bounded([sys.executable, os.path.join(ROOT, "benchmarks", "profile_cuda.py"),
                        "--device", "cpu", "--host", "--workload", "tiny-gpu", "--steps", "2",
                        "--variants", "plain/-/-,fsdp_wrap/FULL_SHARD/F"],
                       timeout=240, env=env, cwd=ROOT)
    assert host.returncode == 0, host.stdout[-3000:] + host.stderr[-3000:]
    for row in ("## plain/-/-: host ms/step", "## fsdp_wrap/FULL_SHARD/F: host ms/step"):
        assert row in host.stdout, row
    assert "back to back" in host.stdout and "Python calls/step" in host.stdout


@pytest.mark.slow  # a smoke run of a by-hand tool (benchmarks/), in CI with -m slow
def test_nodes_benchmark_runs_and_prints_its_table(tmp_path):
    from fsdp_wrap.cli import testbed

    reason = testbed.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no test-bed cluster: {reason}")
    out_json = tmp_path / "raw.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_nodes.py"), "--tiny", "--quick",
           "--strategies", "FULL_SHARD,HYBRID_SHARD", "--json", str(out_json)]
    proc = run_bounded(cmd, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for column in ("strategy", "framework", "step s", "/fsdp1", "MB/step/node", "x count"):
        assert column in proc.stdout, column
    res = json.loads(out_json.read_text())["rates"]["1gbit"]
    assert set(res["keys"]) == {"fsdp_wrap/FULL_SHARD", "torch_fsdp1/FULL_SHARD",
                                "fsdp_wrap/HYBRID_SHARD", "torch_fsdp1/HYBRID_SHARD", "ddp/-"}
    # same weights and data: every configuration's first loss is the same
    assert len(set(res["first"].values())) == 1, res["first"]
    # both libraries send the same bytes per strategy (node 0, every timed step),
    # within 1% (the acks' timing, the barriers) and, on a loaded machine, the
    # frames TCP sent again: each resent segment puts at most one frame more on
    # the link (seen: +67 kB, 1.0%, in one step of one library in a full .ci/run)
    frame = res["frame"][0]
    for strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        ours, theirs = ((res["sent"][key][0], res["resent"][key][0])
                        for key in (f"fsdp_wrap/{strategy}", f"torch_fsdp1/{strategy}"))
        for a, ra, b, rb in zip(*ours, *theirs):
            assert abs(a - b) < 0.01 * b + frame * (ra + rb), (strategy, ours, theirs, frame)
