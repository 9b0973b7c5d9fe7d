"""Megatron-Core 0.19.2 integration of megatron_fsdp_v2: the only sub-package that imports megatron.

* ``FullyShardedDataParallel`` (``adapter.py``): drop-in for
  ``megatron.core.distributed.DistributedDataParallel`` whose sharding strategy comes from
  ``ddp_config.data_parallel_sharding_strategy`` (``no_shard`` / ``optim`` / ``optim_grads`` /
  ``optim_grads_params``).
* ``get_optimizer`` (``optimizer.py``): ``megatron.core.optimizer.get_megatron_optimizer`` for
  wrapped model chunks (weight decay by the parameters' original shapes, correct global grad norm).
* ``settings``: what happens to every field of ``DistributedDataParallelConfig`` and
  ``OptimizerConfig`` (honoured, refused, or warned once), as one table (docs/megatron_settings.md);
  ``check_ddp_config`` / ``check_optimizer_config`` apply it.
* ``dist_checkpoint``: Megatron's ``dist_checkpointing`` (``--ckpt-format torch_dist``) for both:
  ``wrapper.sharded_state_dict()`` / ``optimizer.sharded_state_dict()`` and their ``load_state_dict``;
  ``save_dist_checkpoint`` / ``load_dist_checkpoint`` do both in one call.
* ``save_checkpoint`` / ``async_save_checkpoint`` / ``load_checkpoint`` (``checkpoint/dcp_checkpoint.py``): the
  core's DCP checkpoints for the wrapper and Megatron's optimizers (unwrapped to the ``fully_shard``
  module and torch optimizer).
* ``load_fsdp_dtensor_checkpoint`` / ``save_fsdp_dtensor_checkpoint`` (``checkpoint/fsdp_dtensor_format.py``):
  Megatron-FSDP's ``--ckpt-format fsdp_dtensor``; ``detect_checkpoint_format`` (``checkpoint/checkpoint_format.py``).

Not here (not installed): the Megatron-LM launcher ``examples/pretrain_gpt.py``, the CPU demo
``examples/megatron_demo.py`` and the CPU patches for the demo and the tests ``testing/cpu_compat.py``.

Names are resolved lazily: importing this package does not import megatron.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FullyShardedDataParallel": "adapter",
    "WeightRefreshForMegatronOptimizer": "adapter",
    "ORIGINAL_SHAPE_ATTR": "adapter",
    "async_save_checkpoint": "checkpoint.dcp_checkpoint",
    "checkpoint_targets": "checkpoint.dcp_checkpoint",
    "check_ddp_config": "settings",
    "check_optimizer_config": "settings",
    "detect_checkpoint_format": "checkpoint.checkpoint_format",
    "load_fsdp_dtensor_checkpoint": "checkpoint.fsdp_dtensor_format",
    "save_fsdp_dtensor_checkpoint": "checkpoint.fsdp_dtensor_format",
    "get_optimizer": "optimizer",
    "load_checkpoint": "checkpoint.dcp_checkpoint",
    "save_checkpoint": "checkpoint.dcp_checkpoint",
    "install_optimizer_checkpointing": "checkpoint.dist_checkpoint",
    "load_dist_checkpoint": "checkpoint.dist_checkpoint",
    "read_optimizer_layout": "checkpoint.dist_checkpoint",
    "save_dist_checkpoint": "checkpoint.dist_checkpoint",
    "with_original_shapes": "optimizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
