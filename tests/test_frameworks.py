"""Real frameworks on fsdp_wrap, switched on with ``fsdp_wrap.install()`` only.

Each test checks one scenario of ``tests/frameworks/`` (``accelerate_run.py`` ...),
run under ``torchrun`` on 2 CPU ranks (gloo) by ``tests/_framework_runs.py``: the
session's scenarios share one launch (one set of imports), each with its own
results and its own failure.  A scenario sweeps its configurations in those
two processes, on torch's FSDP1 first where torch runs, then on fsdp_wrap, and
records what it saw (losses, resumed losses, checkpoint checks) per rank.  The
assertions are here.  Losses are compared with torch's FSDP1 at 1e-5
(relative), resumed runs with the uninterrupted ones exactly (same ops, same
order).
"""

from __future__ import annotations

import math

import pytest

from tests._framework_runs import results

pytestmark = pytest.mark.slow


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=1e-7)
                                    for x, y in zip(a, b))


@pytest.mark.framework_scenario("accelerate")
def test_accelerate(request: pytest.FixtureRequest) -> None:
    for r in results(request):
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


@pytest.mark.framework_scenario("trainer")
def test_transformers_trainer(request: pytest.FixtureRequest) -> None:
    for r in results(request):
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


@pytest.mark.framework_scenario("lightning")
def test_lightning_fabric_and_trainer(request: pytest.FixtureRequest) -> None:
    for r in results(request):
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


@pytest.mark.framework_scenario("dcp_compile")
def test_dcp_state_dict_helpers_and_torch_compile(request: pytest.FixtureRequest) -> None:
    for r in results(request):
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


@pytest.mark.framework_scenario("lora")
def test_lora_under_accelerate_and_trainer(request: pytest.FixtureRequest) -> None:
    """PEFT LoRA through both frameworks unchanged (issue 20 item 3), and the adapter
    streamed out with ``save_full_checkpoint(trainable_only=True)`` (item 4)."""
    for rank, r in enumerate(results(request)):
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
