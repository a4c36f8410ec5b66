"""Ready for torch's legacy optimizer-state APIs to go (PyTorch PR #191712).

With torch's FSDP1 changed as that PR proposes (simulated by
:mod:`tests._torch_future`: ``full_optim_state_dict`` & co raise
``NotImplementedError``), code calling those functions through fsdp_wrap, and
through torch's names under ``fsdp_wrap.install()`` (what the frameworks and
unchanged scripts do), gives the same results as with torch untouched.  The
framework runs (``tests/test_frameworks.py``) run with the same change made in
every rank (``tests/frameworks/_common.py``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from tests import _ckpt_common as C
from tests._torch_future import LEGACY_OPTIM_APIS, legacy_optim_apis_removed, torch_fsdp1_class


def _describe(osd: dict[str, Any]) -> Any:
    if not osd:
        return osd
    return ({k: C.describe_sd(v) for k, v in osd["state"].items()}, osd["param_groups"])


def _legacy_calls(mod: Any, uop: bool) -> dict[str, Any]:
    """Every legacy optimizer-state call on a model built and trained through
    ``mod`` (``fsdp_wrap``, or ``torch.distributed.fsdp`` under install()),
    each described, and each load checked against the optimizer's own state."""
    fsdp = mod.FullyShardedDataParallel
    model = fsdp(C.make_model("seq"), auto_wrap_policy=mod.wrap.ModuleWrapPolicy({nn.Linear}),
                 device_id=C.CPU, use_orig_params=uop)
    assert type(model) is fsdp_wrap.FullyShardedDataParallel, type(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    C.train(model, optim, "seq", range(2))
    local = _describe(optim.state_dict())
    full0 = fsdp.full_optim_state_dict(model, optim)  # rank 0 only
    full = fsdp.full_optim_state_dict(model, optim, rank0_only=False)
    sharded = fsdp.sharded_optim_state_dict(model, optim)
    loads = {
        "shard_full": fsdp.shard_full_optim_state_dict(full, model, optim=optim),
        "scatter_full": fsdp.scatter_full_optim_state_dict(full0 or None, model, optim=optim),
        "flatten_sharded": fsdp.flatten_sharded_optim_state_dict(sharded, model, optim),
    }
    out: dict[str, Any] = {"full0": _describe(full0), "full": _describe(full),
                           "sharded": _describe(sharded)}
    for name, osd in loads.items():
        out[name + " == local"] = _describe(osd) == local
        optim.load_state_dict(osd)  # loads as it is
    # Re-keyed for a plain model's optimizer and back (Lightning's use): no FSDP
    # unit involved, torch's FSDP1 class method all the same.
    plain = C.make_model("seq")
    by_id = fsdp.rekey_optim_state_dict(full, mod.OptimStateKeyType.PARAM_ID, plain)
    by_name = fsdp.rekey_optim_state_dict(by_id, mod.OptimStateKeyType.PARAM_NAME, plain)
    out["rekey"] = (_describe(by_id), _describe(by_name) == out["full"])
    out["losses"] = C.train(model, optim, "seq", range(2, 4))
    return out


def _with_and_without_torch_legacy(uop: bool) -> list[str]:
    problems: list[str] = []
    expected = _legacy_calls(fsdp_wrap, uop)  # torch's FSDP1 as installed
    with legacy_optim_apis_removed():
        torch_cls = torch_fsdp1_class()
        for name in LEGACY_OPTIM_APIS:  # the simulation is in effect
            with pytest.raises(NotImplementedError):
                getattr(torch_cls, name)(None, None)
        if _legacy_calls(fsdp_wrap, uop) != expected:
            problems.append("fsdp_wrap's legacy calls changed")
        # A module that imported torch's class before install() (as frameworks do).
        early = types.ModuleType("_early_fsdp1_user")
        early.FSDP = torch_cls  # type: ignore[attr-defined]
        sys.modules[early.__name__] = early
        fsdp_wrap.install(verbose=False)
        try:
            import torch.distributed.fsdp as tfsdp

            if early.FSDP is not fsdp_wrap.FullyShardedDataParallel:  # type: ignore[attr-defined]
                problems.append("a module's early import of torch's class was not rebound")
            if _legacy_calls(tfsdp, uop) != expected:
                problems.append("the legacy calls through torch's names under install() changed")
        finally:
            fsdp_wrap.uninstall()
            del sys.modules[early.__name__]
    return [f"rank {dist.get_rank()} uop={uop}: {p}" for p in problems]


@pytest.mark.parametrize("uop", [False, True])
def test_legacy_optim_apis_work_with_torchs_removed(pool2: Any, uop: bool) -> None:
    assert pool2.run(_with_and_without_torch_legacy, uop) == [[], []]
