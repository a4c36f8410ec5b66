"""Optimizer state dicts: FSDP1's optimizer-state APIs (filled in by issue 4).

Every function here is the implementation behind the static method of the
same name on ``FullyShardedDataParallel``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def _todo(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"FullyShardedDataParallel.{name} is not implemented in this release of fsdp_wrap yet"
    )


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: Any = None,
) -> dict[str, Any]:
    raise _todo("optim_state_dict")


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: Any = None,
) -> dict[str, Any]:
    raise _todo("optim_state_dict_to_load")


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Any = None,
    rank0_only: bool = True,
    group: Any = None,
) -> dict[str, Any]:
    raise _todo("full_optim_state_dict")


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
) -> dict[str, Any]:
    raise _todo("sharded_optim_state_dict")


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    raise _todo("shard_full_optim_state_dict")


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any = None,
) -> dict[str, Any]:
    raise _todo("scatter_full_optim_state_dict")


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    raise _todo("flatten_sharded_optim_state_dict")


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: Any,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    raise _todo("rekey_optim_state_dict")
