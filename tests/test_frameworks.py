"""Real frameworks on fsdp_wrap, switched on with ``fsdp_wrap.install()`` only.

Each test launches one script of ``tests/frameworks/`` with ``torchrun`` on 2
CPU ranks (gloo); the script sweeps its configurations in those two processes,
on torch's FSDP1 first where torch runs, then on fsdp_wrap, and writes what it
saw (losses, resumed losses, checkpoint checks) per rank.  The assertions are
here.  Losses are compared with torch's FSDP1 at 1e-5 (relative), resumed runs
with the uninterrupted ones exactly (same ops, same order).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import pytest

from tests._proc import run_bounded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "frameworks")

pytestmark = pytest.mark.slow


def _launch(script: str, tmp_path: Any) -> list[dict[str, Any]]:
    # CPU ranks: on a machine with one GPU, Accelerate would otherwise give
    # rank 1 a CUDA device that does not exist.
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    env.pop("FSDP_WRAP_INSTALL", None)
    # This checkout's fsdp_wrap, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    # --standalone: torchrun picks a free port itself.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(SCRIPTS, script), str(tmp_path)]
    proc = run_bounded(cmd, cwd=SCRIPTS, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    out = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            out.append(json.load(f))
    # torch's legacy optimizer-state functions raised NotImplementedError in the
    # run (tests/frameworks/_common.py; tests/test_legacy_optim_removed.py)
    assert all(r.get("torch_legacy_optim_apis_removed") is True for r in out), out
    return out


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=1e-7)
                                    for x, y in zip(a, b))


def test_accelerate(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    for r in _launch("accelerate_run.py", tmp_path):
        for name in ("sharded", "full_bf16_loaded"):
            ours, theirs = f"ours/{name}", f"torch/{name}"
            assert r[ours + "/class"] == "fsdp_wrap.fully_sharded_data_parallel", r
            assert r[theirs + "/class"].startswith("torch.distributed.fsdp"), r
            assert _close(r[ours + "/train"], r[theirs + "/train"]), (name, r)
            # Accelerate's upcast of a bf16-loaded model to fp32 masters took.
            assert r[ours + "/flat_dtypes"] == r[theirs + "/flat_dtypes"] == ["torch.float32"]
            assert r[ours + "/resumed"] == r[ours + "/ref"], (name, r)
        assert r["torch/sharded/resumed"] == r["torch/sharded/ref"]
        assert _close(r["ours/sharded/ref"], r["torch/sharded/ref"])
        # FULL: the file Accelerate wrote loads strictly into a plain GPT-2 and
        # holds the trained parameters exactly (torch's FSDP1 crashes saving it).
        assert r["ours/full_bf16_loaded/plain_load"]["missing"] == []
        assert r["ours/full_bf16_loaded/plain_load"]["unexpected"] == []
        assert r["ours/full_bf16_loaded/plain_vs_trained"] == 0.0


def test_transformers_trainer(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    for r in _launch("trainer_run.py", tmp_path):
        torch_run = "torch/SHARDED_STATE_DICT/True"
        assert r[torch_run + "/class"].startswith("torch.distributed.fsdp")
        ours = ("ours/SHARDED_STATE_DICT/True", "ours/SHARDED_STATE_DICT/False",
                "ours/FULL_STATE_DICT/False")
        for run in ours:
            assert r[run + "/class"] == "fsdp_wrap.fully_sharded_data_parallel"
            assert len(r[run + "/losses"]) == 4
            assert _close(r[run + "/losses"], r[torch_run + "/losses"]), (run, r)
            # Resuming from checkpoint-2 replays steps 3-4 exactly, SHARDED too:
            # fsdp_wrap.install() gives the Trainer's fresh optimizer state shaped
            # by the checkpoint before Accelerate builds its load template (on
            # torch's FSDP1 Adam's moments are not read; not asserted here).
            assert r[run + "/resumed"] == r[run + "/losses"], (run, r)
        assert r["ours/FULL_STATE_DICT/False/plain_vs_trained"] == 0.0


def test_lightning_fabric_and_trainer(tmp_path: Any) -> None:
    pytest.importorskip("lightning")
    for r in _launch("lightning_run.py", tmp_path):
        fabric = [k.rsplit("/", 1)[0] for k in r if k.startswith("fabric/") and k.endswith("/train")]
        assert len(fabric) == 4, fabric
        for run in fabric:
            assert r[run + "/class"] == "fsdp_wrap.fully_sharded_data_parallel"
            assert _close(r[run + "/train"] + r[run + "/ref"], r[run + "/torch"]), (run, r)
            assert r[run + "/resumed"] == r[run + "/ref"], (run, r)
            assert r[run + "/remainder"] == {"step": 3}
            if "/full/" in run:
                assert r[run + "/plain_vs_trained"] == 0.0
        trainer = [k.rsplit("/", 1)[0] for k in r if k.startswith("trainer/") and k.endswith("/whole")]
        assert len(trainer) == 3, trainer
        for run in trainer:
            assert len(r[run + "/whole"]) == 6 and r[run + "/first"] == r[run + "/whole"][:3]
            assert _close(r[run + "/whole"], r[run + "/torch"]), (run, r)
            assert _close(r[run + "/first"] + r[run + "/resumed"], r[run + "/torch_resumed"]), (run, r)
            if "/full/" in run:
                assert r[run + "/plain_vs_trained"] == 0.0
        # issue 23: user-wrapped GPT-2 blocks resumed from step 4, FULL and SHARDED,
        # step by step against the same batches run uninterrupted
        for run in (f"gpt2/{sdt}/{how}" for sdt in ("full", "sharded") for how in ("blocks", "root")):
            assert len(r[run + "/first"]) == 4 and len(r[run + "/resumed"]) == 3, (run, r)
            assert r[run + "/first"] + r[run + "/resumed"] == r[run + "/replay"], (run, r)


def test_dcp_state_dict_helpers_and_torch_compile(tmp_path: Any) -> None:
    for r in _launch("dcp_compile_run.py", tmp_path):
        rows = [k.rsplit("/", 1)[0] for k in r if k.startswith("dcp/ours/") and k.endswith("/train")]
        assert len(rows) == 5, rows
        for row in rows:
            assert r[row + "/resumed"] == r[row + "/ref"], (row, r)
            theirs = row.replace("/ours/", "/torch/")
            if theirs + "/train" in r:
                assert _close(r[row + "/train"] + r[row + "/ref"],
                              r[theirs + "/train"] + r[theirs + "/ref"]), (row, r)
            if "/full" in row and (r.get(row + "/keys", 1) > 0):
                assert r[row + "/plain_vs_model"] == 0.0, (row, r)
        for mode in ("whole", "blocks"):
            ours, theirs = f"compile/ours/{mode}", f"compile/torch/{mode}"
            assert _close(r[ours + "/losses"], r[theirs + "/losses"]), (mode, r)
            # Dynamo compiled the same graphs between the units' eager hooks.
            assert r[ours + "/graphs"] == r[theirs + "/graphs"] > 0, (mode, r)


def test_lora_under_accelerate_and_trainer(tmp_path: Any) -> None:
    """PEFT LoRA through both frameworks unchanged (issue 20 item 3), and the adapter
    streamed out with ``save_full_checkpoint(trainable_only=True)`` (item 4)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    for rank, r in enumerate(_launch("lora_run.py", tmp_path)):
        for fw in ("accelerate", "trainer"):
            theirs = f"{fw}/torch/True"
            assert r[theirs + "/class"].startswith("torch.distributed.fsdp"), r
            for uop in (True, False):
                ours = f"{fw}/ours/{uop}"
                assert r[ours + "/class"] == "fsdp_wrap.fully_sharded_data_parallel", r
                assert len(r[ours + "/losses"]) == 3, r
                assert _close(r[ours + "/losses"], r[theirs + "/losses"]), (ours, r)
                # What PEFT's get_peft_model_state_dict finds in a FULL state dict of
                # the wrapped model, the frameworks' adapter save: every adapter under
                # install() (fsdp_wrap/frameworks/peft.py); none on torch's FSDP1 with
                # peft 0.21 (it strips only a leading FSDP prefix, so the nested units
                # hide every adapter), which install() leaves as it is.
                if rank == 0:
                    assert r[ours + "/peft_keys_of_wrapped"] == 8, (ours, r)
                    assert r[theirs + "/peft_keys_of_wrapped"] == 0, (theirs, r)
                    want, got = r[ours + "/adapter_keys"]
                    assert len(want) == 8 and got == want, (ours, r)
                    assert r[ours + "/adapter_differ"] == [], (ours, r)
                    assert r[ours + "/framework_file_keys"] == 8, (ours, r)
                    assert r[ours + "/framework_differ"] == [], (ours, r)
                    reloaded, fsdp_loss = r[ours + "/reloaded_loss"]
                    assert reloaded == fsdp_loss, (ours, r)
