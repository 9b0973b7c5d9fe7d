"""``plan``: per-rank memory and communication of ``fully_shard`` strategies, before launch.

The units, groups, dtypes and flat layouts are the ones ``fully_shard`` would build (groups.py
runs its code on shapes alone); memory.py sums them per kind, schedule.py replays one step's
temporaries and collectives. A model on the meta device is enough: no process group, no GPU.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from ..layout import default_alignment
from ..mixed_precision import MixedPrecisionPolicy
from ..strategy import STRATEGY_NAMES, ShardingStrategy, get_strategy
from .auto import choose
from .groups import planned_units
from .memory import OPTIMIZER_STATE_COPIES, rank_persistent_bytes
from .report import Plan, StrategyPlan
from .schedule import ring_bytes, step_comm, step_temporaries

__all__ = ["plan", "plan_candidates"]


def _shapes(world_size: int, hybrid_shape) -> list:
    """Candidate (outer, inner) shapes; ``None`` in the list: flat over the world."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}.")
    choices = hybrid_shape if isinstance(hybrid_shape, list) else [hybrid_shape]
    out = []
    for shape in choices:
        if shape is None:
            out.append(None)
            continue
        if (not isinstance(shape, tuple) or len(shape) != 2 or
                not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)):
            raise ValueError(f"hybrid_shape must be None, an (outer, inner) pair of positive ints or a list of "
                             f"them, got {shape!r}.")
        if shape[0] * shape[1] != world_size:
            raise ValueError(f"hybrid_shape {shape} must multiply to world_size={world_size}.")
        out.append(shape)
    return out


def _check(module, optimizer, micro_batches, mixed_precision) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
    if getattr(module, "_fsdp_engine", None) is not None:     # wrapped by fully_shard already
        raise ValueError("module: plan takes the model before fully_shard wraps it (a meta-device copy is enough).")
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}.")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}.")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision must be a MixedPrecisionPolicy or None, got {type(mixed_precision).__name__}.")


def _buffer_bytes(module: nn.Module) -> list:
    """Bytes of each per-dtype broadcast ``broadcast_buffers`` sends (comm.py coalesces by dtype)."""
    by_dtype: dict = {}
    for buffer in module.buffers():
        if buffer.numel():
            by_dtype[buffer.dtype] = by_dtype.get(buffer.dtype, 0) + buffer.numel() * buffer.element_size()
    return list(by_dtype.values())


def plan_candidates(module: nn.Module, strategies, world_size: int, hybrid_shape, mixed_precision,
                    optimizer: str, micro_batches: int, unit_modules, device: str,
                    reduce_root_per_child: bool, broadcast_buffers: bool) -> list[StrategyPlan]:
    """One ``StrategyPlan`` per (hybrid shape, strategy), in that order."""

    _check(module, optimizer, micro_batches, mixed_precision)
    if isinstance(strategies, (str, ShardingStrategy)):
        strategies = [strategies]
    strategies = [get_strategy(s, argument="strategies") for s in strategies]
    alignment = default_alignment(torch.device(device))
    buffers = _buffer_bytes(module) if broadcast_buffers else []
    out = []
    for shape in _shapes(world_size, hybrid_shape):
        outer, inner = shape if shape is not None else (1, world_size)
        units = planned_units(module, unit_modules, mixed_precision, inner, alignment, reduce_root_per_child)
        groups = [g for u in units for g in u.groups]
        for strategy in strategies:
            ranks = tuple(rank_persistent_bytes(groups, strategy, r, optimizer) for r in range(inner))
            comm = step_comm(units, strategy, micro_batches, inner, None if shape is None else outer, buffers)
            wire = ring_bytes(comm, inner) + (ring_bytes(comm["across_replicas"], outer) if shape else 0)
            out.append(StrategyPlan(strategy.name, (outer, inner), ranks,
                                    step_temporaries(units, strategy, inner, micro_batches), comm, wire))
    return out


def plan(module: nn.Module, strategies: Union[str, Sequence] = STRATEGY_NAMES, *, world_size: int = 1,
         hybrid_shape=None, mixed_precision: Optional[MixedPrecisionPolicy] = None, optimizer: str = "adam",
         micro_batches: int = 1, unit_modules: Optional[Sequence[type]] = None, device: str = "cuda",
         reduce_root_per_child: bool = False, broadcast_buffers: bool = True,
         budget_bytes: Optional[int] = None) -> Plan:
    """Per-rank memory and communication of one training step under each strategy, before launch.

    Args:
        module: the model as ``fully_shard`` would take it; a copy built under
            ``torch.device("meta")`` is enough (only shapes, dtypes and module structure are read).
        strategies: a strategy name or several (default: all four).
        world_size: data-parallel ranks.
        hybrid_shape: ``None`` (flat over ``world_size``), ``(outer, inner)`` for hybrid sharding
            (HSDP: shard over ``inner``, replicate over ``outer``), or a list of these to compare.
        mixed_precision, unit_modules, reduce_root_per_child, broadcast_buffers: as ``fully_shard``.
        optimizer: ``"adam"`` / ``"adamw"`` (2 state tensors per element), ``"sgd_momentum"`` (1)
            or ``"sgd"`` (torch's default momentum 0: none).
        micro_batches: per optimizer step (the first ones under ``no_sync()``).
        device: ``"cuda"`` (parameters aligned to 64 elements, as ``fully_shard`` does on GPUs) or
            ``"cpu"``.
        budget_bytes: if given, ``Plan.chosen`` is the candidate fitting it that sends the fewest
            bytes (``runner_up`` the next); ``NoPlanFitsError`` names the smallest when none fits.

    Not covered: expert parameters, ``outer_sharding_strategy="optim"`` (HFSDP), nested
    ``fully_shard`` calls, CPU offload, activations (leave room for them in ``budget_bytes``).
    """
    candidates = plan_candidates(module, strategies, world_size, hybrid_shape, mixed_precision, optimizer,
                                 micro_batches, unit_modules, device, reduce_root_per_child, broadcast_buffers)
    chosen = runner_up = None
    if budget_bytes is not None:
        chosen, runner_up = choose(candidates, budget_bytes)
    return Plan(tuple(candidates), micro_batches, optimizer, budget_bytes, chosen, runner_up)
