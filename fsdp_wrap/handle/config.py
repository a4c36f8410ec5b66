"""A unit's resolved options, as its :class:`FlatParamHandle` needs them."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed import ProcessGroup

from fsdp_wrap.api import ShardingStrategy
from fsdp_wrap.comm.collectives import DivideFactors
from fsdp_wrap.comm.quant.wire import EXACT, Wire

__all__ = ["HandleConfig"]


@dataclasses.dataclass(frozen=True)
class HandleConfig:
    """Built once per unit by the constructor (``runtime/setup.py``) from its
    resolved arguments; the handle keeps it as ``handle.config``.

    ``param_dtype``/``reduce_dtype``/``keep_low_precision_grads`` come from
    ``MixedPrecision``, ``offload_params`` from ``CPUOffload``;
    ``replicate_group`` is HYBRID_SHARD's group across replicas (``None``
    otherwise); ``divide`` the gradient pre/post-divide factors; ``wire`` how
    the unit's collectives move their bytes (``quantize_collectives``).
    """

    device: torch.device
    strategy: ShardingStrategy
    process_group: ProcessGroup
    rank: int
    world_size: int
    use_orig_params: bool
    divide: DivideFactors
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    offload_params: bool = False
    replicate_group: ProcessGroup | None = None
    limit_all_gathers: bool = True
    use_full_prec_in_eval: bool = False
    wire: Wire = EXACT
