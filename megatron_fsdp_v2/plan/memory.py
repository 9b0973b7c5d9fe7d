"""What a rank keeps between steps, per kind, from the planned groups and the strategy table.

The kinds are those ``FullyShardedModule.persistent_bytes()`` reports (``model_weights``,
``main_weights``, ``grads``; with offload ``host_main_weights``, ``host_grads``,
``host_grad_staging``), plus the optimizer's state, which the engine does not own: per element of
this rank's main-weight pieces (never of the padding), ``OPTIMIZER_STATE_COPIES`` tensors of the
main-weight dtype (Adam's exp_avg and exp_avg_sq; SGD with momentum its buffer), on the device or,
for an offloaded group, on the host (``host_optimizer_state``). ``padding`` is the part of the
device kinds that belongs to no parameter (counted in them too).
"""

from __future__ import annotations

from ..strategy import ShardingStrategy
from .groups import PlannedGroup

__all__ = ["HOST_KINDS", "OPTIMIZER_STATE_COPIES", "PERSISTENT_KINDS", "rank_persistent_bytes", "rank_piece_numels",
           "rank_pieces"]

#: Optimizer-state tensors per parameter element, in the main-weight dtype.
OPTIMIZER_STATE_COPIES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}

PERSISTENT_KINDS = ("model_weights", "main_weights", "grads", "optimizer_state")
HOST_KINDS = ("host_main_weights", "host_grads", "host_grad_staging", "host_optimizer_state")


def rank_pieces(group: PlannedGroup, strategy: ShardingStrategy, rank: int) -> list[int]:
    """Elements of this rank's main-weight piece of each parameter (what the optimizer steps)."""
    layout = group.layout
    if not strategy.optim_sharded:
        return list(layout.numels)
    return [layout.shard_slice(index, rank).numel for index in range(len(layout.numels))]


def rank_piece_numels(group: PlannedGroup, strategy: ShardingStrategy, rank: int) -> int:
    """Elements of this rank's main-weight pieces (what the optimizer holds state for)."""
    return sum(rank_pieces(group, strategy, rank))


def _add_group(out: dict, group: PlannedGroup, strategy: ShardingStrategy, rank: int, copies: int,
               offloaded: bool, micro_batches: int) -> None:
    """One group's bytes into ``out`` (group/param_group.py ``_init_buffers``, group/offload.py
    ``offload_main``: where each buffer lives)."""
    layout, dt = group.layout, group.dtypes
    main_numel = layout.shard_numel if strategy.optim_sharded else layout.total_numel
    pieces = rank_piece_numels(group, strategy, rank)
    main_bytes, main_padding = main_numel * dt.main.itemsize, (main_numel - pieces) * dt.main.itemsize
    if offloaded:
        out["host_main_weights"] += main_bytes
    else:
        out["main_weights"] += main_bytes
        out["padding"] += main_padding
    # compute weights are the main weights when nothing is sharded and the dtypes agree (unless the
    # main weights went to the host: the device buffer then stays as the compute weights)
    if not strategy.weights_sharded and (strategy.optim_sharded or dt.compute != dt.main or offloaded):
        out["model_weights"] += layout.total_numel * dt.compute.itemsize
        out["padding"] += layout.padding_numel * dt.compute.itemsize
    elif strategy.weights_sharded and offloaded:          # the device shard the all-gathers read
        out["model_weights"] += layout.shard_numel * dt.compute.itemsize
        out["padding"] += (layout.shard_numel - pieces) * dt.compute.itemsize
    if not group.requires_grad:
        return
    grad_numel = layout.shard_numel if strategy.grads_sharded else layout.total_numel
    grad_pieces = pieces if strategy.grads_sharded else sum(layout.numels)
    # offloaded: the reduced gradients are on the host; DDP/ZeRO-1's device buffer then only
    # accumulates during backward (once no .grad views it, it is freed: plan/phases.py)
    if not offloaded:
        out["grads"] += grad_numel * dt.grad.itemsize
        out["padding"] += (grad_numel - grad_pieces) * dt.grad.itemsize
    state = copies * pieces * dt.main.itemsize
    if offloaded:
        out["host_grads"] += main_numel * dt.grad.itemsize
        if strategy.grads_sharded and micro_batches > 1:  # a later micro-batch's landing (offload/host_link.py)
            out["host_grad_staging"] += main_numel * dt.grad.itemsize
        out["host_optimizer_state"] += state
    else:
        out["optimizer_state"] += state


def rank_persistent_bytes(groups: list[PlannedGroup], strategy: ShardingStrategy, rank: int,
                          optimizer: str, offloaded: frozenset = frozenset(), micro_batches: int = 1) -> dict:
    """``{kind: bytes}`` for shard rank ``rank``: the device kinds, ``"padding"`` (inside them),
    ``"total"`` (the four device kinds), the host kinds and ``"host_total"``. ``offloaded``: the
    positions (in ``groups``) of the groups whose main weights live on the host."""
    copies = OPTIMIZER_STATE_COPIES[optimizer]
    out = dict.fromkeys(PERSISTENT_KINDS + HOST_KINDS + ("padding",), 0)
    for index, group in enumerate(groups):
        _add_group(out, group, strategy, rank, copies, index in offloaded, micro_batches)
    out["total"] = sum(out[kind] for kind in PERSISTENT_KINDS)
    out["host_total"] = sum(out[kind] for kind in HOST_KINDS)
    return out
