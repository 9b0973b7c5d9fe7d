"""megatron_fsdp_v2: fully sharded data parallelism (ZeRO-1/2/3) for Megatron-Core and plain PyTorch.

Public names only; the Megatron adapter lives in ``megatron_fsdp_v2.megatron`` and is imported on
demand, so the core runs with torch alone.
"""

from .checkpoint import (CheckpointCorruptError, ChecksummedFileSystemWriter, HostStager, SafeFileSystemReader,
                         UnsafeCheckpointError, async_save_checkpoint, export_full_state_dict, load_checkpoint,
                         load_optimizer_state_dict, optimizer_state_dict, save_checkpoint)
from .comm.ledger import CollectiveMismatchError
from .fully_shard import FullyShardedModule, fully_shard
from .graphs import GraphedStep, make_graphed_step
from .summon import summon_full_params
from .mixed_precision import MixedPrecisionPolicy
from .plan.resolve import AutoStrategy
from .plan import Plan, plan  # noqa: E402  (the function; the package stays importable as megatron_fsdp_v2.plan)
from .offload.policy import OffloadPolicy
from .strategy import STRATEGIES, STRATEGY_NAMES, ShardingStrategy, get_strategy
from . import optim  # noqa: E402  (megatron_fsdp_v2.optim.Muon)

__all__ = [
    "AutoStrategy",
    "CheckpointCorruptError",
    "ChecksummedFileSystemWriter",
    "CollectiveMismatchError",
    "FullyShardedModule",
    "GraphedStep",
    "HostStager",
    "MixedPrecisionPolicy",
    "Plan",
    "OffloadPolicy",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "SafeFileSystemReader",
    "ShardingStrategy",
    "UnsafeCheckpointError",
    "async_save_checkpoint",
    "export_full_state_dict",
    "fully_shard",
    "get_strategy",
    "load_checkpoint",
    "load_optimizer_state_dict",
    "make_graphed_step",
    "optim",
    "optimizer_state_dict",
    "plan",
    "save_checkpoint",
    "summon_full_params",
]
