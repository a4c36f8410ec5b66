"""``fsdp_wrap.fully_sharded_data_parallel``: the façade, where torch's FSDP1 keeps its class.

:class:`FullyShardedDataParallel` (:mod:`.facade`) with its parts:
torch's attribute names (:mod:`.torch_attributes`), the optimizer-state
static methods (:mod:`.optim_methods`) and FSDP2's accumulation controls
(:mod:`.accumulation_methods`), each reading the unit's state object.
"""

from fsdp_wrap.api import OptimStateKeyType
from fsdp_wrap.fully_sharded_data_parallel.facade import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]
