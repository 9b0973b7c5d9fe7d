"""The core's DCP checkpoints (``megatron_fsdp_v2.save_checkpoint`` / ``load_checkpoint``) for
Megatron's objects: the adapter's ``FullyShardedDataParallel`` holds the wrapped module as
``.module``, and Megatron's optimizers hold the torch optimizer as ``.optimizer`` (a
``ChainedOptimizer`` holds a list of them). The core takes only a ``fully_shard`` module and a
``torch.optim.Optimizer``; the unwrapping is Megatron knowledge, so it lives here.

For Megatron's own ``dist_checkpointing`` format (``--ckpt-format torch_dist``) use
``save_dist_checkpoint`` / ``load_dist_checkpoint`` (dist_checkpoint.py) instead.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn

from ... import checkpoint as core_checkpoint

__all__ = ["async_save_checkpoint", "checkpoint_targets", "load_checkpoint", "save_checkpoint"]


def _fully_sharded_module(model) -> nn.Module:
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, nn.Module) and hasattr(candidate, "sharded_parameters"):
            return candidate
    raise TypeError(f"model must be megatron_fsdp_v2's FullyShardedDataParallel (or a module wrapped by "
                    f"fully_shard), got {type(model).__name__}.")


def _inner_torch_optimizer(optimizer) -> torch.optim.Optimizer:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        if len(chained) != 1:
            raise ValueError(f"optimizer: a ChainedOptimizer of {len(chained)} optimizers; pass each of "
                             f"optimizer.chained_optimizers, or use save_dist_checkpoint (dist_checkpointing).")
        optimizer = chained[0]
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"optimizer must be a Megatron optimizer holding a torch.optim.Optimizer as .optimizer (or a "
                    f"torch optimizer), got {type(optimizer).__name__}.")


def checkpoint_targets(model, optimizer=None) -> tuple:
    """(the ``fully_shard`` module, the torch optimizer or None) that Megatron's ``model`` and
    ``optimizer`` wrap, for the core's checkpoint functions."""
    return _fully_sharded_module(model), None if optimizer is None else _inner_torch_optimizer(optimizer)


def save_checkpoint(path: "str | os.PathLike", model, optimizer: Optional[object] = None) -> None:
    """``megatron_fsdp_v2.save_checkpoint`` for a ``FullyShardedDataParallel`` and Megatron optimizer."""
    core_checkpoint.save_checkpoint(path, *checkpoint_targets(model, optimizer))


def async_save_checkpoint(path: "str | os.PathLike", model, optimizer: Optional[object] = None):
    """``megatron_fsdp_v2.async_save_checkpoint`` for a ``FullyShardedDataParallel`` and Megatron
    optimizer: a ``concurrent.futures.Future``."""
    return core_checkpoint.async_save_checkpoint(path, *checkpoint_targets(model, optimizer))


def load_checkpoint(path: "str | os.PathLike", model, optimizer: Optional[object] = None) -> None:
    """``megatron_fsdp_v2.load_checkpoint`` for a ``FullyShardedDataParallel`` and Megatron optimizer."""
    core_checkpoint.load_checkpoint(path, *checkpoint_targets(model, optimizer))
