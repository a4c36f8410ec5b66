"""``state_dict()`` called inside ``summon_full_params`` (PEFT's adapter state
dict, verl's LoRA weight sync).

torch's FSDP1 then takes the full parameters as they are (its unshard is a
no-op for a summoned handle): FULL clones them, SHARDED cuts this rank's
dim-0 chunk of each (a ShardedTensor, or a DTensor with a device mesh),
values included that the summon changed and has not written back (verl's
LoRA weight sync asks for SHARDED there: its engine sets that type).  LOCAL
is refused: torch's would describe the summoned flat parameter as this rank's
shard, at offsets past the parameter's end.
"""

from __future__ import annotations

from typing import Any

import torch

import fsdp_wrap.state_dict.chunks as CH
from fsdp_wrap.api import StateDictType
from fsdp_wrap.runtime.names import WRAPPED
from fsdp_wrap.runtime.state import TrainingState, UnitState, expect_state
from fsdp_wrap.state_dict.buffers import buffers_in_original_dtype
from fsdp_wrap.state_dict.keys import param_rels, shared_rels, unit_keys

__all__ = ["in_summon", "summoned_post_state_dict"]


def in_summon(state: UnitState, sd_type: StateDictType, prefix: str) -> bool:
    """Whether ``state_dict()`` runs inside this unit's ``summon_full_params``
    (FULL and SHARDED; LOCAL is refused there)."""
    if state.training_state is not TrainingState.SUMMON_FULL_PARAMS:
        return False
    if sd_type is StateDictType.LOCAL_STATE_DICT:
        expect_state(state, TrainingState.IDLE, error=RuntimeError,
                     action=f"state_dict() with {sd_type.name}",
                     fix="inside summon_full_params use FULL_STATE_DICT (the full parameters "
                         "as they are) or SHARDED_STATE_DICT, or call it after the context")
    return True


def summoned_post_state_dict(state: UnitState, state_dict: dict[str, Any], prefix: str,
                             sd_type: StateDictType) -> None:
    """Inside ``summon_full_params``: the summoned parameters cloned (FULL; they
    are freed at the context's exit) or this rank's chunk of each (SHARDED, a
    copy), buffers as always, clean keys."""
    cfg = state._state_dict_config
    params = set(param_rels(state)) | set(shared_rels(state))
    sharded = sd_type is StateDictType.SHARDED_STATE_DICT
    layout = CH.chunk_layout(state, CH.uses_dtensor(state)) if sharded else None
    for rel in unit_keys(state):
        key = prefix + WRAPPED + rel
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if rel in params and layout is not None:
                state_dict[key] = CH.chunk_tensor(value, layout, cfg.offload_to_cpu)
                continue
            if rel in params:
                value = value.clone()
            state_dict[key] = value.to("cpu") if cfg.offload_to_cpu else value
    buffers_in_original_dtype(state, state_dict, prefix, local=False)
    old = prefix + WRAPPED
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + key[len(old) :]] = state_dict.pop(key)
