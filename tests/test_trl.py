"""TRL's trainers on fsdp_wrap under ``install()`` (issue 32), with PEFT as shipped.

Two scenarios (``tests/frameworks/trl_sft_run.py``, ``trl_rl_run.py``) of the
session's framework launch on 2 CPU ranks (``tests/_framework_runs.py``), each
sweeping its configurations in those two processes: torch's FSDP1 first, then
fsdp_wrap.  Asserted here:

* losses equal torch's FSDP1 exactly (same operations, same order) for the
  same ``use_orig_params``; LoRA and QLoRA with either (the LoRA units make
  every flat parameter hold one adapter matrix, so the gradient norms agree);
* every rank's trainable pieces changed in training;
* resuming from the step-2 checkpoint replays the uninterrupted run exactly,
  and ends with every rank's pieces equal to it (torch's FSDP1 restores no
  adapter: recorded, asserted to differ, so the check can fail);
* what ``save_model`` wrote reloads, in a plain process, to tensors equal to
  the trained ones and to the trained model's logits (computed as the wrapped
  model computes them: FSDP's mixed precision, the trainer's autocast);
* ``load_adapter`` into the wrapped model restores every rank's shard;
* GRPO's generation gathers no more, and no more bytes, per generated token
  than torch's FSDP1;
* TRL's FSDP1 weight syncs to vLLM (GRPO's and online DPO's per-unit
  ``summon_full_params(recurse=False, writeback=False)`` walks, vLLM stood in
  for) hand vLLM what torch's FSDP1 hands it, to the bit, and the full weights
  (GRPO's walk misses the root unit's, on torch's FSDP1 alike).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._framework_runs import results

pytestmark = pytest.mark.slow


def _rows(r: dict[str, Any], prefix: str) -> list[str]:
    return sorted(k[: -len("/losses")] for k in r if k.startswith(prefix) and k.endswith("/losses"))


def _check_ours(r: dict[str, Any], run: str, rank: int, kind: str) -> None:
    assert r[run + "/class"] == "fsdp_wrap.fully_sharded_data_parallel", r
    assert len(r[run + "/losses"]) == 3, (run, r[run + "/losses"])
    changed, nonempty = r[run + "/trained"]
    assert changed == nonempty > 0, (run, rank, r[run + "/trained"])
    assert r[run + "/resumed"] == r[run + "/losses"], (run, r)
    assert r[run + "/resumed_vs_whole"] == 0.0, (run, rank)
    if rank == 0:
        assert r[run + "/reloaded_vs_plain"] == 0.0, run
        assert r[run + "/reloaded_vs_wrapped"] == 0.0, run
        if kind != "full":
            assert r[run + "/adapter_tensors"] == 8, run  # A and B of q_proj, v_proj x 2 layers
            assert r[run + "/adapter_vs_trained"] == 0.0, run


def _check_weight_syncs(r: dict[str, Any], run: str, twin: str) -> None:
    """TRL's FSDP1 weight syncs to vLLM (``trl_rl_run.weight_syncs``): what
    vLLM receives equals torch's FSDP1's to the bit, and the full weights.
    GRPO's walk starts from the model before Accelerate wrapped it, so it
    never summons the root unit: the root's own weights (embedding, final
    norm, head) never reach vLLM, on torch's FSDP1 alike (TRL 1.16)."""
    full = dict(map(tuple, r[run + "/full_weights"]))
    assert r[run + "/full_weights"] == r[twin + "/full_weights"], run
    for sync in ("vllm_sync_grpo", "vllm_sync_online_dpo"):
        got = r[run + "/" + sync]
        assert isinstance(got, list), (run, sync, got)
        assert got == r[twin + "/" + sync], (run, sync)
        received = dict(map(tuple, got))
        assert len(received) == len(got), (run, sync)  # (each name once)
        assert all(full[n] == d for n, d in received.items()), (run, sync)
        missing = set(full) - set(received)
        assert missing == (ROOT_OWN if sync == "vllm_sync_grpo" else set()), (run, sync, missing)


ROOT_OWN = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def _torch_twin(r: dict[str, Any], run: str) -> str:
    """torch's run to compare ``run`` with: the same kind; a full fine-tune with
    the same ``use_orig_params`` (its gradient norms group differently)."""
    algo, _, kind, _, uop = run.split("/")
    return f"{algo}/torch/{kind}/SHARDED_STATE_DICT/{uop if kind == 'full' else True}"


@pytest.mark.framework_scenario("trl_sft")
def test_sft_trainer(request: pytest.FixtureRequest) -> None:
    for rank, r in enumerate(results(request)):
        ours = _rows(r, "sft/ours/")
        assert len(ours) == 8, ours
        for run in ours:
            kind = run.split("/")[2]
            _check_ours(r, run, rank, kind)
            assert r[run + "/losses"] == r[_torch_twin(r, run) + "/losses"], (run, r)
            if kind != "full":
                zeroed, after = r[run + "/load_adapter"]
                assert zeroed[0] == zeroed[1] > 0 and after == 0.0, (run, rank, zeroed, after)
        theirs = "sft/torch/lora/SHARDED_STATE_DICT/True"
        assert r[theirs + "/class"].startswith("torch.distributed.fsdp"), r
        # torch's FSDP1 with PEFT as shipped: the resume restores no adapter
        assert r[theirs + "/resumed_vs_whole"] > 0, r


@pytest.mark.framework_scenario("trl_rl")
def test_dpo_and_grpo_trainers(request: pytest.FixtureRequest) -> None:
    for rank, r in enumerate(results(request)):
        for algo in ("dpo", "grpo"):
            ours = _rows(r, f"{algo}/ours/")
            assert len(ours) == 3, ours
            for run in ours:
                kind = run.split("/")[2]
                _check_ours(r, run, rank, kind)
                # the reference model: TRL's own FSDP unit (full), the adapter disabled (PEFT)
                assert r[run + "/ref"] == ("fsdp_wrap.fully_sharded_data_parallel"
                                           if kind == "full" else None), (run, r[run + "/ref"])
                twin = _torch_twin(r, run)  # (every kind has one: LoRA, QLoRA, full)
                assert r[twin + "/class"].startswith("torch.distributed.fsdp"), (twin, r)
                assert r[run + "/losses"] == r[twin + "/losses"], (run, r)
                if algo == "grpo" and kind == "full":
                    _check_weight_syncs(r, run, twin)
                if algo == "grpo":
                    calls, nbytes = r[run + "/gathers_per_token"]
                    t_calls, t_bytes = r[twin + "/gathers_per_token"]
                    assert calls > 0 and nbytes > 0, (run, calls, nbytes)  # (counted at all)
                    assert calls <= t_calls and nbytes <= t_bytes, (run, calls, nbytes, t_calls, t_bytes)
