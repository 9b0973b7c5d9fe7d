"""What a rank keeps between steps, per kind, from the planned groups and the strategy table.

The kinds are those ``FullyShardedModule.persistent_bytes()`` reports (``model_weights``,
``main_weights``, ``grads``), plus the optimizer's state, which the engine does not own: per
element of this rank's main-weight pieces (never of the padding), ``OPTIMIZER_STATE_COPIES``
tensors of the main-weight dtype (Adam's exp_avg and exp_avg_sq; SGD with momentum its buffer).
``padding`` is the part of the first three that belongs to no parameter (counted in them too).
"""

from __future__ import annotations

from ..strategy import ShardingStrategy
from .groups import PlannedGroup

__all__ = ["OPTIMIZER_STATE_COPIES", "PERSISTENT_KINDS", "rank_persistent_bytes"]

#: Optimizer-state tensors per parameter element, in the main-weight dtype.
OPTIMIZER_STATE_COPIES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}

PERSISTENT_KINDS = ("model_weights", "main_weights", "grads", "optimizer_state")


def _rank_piece_numels(group: PlannedGroup, strategy: ShardingStrategy, rank: int) -> int:
    """Elements of this rank's main-weight pieces (what the optimizer holds state for)."""
    layout = group.layout
    if not strategy.optim_sharded:
        return sum(layout.numels)
    return sum(layout.shard_slice(index, rank).numel for index in range(len(layout.numels)))


def rank_persistent_bytes(groups: list[PlannedGroup], strategy: ShardingStrategy, rank: int,
                          optimizer: str) -> dict:
    """``{kind: bytes}`` for shard rank ``rank``, plus ``"padding"`` (inside the first three) and
    ``"total"`` (the four kinds)."""
    copies = OPTIMIZER_STATE_COPIES[optimizer]
    out = dict.fromkeys(PERSISTENT_KINDS, 0)
    padding = 0
    for group in groups:
        layout, dt = group.layout, group.dtypes
        main_numel = layout.shard_numel if strategy.optim_sharded else layout.total_numel
        pieces = _rank_piece_numels(group, strategy, rank)
        out["main_weights"] += main_numel * dt.main.itemsize
        padding += (main_numel - pieces) * dt.main.itemsize
        # the compute weights are the main weights when nothing is sharded and the dtypes agree
        if not strategy.weights_sharded and (strategy.optim_sharded or dt.compute != dt.main):
            out["model_weights"] += layout.total_numel * dt.compute.itemsize
            padding += layout.padding_numel * dt.compute.itemsize
        if group.requires_grad:
            grad_numel = layout.shard_numel if strategy.grads_sharded else layout.total_numel
            grad_pieces = pieces if strategy.grads_sharded else sum(layout.numels)
            out["grads"] += grad_numel * dt.grad.itemsize
            padding += (grad_numel - grad_pieces) * dt.grad.itemsize
            out["optimizer_state"] += copies * pieces * dt.main.itemsize
    out["total"] = sum(out[kind] for kind in PERSISTENT_KINDS)
    out["padding"] = padding
    return out
