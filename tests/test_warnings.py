"""Warnings torch's FSDP1 gives, given by fsdp_wrap too (2 ranks, torch as the oracle).

* A root that is an ``nn.ModuleList``/``nn.ModuleDict`` (no forward): a
  UserWarning with torch's phrase; ours names the rank and the children by
  clean FQN instead of printing a repr that spells out FSDP's internals.
* The legacy optimizer-state-dict APIs: torch's FutureWarning that the API is
  deprecated, and the FutureWarning for the deprecated ``optim_input``
  argument, for the same calls as torch; attributed to the caller's line.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import fsdp_api, fsdp_cls, fsdp_kwargs, wrap_api

CONTAINER_PHRASE = "FSDP will not all-gather parameters for containers that do not implement forward"
OPTIM_INPUT_PHRASE = "The `optim_input` argument is deprecated"
LEGACY_PHRASE = "is being deprecated and is replaced by"


def _container_warnings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for impl in ("torch", "ours"):
        cls = fsdp_cls(impl)
        inner = cls(nn.Linear(3, 3), **fsdp_kwargs(impl))
        for container in (nn.ModuleList([nn.Linear(3, 3), inner]), nn.ModuleDict({"a": inner})):
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                cls(container, **fsdp_kwargs(impl))
            out.setdefault(impl, []).extend(
                str(w.message) for w in rec
                if issubclass(w.category, UserWarning) and CONTAINER_PHRASE in str(w.message)
            )
    return out


def test_container_root_warns_with_clean_names(pool2: Any) -> None:
    for rank, out in enumerate(pool2.run(_container_warnings)):
        assert len(out["torch"]) == len(out["ours"]) == 2, out
        for msg in out["ours"]:
            assert f"[rank {rank}]" in msg, msg
            assert "_fsdp_wrapped_module" not in msg, msg
        assert "ModuleList (children ['0', '1'])" in out["ours"][0], out["ours"][0]
        assert "ModuleDict (children ['a'])" in out["ours"][1], out["ours"][1]


Recorded = list[tuple[str, str, bool]]  # (category, phrase, attributed to this file)


def _legacy_optim_warnings() -> dict[str, dict[str, Recorded]]:
    return {impl: _legacy_optim_warnings_of(impl) for impl in ("torch", "ours")}


def _legacy_optim_warnings_of(impl: str) -> dict[str, Recorded]:
    api = fsdp_api(impl)
    fsdp = api.FullyShardedDataParallel
    torch.manual_seed(0)
    model = fsdp(
        nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)),
        auto_wrap_policy=wrap_api(impl).ModuleWrapPolicy({nn.Linear}),
        **fsdp_kwargs(impl),
    )
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    params = list(model.parameters())
    res: dict[str, Recorded] = {}

    def record(name: str, fn: Any, may_raise: bool = False) -> Any:
        value = None
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            try:
                value = fn()
            except RuntimeError:  # torch's rekey of flat params; its warning came first
                if not may_raise:
                    raise
        res[name] = sorted(
            (w.category.__name__, phrase, w.filename == __file__)
            for w in rec
            for phrase in (OPTIM_INPUT_PHRASE, LEGACY_PHRASE)
            if phrase in str(w.message)
        )
        return value

    full = record("full", lambda: fsdp.full_optim_state_dict(
        model, optim, optim_input=params, rank0_only=False))
    record("full_no_input", lambda: fsdp.full_optim_state_dict(model, optim, rank0_only=False))
    sharded = record("sharded", lambda: fsdp.sharded_optim_state_dict(model, optim))
    record("shard_full", lambda: fsdp.shard_full_optim_state_dict(full, model, optim_input=params))
    record("scatter_full", lambda: fsdp.scatter_full_optim_state_dict(
        full if dist.get_rank() == 0 else None, model, optim_input=params))
    record("flatten_sharded", lambda: fsdp.flatten_sharded_optim_state_dict(sharded, model, optim))
    record("rekey", lambda: fsdp.rekey_optim_state_dict(
        full, api.OptimStateKeyType.PARAM_ID, model, optim_input=params), may_raise=True)
    record("rekey_optim", lambda: fsdp.rekey_optim_state_dict(
        full, api.OptimStateKeyType.PARAM_ID, model, optim=optim), may_raise=True)
    return res


def test_legacy_optim_apis_warn_as_torch(pool2: Any) -> None:
    for out in pool2.run(_legacy_optim_warnings):
        torch_res, ours = out["torch"], out["ours"]
        for call, expected in torch_res.items():
            # Same warnings (category, phrase) for every call; ours point at the caller.
            assert [w[:2] for w in ours[call]] == [w[:2] for w in expected], (call, ours, torch_res)
            assert all(w[2] for w in ours[call]), (call, ours[call])
        # The oracle does warn (the comparison is not vacuous).
        assert any(w[1] == OPTIM_INPUT_PHRASE for w in torch_res["full"]), torch_res
        assert any(w[1] == LEGACY_PHRASE for w in torch_res["sharded"]), torch_res


# --------------------------------------------------------------- ranks as threads


def _on_threaded_ranks(fn: Any, world: int = 2) -> dict[int, str]:
    """``fn(rank)`` on ``world`` threads of this process, each a rank of torch's
    threaded process group (what torch's ``FSDPTestMultiThread`` tests use);
    returns each rank's outcome (``"ok"`` or the exception's repr)."""
    import threading

    import torch.testing._internal.distributed.multi_threaded_pg as mtp

    isolation = torch._C._distributed_c10d._set_thread_isolation_mode
    isolation(True)
    mtp._install_threaded_pg()
    store = dist.HashStore()
    results: dict[int, str] = {}

    def body(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            fn(rank)
            results[rank] = "ok"
        except BaseException as e:  # noqa: BLE001  (reported to the test)
            results[rank] = repr(e)
            mtp.ProcessLocalGroup.exception_handle(e)  # wake the peers up
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        mtp.ProcessLocalGroup.reset()
        mtp._uninstall_threaded_pg()
        isolation(False)
    return results


def test_container_warning_reaches_every_thread_rank() -> None:
    """Each rank's own ``catch_warnings`` gets its warning when ranks are threads.

    ``warnings.catch_warnings`` is process-wide (before Python 3.14): a thread
    entering it replaces the other's record.  Rank 1 enters its block while
    rank 0 is inside FSDP's constructor, held in a collective there
    (``sync_module_states``) until rank 1 joins it.  The warning is issued
    before anything that can block, so rank 0's warning is already in rank 0's
    record when rank 1's block begins (it used to be issued at the end of the
    constructor, where it landed in rank 1's record: torch's
    ``test_fsdp_unsupported_module_cls`` then failed in 2 runs of 3).
    """
    import threading
    import time


    cls = fsdp_cls("ours")  # imported here: an import inside rank 0's block would be the wait
    turns = [threading.Event(), threading.Event()]

    def construct(rank: int) -> None:
        for turn, container in zip(
            turns, (nn.ModuleList([nn.Linear(3, 3)]), nn.ModuleDict({"a": nn.Linear(3, 3)}))
        ):
            if rank == 1:
                turn.wait(timeout=60)
                time.sleep(0.5)  # rank 0 is now waiting in the constructor's broadcast
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                if rank == 0:
                    turn.set()
                cls(container, sync_module_states=True)
            got = [str(w.message) for w in rec if CONTAINER_PHRASE in str(w.message)]
            if len(got) != 1 or f"[rank {rank}]" not in got[0]:
                raise AssertionError(f"rank {rank} recorded {got}")
            dist.barrier()  # both blocks closed before the next turn

    assert _on_threaded_ranks(construct) == {0: "ok", 1: "ok"}
