"""The plan against what training holds: ``benchmarks/plan_accuracy.py --quick --check 0.10``.

Two gloo ranks train the benchmark's compute model and a transformers GPT-2 for
every strategy (and bf16 with ``use_orig_params``); the sharded parameters,
gradients and optimizer state held must equal the plan's to the byte, and the
peak live bytes of forward + backward must be within 10% of the plan's.  At
the default gradient bucket cap every unit of these models is reduced alone;
at 100 MiB one bucket takes every unit, so those rows check the plan's bucket
model (open gradients, the buffer at the copy, casts at the wait).  Caps in
between are shown in docs/plan.rst, not checked here: NO_SHARD buckets there
are all-reduced asynchronously while later units' backward runs, and what gloo
holds meanwhile depends on timing (GPT-2 NO_SHARD at 8 MiB read 0.89-0.93 in
two runs), which the plan does not model.
"""

from __future__ import annotations

import os
import sys

import pytest
from packaging.version import Version

from fsdp_wrap._compat import TORCH_VERSION
from tests._proc import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The CPU (gloo) memory model's staging buffers were measured on torch 2.13.  On
# torch 2.11 (H100 machine, Python 3.12) gloo's gathers stage more: the peak read
# 0.66-0.85 of the plan for FULL_SHARD rows (docs/plan.rst); the held bytes still
# matched exactly.
# The default cap in the default suite; one bucket for every unit (100 MiB),
# which checks the plan's bucket model, under -m slow (CI runs it): each costs
# about 18 s of 2-rank training on 2 cores.
@pytest.mark.skipif(TORCH_VERSION < Version("2.13"),
                    reason="the gloo staging model is calibrated on torch 2.13 (docs/plan.rst)")
@pytest.mark.parametrize("cap", ["default", pytest.param("100", marks=pytest.mark.slow)])
def test_plan_within_ten_percent_of_what_training_holds(cap: str) -> None:
    pytest.importorskip("transformers")
    script = os.path.join(ROOT, "benchmarks", "plan_accuracy.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("FSDP_WRAP_BUCKET_CAP_MB", None)  # "default" must be the built-in cap
    proc = run_bounded([sys.executable, script, "--quick", "--check", "0.10", "--models", "bench",
                        "--bucket-caps", cap], cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("compute", "gpt2"))]
    assert len(rows) == 8 and all(" yes " in r for r in rows), proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(TORCH_VERSION < Version("2.13"),
                    reason="the gloo staging model is calibrated on torch 2.13 (docs/plan.rst)")
def test_plan_on_hugging_face_lora_and_qlora_models() -> None:
    """Issue 20 item 6: LLaMA (untied head), BERT MLM (tied decoder), T5 (shared
    embedding), LoRA and QLoRA (split units: frozen base, trainable adapters,
    4-bit storage).  Every row holds exactly the planned bytes; the fp32 and
    4-bit rows peak within 10% of the plan.  The bf16-compute rows are shown,
    not checked: they read 0.86-1.12 (docs/plan.rst, what is left)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    script = os.path.join(ROOT, "benchmarks", "plan_accuracy.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("FSDP_WRAP_BUCKET_CAP_MB", None)
    proc = run_bounded([sys.executable, script, "--models", "hf"], cwd=ROOT, timeout=1200,
                       env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.startswith(("llama", "bert", "t5"))]
    assert len(rows) == 26, proc.stdout
    assert all(r[5] == "yes" for r in rows), proc.stdout  # held bytes equal the plan's
    for r in rows:
        if r[3] in ("fp32", "nf4/bf16") and "checked)" not in r:
            assert 0.90 <= float(r[8]) <= 1.10, (r, proc.stdout)
