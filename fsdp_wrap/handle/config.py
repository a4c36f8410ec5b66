"""A unit's settings: its options and groups, resolved once, read from one object.

The constructor (``runtime/setup.py``) resolves every argument of one unit
into one :class:`UnitSettings`; the unit's state holds it as
``state.settings`` and each of the unit's handles holds the same object as
``handle.config``.  Nothing keeps a second copy of an option: a reader asks
this object (the façade's torch-named attributes, such as
``sharding_strategy`` or ``_use_orig_params``, read it too).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.distributed import ProcessGroup

from fsdp_wrap.api import (
    RESHARD_AFTER_FORWARD,
    SHARDED_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from fsdp_wrap.comm.collectives import DivideFactors
from fsdp_wrap.comm.quant.wire import EXACT, Wire

__all__ = ["SettingsView", "UnitSettings"]


@dataclasses.dataclass(frozen=True)
class UnitSettings:
    """One unit's resolved options and groups (frozen: set at construction).

    Groups: ``process_group`` shards the unit (HYBRID_SHARD's shard group);
    ``inter_node_pg`` is the hybrid strategies' group across replicas as
    resolved (``None`` otherwise), ``replicate_group`` the same where it
    holds more than one rank (what the reduction uses); ``divide`` the
    gradient pre/post-divide factors; ``device`` the compute device.

    Options: the constructor's, with ``strategy`` clamped to what the world
    size allows, ``cpu_offload``/``mixed_precision`` never ``None``,
    ``use_full_prec_in_eval`` from ``$FSDP_USE_FULL_PREC_IN_EVAL``,
    ``quantize`` the resolved ``quantize_collectives`` and ``wire`` how the
    unit's collectives move their bytes.
    """

    device: torch.device
    strategy: ShardingStrategy
    process_group: ProcessGroup
    rank: int
    world_size: int
    use_orig_params: bool
    divide: DivideFactors
    mixed_precision: MixedPrecision = dataclasses.field(default_factory=MixedPrecision)
    cpu_offload: CPUOffload = dataclasses.field(default_factory=CPUOffload)
    replicate_group: ProcessGroup | None = None
    inter_node_pg: ProcessGroup | None = None
    device_mesh: Any = None
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_full_prec_in_eval: bool = False
    sync_module_states: bool = False
    quantize: Any = None  # fsdp_wrap.comm.quant.config.QuantSpec, or None (off)
    wire: Wire = EXACT

    # --------------------- derived (the two cached: read per unit and step)

    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.reduce_dtype

    @property
    def keep_low_precision_grads(self) -> bool:
        return self.mixed_precision.keep_low_precision_grads

    @property
    def offload_params(self) -> bool:
        return self.cpu_offload.offload_params

    @functools.cached_property
    def uses_sharded_strategy(self) -> bool:
        """Whether the flat parameter is sharded (every strategy but NO_SHARD)."""
        return self.strategy in SHARDED_STRATEGIES

    @functools.cached_property
    def reshard_after_forward(self) -> bool:
        """FSDP1's rule: FULL_SHARD and HYBRID_SHARD free the gathered
        parameters after forward; the others keep them for backward."""
        return self.strategy in RESHARD_AFTER_FORWARD

class SettingsView:
    """Read-only attributes of an object holding a unit's settings as
    ``config`` (the handle): each reads the one settings object, nothing is
    copied."""

    config: UnitSettings

    @property
    def device(self) -> torch.device: return self.config.device
    @property
    def strategy(self) -> ShardingStrategy: return self.config.strategy
    @property
    def process_group(self) -> ProcessGroup: return self.config.process_group
    @property
    def replicate_group(self) -> ProcessGroup | None: return self.config.replicate_group
    @property
    def rank(self) -> int: return self.config.rank
    @property
    def world_size(self) -> int: return self.config.world_size
    @property
    def use_orig_params(self) -> bool: return self.config.use_orig_params
    @property
    def uses_sharded_strategy(self) -> bool: return self.config.uses_sharded_strategy
    @property
    def reshard_after_forward(self) -> bool: return self.config.reshard_after_forward
    @property
    def offload_params(self) -> bool: return self.config.offload_params
