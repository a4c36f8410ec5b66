"""The unit's state object: one settings object, phases checked in one place.

* A unit's state is a plain object the façade holds (not the module); its
  handles hold the same settings object, and torch's attribute names on the
  module read it.
* The handle's phase follows torch's FSDP1's (``handle._training_state`` at
  the same points of a step, side by side with torch's on the same model).
* The unit's phase check (``expect_state``) raises torch's type and
  sentence, then the rank, the unit, the call, the states and the fix; the
  handle's check (``_expect``) refuses what relies on an unsharded flat
  parameter while it is sharded, and a summon entered from another phase.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_wrap
from fsdp_wrap.handle.flat_tensor import HandleTrainingState
from fsdp_wrap.runtime.state import UnitState, state_of
from fsdp_wrap.wrap import ModuleWrapPolicy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _torch_fsdp(model: nn.Module, uop: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as TFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TMWP

    return TFSDP(model, auto_wrap_policy=TMWP({nn.Linear}), use_orig_params=uop,
                 device_id=torch.device("cpu"))


def _ours(model: nn.Module, uop: bool) -> nn.Module:
    return fsdp_wrap.FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=uop)


def _phases(model: nn.Module) -> list[str]:
    """The first unit's handle phase: inside its forward, in backward once its
    output's gradient arrived, after backward."""
    unit = model.module[0]  # type: ignore[index]
    seen: list[str] = []
    inner = unit.module
    inner.register_forward_pre_hook(lambda *a: seen.append(unit._handle._training_state.name))
    out = model(torch.randn(2, 4))
    mid = out  # (the first unit's own output is inside the model: hook the loss path)
    mid.register_hook(lambda g: seen.append(unit._handle._training_state.name))
    mid.sum().backward()
    seen.append(unit._handle._training_state.name)
    return seen


def _side_by_side() -> list[Any]:
    warnings.simplefilter("ignore")
    out = []
    for uop in (False, True):
        theirs = _phases(_torch_fsdp(_model(), uop))
        ours_model = _ours(_model(), uop)
        ours = _phases(ours_model)
        st = state_of(ours_model)
        settings_shared = all(h.config is s.settings for s in (state_of(m) for m in
                              fsdp_wrap.FullyShardedDataParallel.fsdp_modules(ours_model))
                              if s is not None for h in s._handles)
        out.append(dict(
            uop=uop, theirs=theirs, ours=ours,
            plain=isinstance(st, UnitState) and not isinstance(st, nn.Module),
            shared=settings_shared,
            attrs=(ours_model.sharding_strategy is st.settings.strategy,  # type: ignore[union-attr]
                   ours_model._use_orig_params == uop,
                   ours_model.rank == dist.get_rank(),
                   ours_model._handle is None,  # (the root holds no parameter here)
                   ours_model.module[0]._handle is st._all_handles[0]),  # type: ignore[union-attr]
        ))
    return out


def test_state_object_and_handle_phases_follow_torch(pool2: Any) -> None:
    for rows in pool2.run(_side_by_side):
        for row in rows:
            assert row["plain"] and row["shared"] and all(row["attrs"]), row
            # torch's FSDP1 at the same three points
            assert row["ours"] == row["theirs"], row
            assert row["ours"][0] == "FORWARD" and row["ours"][-1] == "IDLE", row


def _checks() -> list[str]:
    warnings.simplefilter("ignore")
    model = _ours(_model(), False)
    out: list[str] = []
    unit = model.module[0]  # type: ignore[index]

    def clip_in_forward(*_: Any) -> None:
        try:
            model.clip_grad_norm_(1.0)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))

    hook = unit.module.register_forward_pre_hook(clip_in_forward)
    model(torch.randn(2, 4)).sum().backward()
    hook.remove()
    handle = unit._handle
    for call in (handle.write_back_unsharded, handle.use_unsharded_views):
        try:
            call()  # (sharded between steps)
            out.append("no error")
        except AssertionError as e:
            out.append(str(e))
    handle.enter(HandleTrainingState.FORWARD)
    try:
        with fsdp_wrap.FullyShardedDataParallel.summon_full_params(model):
            out.append("no error")
    except AssertionError as e:
        out.append(str(e))
    handle.enter(HandleTrainingState.IDLE)
    with fsdp_wrap.FullyShardedDataParallel.summon_full_params(model):
        out.append(handle._training_state.name)
    out.append(handle._training_state.name)
    return out


def test_phase_checks_name_what_was_expected_and_found(pool2: Any) -> None:
    for rank, (clip, write_back, views, summon, inside, after) in enumerate(pool2.run(_checks)):
        # torch's ValueError and sentence first (torch's clip_grad_norm_ checks IDLE too)
        assert clip.startswith("expected to be in states [<TrainingState.IDLE: 1>] but current "
                               "state is TrainingState.FORWARD_BACKWARD"), clip
        assert f"[rank {rank}, root FSDP unit]" in clip and "clip_grad_norm_() expects IDLE, " \
            "the unit is in FORWARD_BACKWARD" in clip and "before the optimizer step" in clip, clip
        for msg, action in ((write_back, "writing the unsharded data back"),
                            (views, "showing the unsharded views")):
            assert msg.startswith("Expects an unsharded flat parameter but got SHARDED "
                                  f"[rank {rank}, FSDP unit '0', _flat_param]: {action}"), msg
        assert summon.startswith("Expects the handle training to be IDLE but got FORWARD "
                                 f"[rank {rank}, FSDP unit '0', _flat_param]"), summon
        assert (inside, after) == ("SUMMON_FULL_PARAMS", "IDLE")


@pytest.mark.parametrize("name", ["sharding_strategy", "_use_orig_params", "mixed_precision",
                                  "process_group", "training_state", "_is_root"])
def test_torch_attribute_names_are_properties_of_the_facade(name: str) -> None:
    """Each reads the unit's state; none is stored on the module twice."""
    from fsdp_wrap.fully_sharded_data_parallel.torch_attributes import TorchAttributes

    assert isinstance(vars(TorchAttributes)[name], property)
