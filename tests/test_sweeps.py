"""A failure on one rank of a sweep is reported within seconds, with its message.

Every multi-configuration sweep of the suite is listed in :data:`SWEEPS` and
run here twice on its configuration 0, with a failure injected on the last
rank (see :mod:`tests._sweep`):

* ``mismatch``: the first comparison reports a difference on that rank only.
  The sweep must stay in step (every decision that gates a collective is
  agreed across ranks: a rank skipping collectives the others enter hangs
  them, or ends the task with another collective count, which the pool
  detects), finish, and return the message from that rank alone.  All the
  sweeps of one world size run in one task.
* ``raise``: that comparison raises on that rank only.  The pool must report
  the exception and the configuration within seconds (its ``failure_grace``),
  not at its no-progress timeout.  Each such failure restarts the pool's
  processes, so the default suite raises in one sweep per world size and
  ``-m slow`` (CI) in every other sweep.
"""

from __future__ import annotations

import importlib
import os
import random
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch.distributed as dist

from tests._dist import DistPool, WorkerError, get_pool, progress
from tests._sweep import Injection

WORLD_SIZES = [2, 3, 4]
_SCRATCH = tempfile.TemporaryDirectory(prefix="fsdp_wrap_sweeps_")  # removed at exit


def _scratch() -> str:
    """A fresh directory for the sweeps that write checkpoints."""
    return tempfile.mkdtemp(dir=_SCRATCH.name)

# A failure must be reported well before the pool's 60 s no-progress timeout.
FAST = 30.0


def _flatten(results: list[Any]) -> list[list[str]]:
    """Per rank, the failure strings, whatever shape the sweep returns."""
    out = []
    for res in results:
        if isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict):
            res = res[0]  # (failures, stats)
        out.append([f if isinstance(f, str) else " ".join(map(str, f)) for f in res])
    return out


def _parity_configs(ws: int, bucketed: bool) -> list[dict[str, Any]]:
    from tests import _parity_configs as tp

    configs = tp._configs(ws)
    if bucketed:  # the float64-bounded path
        return [c for c in configs if c["cap"] != 0.0][:2]
    return [c for c in configs if c["sd"]][:2]  # the agreed skip of the state-dict checks


# name -> (module, sweep function name, world size, configs() -> configs)
SWEEPS: dict[str, tuple[str, str, int, Callable[[], list[Any]]]] = {
    "parity-2": ("tests._parity_run", "_sweep", 2, lambda: _parity_configs(2, False)),
    "parity-3-bucketed": ("tests._parity_run", "_sweep", 3, lambda: _parity_configs(3, True)),
    # --- sweeps of the option tests (tests/_options_common.py users) ---
    "buckets-2": ("tests.test_buckets", "_sweep", 2,
                  lambda: importlib.import_module("tests.test_buckets")._configs(2)[:2]),
    "buckets-3": ("tests.test_buckets", "_sweep", 3,
                  lambda: [dict(c, reordered=True) for c in
                           importlib.import_module("tests.test_buckets")._configs(3)[:2]]),
    "gather-batch-2": ("tests.test_gather_batch", "_sweep", 2,
                       lambda: importlib.import_module("tests.test_gather_batch")._configs()[:2]),
    "gather-batch-3": ("tests.test_gather_batch", "_sweep", 3,
                       lambda: importlib.import_module("tests.test_gather_batch")._configs()[:2]),
    "schedule-2": ("tests.test_schedule", "_sweep", 2,
                   lambda: importlib.import_module("tests.test_schedule")._configs()[:2]),
    "comm-hooks-2": ("tests.test_comm_hooks", "_sweep", 2,
                     lambda: importlib.import_module("tests.test_comm_hooks")._configs()[:2]),
    "comm-hook-errors-4": ("tests.test_comm_hooks", "_errors", 4, lambda: ["twice", "hybrid"]),
    "cpu-offload-2": ("tests.test_cpu_offload", "_sweep", 2,
                      lambda: importlib.import_module("tests.test_cpu_offload")._configs()[:2]),
    "cpu-offload-state-dict-2": ("tests.test_cpu_offload", "_state_dict_and_summon_with_offload", 2,
                                 lambda: [False, True]),
    "gloo-collectives-2": ("tests.test_gloo_collectives", "_gathers_and_reductions", 2,
                           lambda: importlib.import_module("tests.test_gloo_collectives")._gloo_configs(2)[:2]),
    "gloo-collectives-3": ("tests.test_gloo_collectives", "_gathers_and_reductions", 3,
                           lambda: [c for c in importlib.import_module("tests.test_gloo_collectives")._gloo_configs(3)
                                    if c["numel"] == 1000 and not c["async_op"]]),  # the world, the subgroup
    "gloo-big-2": ("tests.test_gloo_collectives", "_sweep_big", 2,
                   lambda: importlib.import_module("tests.test_gloo_collectives")._big_configs()[:2]),
    "two-d-vs-torch-4": ("tests.test_two_d", "_vs_torch_sweep", 4,
                         lambda: importlib.import_module("tests.test_two_d")._torch_configs()[:2]),
    "two-d-replicated-4": ("tests.test_two_d", "_replicated_sweep", 4,
                           lambda: importlib.import_module("tests.test_two_d")._replicated_configs()[:2]),
    "two-d-formats-4": ("tests.test_two_d_state_dict", "_formats_sweep", 4,
                        lambda: importlib.import_module("tests.test_two_d_state_dict")._configs()[1:2]),
    "hybrid-vs-torch-4": ("tests.test_hybrid_shard", "_vs_torch_sweep", 4,
                          lambda: importlib.import_module("tests.test_hybrid_shard")._torch_configs()[:2]),
    "hybrid-replicated-4": ("tests.test_hybrid_shard", "_replicated_sweep", 4,
                            lambda: [dict(case="sync_states", form="mesh", uop=False),  # agreed gate before training
                                     dict(case="shard_size_one", strategy="HYBRID_SHARD", uop=False)]),
    "sync-module-states-2": ("tests.test_init_options", "_sync_module_states", 2,
                             lambda: importlib.import_module("tests.test_init_options")._sync_configs()[:2]),
    "meta-param-init-fn-2": ("tests.test_init_options", "_meta_param_init_fn_calls", 2,
                             lambda: [False, True]),
    "meta-default-init-2": ("tests.test_init_options", "_meta_default_reset_parameters", 2,
                            lambda: importlib.import_module("tests.test_init_options")._meta_default_configs()[:2]),
    "device-id-cpu-2": ("tests.test_init_options", "_device_id_cpu", 2,
                        lambda: importlib.import_module("tests.test_init_options")._device_id_configs()[:2]),
    "mixed-precision-2": ("tests.test_mixed_precision", "_sweep", 2,
                          lambda: importlib.import_module("tests.test_mixed_precision")._configs()[:2]),
    "module-conversion-2": ("tests.test_module_conversion", "_convert_sweep", 2,
                            lambda: importlib.import_module("tests.test_module_conversion")._convert_configs()[:2]),
    "ckpt-wrapper-state-dict-2": ("tests.test_module_conversion", "_ckpt_wrapper_sweep", 2,
                                  lambda: [dict(strategy="FULL_SHARD", uop=True, sd_type="LOCAL_STATE_DICT"),
                                           dict(strategy="FULL_SHARD", uop=False, sd_type="FULL_STATE_DICT")]),
    "quantized-2": ("tests.test_quantized_collectives", "_sweep", 2,
                    lambda: importlib.import_module("tests.test_quantized_collectives")._configs(2)[:2]),
    "quantized-4": ("tests.test_quantized_collectives", "_sweep", 4,
                    lambda: importlib.import_module("tests.test_quantized_collectives")._configs(4)[:2]),
    "accumulation-4": ("tests.test_accumulation", "_sweep", 4,
                       lambda: importlib.import_module("tests.test_accumulation")._configs()[:2]),
    # --- the other sweeps ---
    "orig-params-writeback": ("tests.test_orig_params_writeback", "_sweep", 2,
                              lambda: importlib.import_module("tests.test_orig_params_writeback")._configs()[:2]),
    "robustness": ("tests.test_robustness", "_sweep", 2,
                   lambda: importlib.import_module("tests.test_robustness")._configs("several_forwards", [None])[:2]),
    "state-dict-buffers": ("tests.test_state_dict_buffers", "_sweep", 2,
                           lambda: importlib.import_module("tests.test_state_dict_buffers")._configs()[:2]),
    "summon-full-params": ("tests.test_summon_full_params", "_sweep", 2,
                           lambda: importlib.import_module("tests.test_summon_full_params")._configs()[:2]),
    "split-flat": ("tests.test_split_flat", "_sweep", 2,
                   lambda: importlib.import_module("tests.test_split_flat")._configs(2)[:2]),
    "summon-frozen": ("tests.test_summon_requires_grad", "_frozen_sweep", 2,
                      lambda: importlib.import_module("tests.test_summon_requires_grad")._frozen_configs()[:2]),
    "summon-with-grads": ("tests.test_summon_requires_grad", "_with_grads_sweep", 2,
                          lambda: importlib.import_module("tests.test_summon_requires_grad")._with_grads_configs()[:2]),
    "framework-private": ("tests.test_framework_private", "_sweep", 2,
                          lambda: importlib.import_module("tests.test_framework_private")._configs()[:2]),
    "orphan-units": ("tests.test_orphan_units", "_sweep", 2,
                     lambda: importlib.import_module("tests.test_orphan_units")._configs()[:2]),
    "overlap": ("tests.test_overlap", "_sweep", 2, lambda: importlib.import_module("tests.test_overlap")._configs()[:2]),
    "profiler-labels": ("tests.test_profiler_labels", "_sweep", 2,
                        lambda: importlib.import_module("tests.test_profiler_labels")._configs()[:2]),
    "explicit-vs-fsdp2": ("tests.test_explicit_controls", "_sweep_fsdp2", 2,
                          lambda: importlib.import_module("tests.test_explicit_controls").FSDP2_MODES[:2]),
    "explicit-vs-defaults": ("tests.test_explicit_controls", "_sweep_defaults", 2,
                             lambda: importlib.import_module("tests.test_explicit_controls").DEFAULT_CONFIGS[:2]),
    "sharded-no-gather": ("tests.test_sharded_no_gather", "_sweep", 2,
                          lambda: importlib.import_module("tests.test_sharded_no_gather")._configs()[:2]),
    "state-dict-formats": ("tests.test_state_dict", "_formats_match_torch", 2,
                           lambda: importlib.import_module("tests.test_state_dict")._formats_configs(("seq",))[:2]),
    "state-dict-round-trips": ("tests.test_state_dict", "_round_trips", 2,
                               lambda: importlib.import_module("tests.test_state_dict")._round_trip_configs()[:2]),
    "state-dict-dcp-interop": ("tests.test_state_dict", "_dcp_interop", 2,
                               lambda: importlib.import_module("tests.test_state_dict")._dcp_interop_configs(
                                   _scratch())[:2]),
    "hybrid-formats-4": ("tests.test_state_dict_hybrid", "_formats_match_torch", 4,
                         lambda: importlib.import_module("tests.test_state_dict_hybrid")._formats_configs()[:2]),
    "hybrid-round-trips-4": ("tests.test_state_dict_hybrid", "_round_trips", 4,
                             lambda: importlib.import_module("tests.test_state_dict_hybrid")._round_trip_configs()[:2]),
    "hybrid-dcp-save-4": ("tests.test_state_dict_hybrid", "_dcp_save_hybrid", 4,
                          lambda: importlib.import_module("tests.test_state_dict_hybrid")._dcp_save_configs(
                              _scratch())[:2]),
    "optim-formats": ("tests.test_optim_state_dict", "_formats_match_torch", 2,
                      lambda: importlib.import_module("tests.test_optim_state_dict")._formats_configs()[:2]),
    "optim-round-trips": ("tests.test_optim_state_dict", "_round_trips", 2,
                          lambda: importlib.import_module("tests.test_optim_state_dict")._round_trip_configs()[:2]),
    "checkpoint-interop": ("tests.test_checkpoint_interop", "_interop", 2,
                           lambda: importlib.import_module("tests.test_checkpoint_interop")._interop_configs(
                               _scratch())[:2]),
    "checkpoint-around-units": ("tests.test_checkpoint_around_units", "_around_units_match_torch", 2,
                                lambda: importlib.import_module("tests.test_checkpoint_around_units")._configs()[:2]),
    "module-api": ("tests.test_module_api", "_run_checks", 2, lambda: ["apply", "ignored"]),
    "framework-upcast": ("tests.test_framework_surface", "_upcast_after_wrap", 2,
                         lambda: importlib.import_module("tests.test_framework_surface")._upcast_configs()[:2]),
    "framework-lazy-load": ("tests.test_framework_surface", "_full_load_tensor_likes", 2,
                            lambda: importlib.import_module("tests.test_framework_surface")._lazy_configs()[:2]),
    "summon-between-forwards": ("tests.test_summon_full_params", "_between_two_forwards", 2,
                                lambda: importlib.import_module("tests.test_summon_full_params")._between_configs()[:2]),
    "optim-order": ("tests.test_optim_state_dict_torch_cases", "_sharded_state_order", 2,
                    lambda: importlib.import_module("tests.test_optim_state_dict_torch_cases")._order_configs()[:2]),
    "optim-no-param-groups": ("tests.test_optim_state_dict_torch_cases", "_without_param_groups", 2,
                              lambda: importlib.import_module(
                                  "tests.test_optim_state_dict_torch_cases")._no_groups_configs()[:2]),
    "optim-named": ("tests.test_optim_state_dict_torch_cases", "_named_optimizer", 2,
                    lambda: importlib.import_module("tests.test_optim_state_dict_torch_cases")._named_configs()[:2]),
    "torch-suite-named-load": ("tests.test_torch_suite_cases", "_named_load", 2,
                               lambda: importlib.import_module("tests.test_torch_suite_cases")._named_configs()[:2]),
    "torch-suite-no-groups": ("tests.test_torch_suite_cases", "_no_groups", 2,
                              lambda: importlib.import_module("tests.test_torch_suite_cases")._no_groups_configs()[:2]),
    "torch-suite-unmanaged": ("tests.test_torch_suite_cases", "_unmanaged", 2,
                              lambda: importlib.import_module("tests.test_torch_suite_cases")._unmanaged_configs()[:2]),
    "torch-suite-grads-writeback": ("tests.test_torch_suite_cases", "_grads_writeback", 2,
                                    lambda: importlib.import_module(
                                        "tests.test_torch_suite_cases")._grads_configs()[:2]),
}


def _by_world_size(ws: int) -> list[tuple[str, str, str, list[Any]]]:
    """``(name, module, function, [configuration 0])`` of every sweep on ``ws`` ranks."""
    out = []
    for name, (module, fn, size, configs) in sorted(SWEEPS.items()):
        if size == ws:
            out.append((name, module, fn, configs()[:1]))
    return out


def _inject_each(entries: list[tuple[str, str, str, list[Any]]]) -> list[tuple[str, list[str], float]]:
    """Worker side: each sweep on its configuration 0 with a mismatch injected
    on the last rank; per sweep, this rank's failures and seconds."""
    bad = dist.get_world_size() - 1
    out = []
    for name, module, fn, configs in entries:
        t0 = time.monotonic()
        result = getattr(importlib.import_module(module), fn)(
            configs, inject=Injection(bad, 0, "mismatch")
        )
        out.append((name, _flatten([result])[0], time.monotonic() - t0))
        progress()
    return out


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_one_rank_mismatch_is_reported_and_the_sweeps_stay_in_step(ws: int) -> None:
    """Every sweep on ``ws`` ranks, one task: the difference injected on the last
    rank comes back from that rank alone, nothing else fails, and the ranks end
    the task with the same collective count (else the pool would restart)."""
    entries = _by_world_size(ws)
    assert entries
    pool = get_pool(ws)
    generation = pool.generation
    per_rank = pool.run(_inject_each, entries)
    assert pool.generation == generation, "ranks ended out of step: the pool was restarted"
    bad, problems = ws - 1, []
    for i, (name, *_rest) in enumerate(entries):
        for rank in range(ws):
            got_name, fails, seconds = per_rank[rank][i]
            assert got_name == name
            expected = f"injected mismatch on rank {bad} at "
            if rank == bad and not (len(fails) == 1 and expected in fails[0]):
                problems.append(f"{name}: rank {rank} reported {fails}")
            if rank != bad and fails:
                problems.append(f"{name}: rank {rank} reported {fails}")
            if seconds > FAST:
                problems.append(f"{name}: took {seconds:.1f}s on rank {rank}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module", params=WORLD_SIZES)
def quick_pool(request: pytest.FixtureRequest) -> Iterator[DistPool]:
    """The shared pool, waiting only 0.2 s for the other ranks once one raised
    (it waits 5 s otherwise: this test makes every sweep raise); no pool of its
    own to start."""
    pool = get_pool(request.param)
    grace, pool.failure_grace = pool.failure_grace, 0.2
    yield pool
    pool.failure_grace = grace


# One sweep per world size for the default suite; every other sweep under
# ``-m slow`` (each raise costs a pool restart).
REPRESENTATIVES = {"parity-2", "parity-3-bucketed", "hybrid-vs-torch-4"}


def _check_raises(pool: DistPool, names: set[str] | None, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """Each chosen sweep on the pool's world size, configuration 0, raising on
    the last rank at its first comparison: reported with the message and the
    configuration, well before the pool's no-progress timeout."""
    ws = pool.world_size
    bad, problems = ws - 1, []
    entries = [e for e in _by_world_size(ws) if (names is None or e[0] in names) and e[0] not in skip]
    assert entries
    for name, module, fn, configs in entries:
        sweep = getattr(importlib.import_module(module), fn)
        t0 = time.monotonic()
        try:
            pool.run(sweep, configs, inject=Injection(bad, 0, "raise"))
        except WorkerError as e:
            msg = str(e)
            if f"[rank {bad}] tests._sweep.InjectedFailure: injected raise on rank {bad} at " not in msg:
                problems.append(f"{name}: the message is not in the report:\n{msg[-2000:]}")
            if f"[rank {bad}] configuration 0 raised: " not in msg:
                problems.append(f"{name}: the configuration is not named in the report")
        else:
            problems.append(f"{name}: the injected exception was not reported")
        if time.monotonic() - t0 > FAST:
            problems.append(f"{name}: reported after {time.monotonic() - t0:.1f}s")
    assert not problems, "\n".join(problems)


def test_one_rank_exception_is_reported_within_seconds(quick_pool: DistPool) -> None:
    _check_raises(quick_pool, REPRESENTATIVES)


def _raise_sample(ws: int) -> set[str] | None:
    """The sweeps the slow raise test covers this run on ``ws`` ranks: a third of
    those not in ``REPRESENTATIVES``, seeded by ``$FSDP_WRAP_SWEEP_SEED``, else
    the day's date (successive CI runs take other thirds; ``all`` takes every
    one).  Each raise restarts the pool's ranks, about 1 s of CPU a sweep."""
    seed = os.environ.get("FSDP_WRAP_SWEEP_SEED") or time.strftime("%Y%m%d")
    if seed == "all":
        return None
    names = sorted(e[0] for e in _by_world_size(ws) if e[0] not in REPRESENTATIVES)
    chosen = random.Random(f"{seed}-{ws}").sample(names, max(1, -(-len(names) // 3)))
    print(f"seed {seed}: raising in {sorted(chosen)} of {len(names)} sweeps")
    return set(chosen)


@pytest.mark.slow
def test_one_rank_exception_is_reported_within_seconds_in_every_sweep(quick_pool: DistPool) -> None:
    """Every other sweep (the default suite's test raises in the representatives),
    a seeded third of them a run (``_raise_sample``, to keep CI inside its
    time): an exception is caught and reported by the harness, the same code
    for every sweep; what each sweep does itself around a failing rank (its
    collectives staying in step) the default suite's mismatch test checks in
    every sweep, every run."""
    _check_raises(quick_pool, _raise_sample(quick_pool.world_size), skip=REPRESENTATIVES)
