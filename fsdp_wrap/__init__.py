"""fsdp_wrap: a legacy-compatible FullyShardedDataParallel (FSDP1) on torch.distributed.

Change the import of torch's FSDP package to ``import fsdp_wrap as fsdp``;
every public FSDP1 name below keeps torch's meaning and defaults.
"""

#: fsdp_wrap's own version (setup.py says the same).
__version__ = "0.1.0"


from fsdp_wrap.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_wrap.checkpoint.weights import (
    PretrainedLoad,
    iter_full_weights,
    load_pretrained,
    pretrained_init,
)
from fsdp_wrap.comm.quant.config import CollectiveQuantization
from fsdp_wrap.frameworks.installer import install, installed, uninstall
from fsdp_wrap.fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
from fsdp_wrap.handle.flat_tensor import FlatParameter
from fsdp_wrap.planning import Plan, plan
from fsdp_wrap.runtime.explicit.api import UnshardHandle, register_fsdp_forward_method

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CollectiveQuantization",
    "FlatParameter",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "Plan",
    "PretrainedLoad",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "install",
    "installed",
    "iter_full_weights",
    "load_pretrained",
    "plan",
    "pretrained_init",
    "register_fsdp_forward_method",
    "uninstall",
]
