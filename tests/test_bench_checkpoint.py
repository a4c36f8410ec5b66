"""Smoke test of ``benchmarks/bench_checkpoint.py``: it runs on toy sizes and prints
its three tables.  Nothing here looks at a number's size: the measurements are for
``docs/checkpointing.rst``, not for CI."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests._proc import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_checkpoint_benchmark_runs_and_prints_tables(tmp_path):
    out_json = tmp_path / "raw.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = run_bounded(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_checkpoint.py"), "--tiny",
         "--threads", "1", "--json", str(out_json)],
        timeout=300, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for title in ("SHARDED_STATE_DICT save and load", "full checkpoint, rank 0 peak",
                  "offline consolidation"):
        assert title in proc.stdout, title
    raw = json.loads(out_json.read_text())
    assert set(raw["sharded"]) == {"torch_fsdp1", "fsdp_wrap"}
    for fw in ("torch_fsdp1", "fsdp_wrap"):
        assert len(raw["sharded"][fw]) == 2 and raw["sharded"][fw][0]["save_bytes"] > 0
    assert set(raw["consolidate"]) == {"fsdp_wrap", "dcp_to_torch_save"}
