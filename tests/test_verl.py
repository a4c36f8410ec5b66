"""verl 0.9.1's FSDP1 engine on fsdp_wrap under ``install()`` (issue 51), on 2 CPU ranks.

``tests/frameworks/verl_engine_run.py`` runs verl's ``TrainingWorker`` the way
its PPO trainer does (no Ray, no rollout server) first on torch's FSDP1, then
on fsdp_wrap, and compares every tensor.  Asserted here, on both ranks:

* torch's FSDP1 as it is stops verl's engine on CPU at build (its
  ``sync_module_states`` check wants GPU parameters); the oracle run lifts
  that and the other CPU-only stops it names (``_torch_lifts``);
* fsdp_wrap completes every step; every value it gives (log-probs, entropies,
  losses, gradient norms, weights, checkpoint file names, the HF export, the
  weight syncs) equals torch's bit for bit wherever torch gives one;
* resume is exact: a new worker loading verl's checkpoint repeats the update
  that followed the save (losses, gradient norms, log-probs, every shard),
  and fsdp_wrap resuming torch's FSDP1 checkpoint repeats torch's;
* the LoRA adapter syncs (full and layered summon) hand exactly the adapters
  read the plain way from torch's model; torch's FSDP1 with PEFT as shipped
  hands none (recorded, asserted, so the check can fail);
* verl's layered summon on a model wrapped one unit per decoder layer leaves
  the units marked as roots (verl's bug): torch's FSDP1 then fails in the
  summon's fallback and the next forward (``'_all_handles'``); fsdp_wrap
  completes the summon (the adapters, exactly) and refuses the forward with
  torch's error plus the cause and the fix.

verl pins transformers below 5.11: it lives in an environment of its own
(``pip install -e '.[verl]'``; ``.ci/run`` builds one), and this test skips
where verl is not installed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import pytest

from tests._proc import run_bounded

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "frameworks", "verl_engine_run.py")
TIMEOUT = 900  # seconds (about 90 s on a quiet 2-core machine, most of it verl's imports)
ADAPTERS = 28  # lora_A and lora_B of 7 linear layers x 2 decoder layers


def _run() -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="", VERL_PLATFORM="cpu")
    env.pop("FSDP_WRAP_INSTALL", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               SCRIPT, out]
        proc = run_bounded(cmd, cwd=os.path.dirname(SCRIPT), env=env, timeout=TIMEOUT)
        files = [os.path.join(out, f"verl_engine_rank{r}.json") for r in range(2)]
        assert proc.returncode == 0 and all(map(os.path.exists, files)), (
            f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
        return [json.load(open(f)) for f in files]


def _errors(steps: dict[str, Any], who: str) -> list[str]:
    return [f"{name}: {entry[who]}" for name, entry in steps.items()
            if isinstance(entry, dict) and isinstance(entry.get(who), dict) and "error" in entry[who]]


def test_verl_fsdp1_engine() -> None:
    pytest.importorskip("verl", reason="verl is not installed: it needs an environment of its own "
                        "(verl 0.9.1 pins transformers<5.11): pip install -e '.[verl]'")
    for rank, report in enumerate(_run()):
        assert "sync_module_states=True" in report["_torch_as_is"]["build"]["error"], report["_torch_as_is"]
        assert report["_meta"]["verl"] == "0.9.1", report["_meta"]
        layered = report["layered"]  # verl's helpers on a wrap its engine does not build
        assert "'_all_handles'" in layered["collect_layered"]["torch"]["error"], layered["collect_layered"]
        assert layered["collect_layered_ours_is_the_adapters"] is True, layered
        assert layered["left_flagged"]["equal"] is True and len(layered["left_flagged"]["ours"]) == 2, layered
        after = layered["forward_after"]
        assert "'_all_handles'" in after["torch"]["error"], after
        assert after["ours"]["error"].startswith("AttributeError: 'Qwen2DecoderLayer' object has no attribute "
                                                 "'_all_handles' [rank"), after
        assert "_is_root=True" in after["ours"]["error"], after
        for case in ("actor", "offload", "ref", "lora"):
            steps = report[case]
            assert steps["classes"][0].startswith("torch.distributed.fsdp"), steps["classes"]
            assert steps["classes"][1].startswith("fsdp_wrap."), steps["classes"]
            assert not _errors(steps, "ours"), (case, rank, _errors(steps, "ours"))
            assert not _errors(steps, "torch"), (case, rank, _errors(steps, "torch"))
            compared = {n: e for n, e in steps.items() if isinstance(e, dict) and "equal" in e}
            differ = {n: e.get("why") for n, e in compared.items()
                      if not e["equal"] and n not in ("sync_lora", "sync_lora_layered")}
            assert not differ, (case, rank, differ)
            assert compared, (case, rank)
        for case in ("actor", "offload"):
            for what in ("update2", "log_prob2", "weights2"):
                assert report[case][f"resumed_{what}_exact"] is True, (case, rank, what)
            for what in ("update2", "weights2"):  # torch's FSDP1 checkpoint, resumed by fsdp_wrap
                assert report[case][f"ours_resumed_torch_{what}_exact"] is True, (case, rank, what)
        if rank == 0:  # (rank 0 writes the HF export)
            assert report["actor"]["hf_export"]["equal"] is True, report["actor"]["hf_export"]
        assert report["ref"]["build"]["ours"] == {"cpu_offload": True}, report["ref"]["build"]
        lora = report["lora"]
        for sync in ("sync_lora", "sync_lora_layered"):
            assert lora[f"{sync}_ours_is_the_adapters"] is True, (rank, sync, lora[f"{sync}_ours_is_the_adapters"])
            assert lora[sync]["ours"] == {"n": ADAPTERS + 1}, (rank, sync, lora[sync])  # (+ the peft config's r)
            # torch's FSDP1 with PEFT 0.21: no adapter reaches the rollout
            assert lora[f"{sync}_torch_is_the_adapters"] is not True, (rank, sync)
        for step in ("sync_base", "sync_merged", "ref_in_actor", "update2", "log_prob2"):
            assert lora[step]["equal"] is True, (rank, step, lora[step])
