"""A failure on one rank of a sweep is reported within seconds, with its message.

Every multi-configuration sweep of the suite is listed in :data:`SWEEPS` and
run here twice on a few of its configurations, with a failure injected on one
rank (see :mod:`tests._sweep`):

* ``mismatch``: the first comparison of configuration 0 reports a difference
  on that rank only.  The sweep must stay in step (every decision that gates a
  collective is agreed across ranks), finish, and return the message from
  that rank; the next configuration must still pass.
* ``raise``: that comparison raises on that rank only.  The pool must report
  the exception and the configuration within seconds (its ``failure_grace``),
  not at its no-progress timeout.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

import pytest

from tests._dist import WorkerError, get_pool
from tests._sweep import Injection

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
    from tests import test_parity as tp

    configs = tp._configs(ws)
    if bucketed:  # the float64-bounded path
        return [c for c in configs if c["cap"] != 0.0][:2]
    return [c for c in configs if c["sd"]][:2]  # the agreed skip of the state-dict checks


# name -> (module, sweep function name, world size, configs() -> configs)
SWEEPS: dict[str, tuple[str, str, int, Callable[[], list[Any]]]] = {
    "parity-2": ("tests.test_parity", "_sweep", 2, lambda: _parity_configs(2, False)),
    "parity-3-bucketed": ("tests.test_parity", "_sweep", 3, lambda: _parity_configs(3, True)),
    # --- sweeps of the option tests (tests/_options_common.py users) ---
    "buckets-2": ("tests.test_buckets", "_sweep", 2,
                  lambda: importlib.import_module("tests.test_buckets")._configs(2)[:2]),
    "buckets-3": ("tests.test_buckets", "_sweep", 3,
                  lambda: [dict(c, tol=1e-6) for c in
                           importlib.import_module("tests.test_buckets")._configs(3)[:2]]),
    "gather-batch-2": ("tests.test_gather_batch", "_sweep", 2,
                       lambda: importlib.import_module("tests.test_gather_batch")._configs()[:2]),
    "gather-batch-3": ("tests.test_gather_batch", "_sweep", 3,
                       lambda: importlib.import_module("tests.test_gather_batch")._configs()[:2]),
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
    # --- the other sweeps ---
    "orig-params-writeback": ("tests.test_orig_params_writeback", "_sweep", 2,
                              lambda: importlib.import_module("tests.test_orig_params_writeback")._configs()[:2]),
    "robustness": ("tests.test_robustness", "_sweep", 2,
                   lambda: importlib.import_module("tests.test_robustness")._configs("several_forwards", [None])[:2]),
    "state-dict-buffers": ("tests.test_state_dict_buffers", "_sweep", 2,
                           lambda: importlib.import_module("tests.test_state_dict_buffers")._configs()[:2]),
    "summon-full-params": ("tests.test_summon_full_params", "_sweep", 2,
                           lambda: importlib.import_module("tests.test_summon_full_params")._configs()[:2]),
    "summon-frozen": ("tests.test_summon_requires_grad", "_frozen_sweep", 2,
                      lambda: importlib.import_module("tests.test_summon_requires_grad")._frozen_configs()[:2]),
    "summon-with-grads": ("tests.test_summon_requires_grad", "_with_grads_sweep", 2,
                          lambda: importlib.import_module("tests.test_summon_requires_grad")._with_grads_configs()[:2]),
    "overlap": ("tests.test_overlap", "_sweep", 2, lambda: importlib.import_module("tests.test_overlap")._configs()[:2]),
    "sharded-no-gather": ("tests.test_sharded_no_gather", "_sweep", 2,
                          lambda: importlib.import_module("tests.test_sharded_no_gather")._configs()[:2]),
    "state-dict-formats": ("tests.test_state_dict", "_formats_match_torch", 2,
                           lambda: importlib.import_module("tests.test_state_dict")._formats_configs(("seq",))[:2]),
    "state-dict-round-trips": ("tests.test_state_dict", "_round_trips", 2,
                               lambda: importlib.import_module("tests.test_state_dict")._round_trip_configs()[:2]),
    "state-dict-dcp-interop": ("tests.test_state_dict", "_dcp_interop", 2,
                               lambda: importlib.import_module("tests.test_state_dict")._dcp_interop_configs(
                                   importlib.import_module("tempfile").mkdtemp(prefix="sweep-"))[:2]),
    "hybrid-formats-4": ("tests.test_state_dict_hybrid", "_formats_match_torch", 4,
                         lambda: importlib.import_module("tests.test_state_dict_hybrid")._formats_configs()[:2]),
    "hybrid-round-trips-4": ("tests.test_state_dict_hybrid", "_round_trips", 4,
                             lambda: importlib.import_module("tests.test_state_dict_hybrid")._round_trip_configs()[:2]),
    "hybrid-dcp-save-4": ("tests.test_state_dict_hybrid", "_dcp_save_hybrid", 4,
                          lambda: importlib.import_module("tests.test_state_dict_hybrid")._dcp_save_configs(
                              importlib.import_module("tempfile").mkdtemp(prefix="sweep-"))[:2]),
    "optim-formats": ("tests.test_optim_state_dict", "_formats_match_torch", 2,
                      lambda: importlib.import_module("tests.test_optim_state_dict")._formats_configs()[:2]),
    "optim-round-trips": ("tests.test_optim_state_dict", "_round_trips", 2,
                          lambda: importlib.import_module("tests.test_optim_state_dict")._round_trip_configs()[:2]),
    "checkpoint-interop": ("tests.test_checkpoint_interop", "_interop", 2,
                           lambda: importlib.import_module("tests.test_checkpoint_interop")._interop_configs(
                               importlib.import_module("tempfile").mkdtemp(prefix="sweep-"))[:2]),
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
}


def _sweep_fn(name: str) -> tuple[Callable[..., Any], int, list[Any]]:
    module, fn, ws, configs = SWEEPS[name]
    return getattr(importlib.import_module(module), fn), ws, configs()


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_one_rank_mismatch_is_reported_and_the_sweep_stays_in_step(name: str) -> None:
    fn, ws, configs = _sweep_fn(name)
    assert len(configs) >= 2, "inject into configuration 0, then see 1 pass"
    bad = ws - 1
    t0 = time.monotonic()
    per_rank = _flatten(get_pool(ws).run(fn, configs, inject=Injection(bad, 0, "mismatch")))
    assert time.monotonic() - t0 < FAST + 10 * len(configs)
    expected = f"injected mismatch on rank {bad} at "
    for rank, fails in enumerate(per_rank):
        assert not any("was never reached" in f for f in fails), fails
        if rank == bad:
            assert len(fails) == 1 and expected in fails[0], fails
        else:
            assert fails == [], (rank, fails)


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_one_rank_exception_is_reported_within_seconds(name: str) -> None:
    fn, ws, configs = _sweep_fn(name)
    bad = ws - 1
    pool = get_pool(ws)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(fn, configs, inject=Injection(bad, 0, "raise"))
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert f"[rank {bad}] tests._sweep.InjectedFailure: injected raise on rank {bad} at " in msg
    assert f"[rank {bad}] configuration 0 raised: " in msg
    assert elapsed < FAST, f"reported after {elapsed:.1f}s"
