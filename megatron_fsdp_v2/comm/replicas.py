"""Hybrid sharding (HSDP): shard within an inner group, replicate across an outer one.

[Note: hybrid sharding]
``fully_shard(..., process_group=(outer, inner))`` (or a 2-D ``DeviceMesh`` whose dimension 0 is
the replicate dimension and dimension 1 the shard dimension, as FSDP2's HSDP mesh) shards
everything as the strategy says over ``inner`` only: every all-gather and reduce-scatter stays
inside it (typically one node). ``outer`` links the ranks holding the same shard (the same inner
rank in every replica); across it only gradients move, once they are final for a step:

    inner reduce (strategy table, divided by inner size)  ->  outer all-reduce of this rank's
    reduced gradient (its shard; DDP: all of it), then divided by the outer size

so the result is the mean over every rank of the data-parallel world, as torch DDP over the world
gives. The outer all-reduce runs when the gradients are made final with synchronization on: at the
end of a backward outside ``no_sync()``, or in ``wait_gradient_reduction()``. Under ``no_sync()``
ZeRO-2/3 still reduce-scatter every micro-batch inside the node, but the outer all-reduce waits for
the last micro-batch, so a step with k micro-batches crosses nodes once. Gradients already averaged
across replicas (a second synchronized backward before ``step()``) are identical on every replica,
and averaging them again leaves them unchanged, so every schedule stays exact.

Main weights, optimizer state and compute weights are per replica; replicas stay identical
because their gradients are. Nothing else crosses the outer group after wrapping (buffers under
``broadcast_buffers``: when the inner group broadcasts, by torch DDP's rule).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch.distributed as dist

__all__ = ["HybridLevels", "split_process_group"]


def split_process_group(process_group) -> Tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """``(shard group, replicate group or None)`` from ``fully_shard``'s ``process_group`` argument:
    a group (or None: the world), an ``(outer, inner)`` pair of groups, or a 2-D DeviceMesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 2:
            raise ValueError(f"process_group: a DeviceMesh must have 2 dimensions (replicate, shard) for hybrid "
                             f"sharding, got {process_group.ndim}; pass a ProcessGroup for plain sharding.")
        return process_group.get_group(1), process_group.get_group(0)
    if isinstance(process_group, (tuple, list)):
        if len(process_group) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in process_group):
            raise TypeError("process_group: a hybrid-sharding pair must be (outer replicate group, inner shard "
                            f"group) of two ProcessGroups, got {[type(g).__name__ for g in process_group]}.")
        outer, inner = process_group
        return inner, outer
    return process_group, None


# ---------------------------------------------------------------- HFSDP
# [Note: sharding across replicas (HFSDP)]
# ``outer_sharding_strategy="optim"`` (Megatron's ``outer_dp_sharding_strategy``) also shards main
# weights, gradients and optimizer state across the replicas: over the whole data-parallel world
# W = inner x outer, laid out as flat ZeRO over W (the layout's shard index is the global rank,
# which must be ``outer rank * inner size + inner rank``: nodes of consecutive ranks). Compute
# weights still move only inside the inner group:
#
#   world shard w = n * N_in + i     (n: outer rank, i: inner rank; S elements each)
#   block n of the flat buffer = world shards n*N_in .. n*N_in + N_in - 1   (contiguous)
#   inner shard of rank (n, i) = world shards {m * N_in + i : m}             (one piece per block)
#
# * Weights (ZeRO-3): each rank keeps its inner shard of compute weights (c * P / N_in), refreshed
#   after an optimizer step by one outer all-gather of the updated world shards; a unit is gathered
#   by N_out inner all-gathers, block by block. (ZeRO-2: the same two steps into the replicated
#   weights, the inner shard a temporary.)
# * Gradients: each micro-batch's reduce is N_out inner reduce-scatters, block by block, added into
#   this rank's inner gradient shard (g * P / N_in, alive from the first reduce to the step's outer
#   reduce); when the gradients are made final, one outer reduce-scatter leaves this rank its world
#   shard, divided by the outer size. ZeRO-1 inside reduces once per step from its full-size buffer
#   and keeps its world shard in that buffer's region of it, as flat ZeRO-1 does.
#
# Per step the inner group moves the strategy's bytes (in N_out calls each), the outer group one
# reduce-scatter of g * P / N_in and one all-gather of c * P / N_in: the bytes of HSDP's all-reduce,
# while main weights and optimizer state shrink from P / N_in to P / W per rank.

HFSDP_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


class HybridLevels(NamedTuple):
    """HFSDP's two levels of a group's data-parallel ranks (the group's ``comm`` is then the world)."""

    inner: Any      # Communicator of the shard group (one node): compute weights move only here
    outer: Any      # Communicator of the replicas: the world shards' refresh and the outer reduce

    @property
    def world_size(self) -> int:
        return self.inner.size * self.outer.size


def gather_blocks(inner, full, source, world_shard: int, outer_size: int, async_op: bool, label: str) -> list:
    """N_out inner all-gathers: block n of ``full`` from piece n of every inner rank's ``source``
    (its inner shard, pieces of ``world_shard`` elements in outer-rank order)."""
    block = world_shard * inner.size
    return [inner.all_gather(full[n * block:(n + 1) * block], source[n * world_shard:(n + 1) * world_shard],
                             async_op=async_op, label=label) for n in range(outer_size)]


def reduce_blocks(inner, inner_out, full, world_shard: int, outer_size: int, label: str) -> list:
    """N_out inner reduce-scatters: piece n of ``inner_out`` gets this rank's share of block n of
    ``full`` summed over the inner group."""
    block = world_shard * inner.size
    return [inner.reduce_scatter(inner_out[n * world_shard:(n + 1) * world_shard], full[n * block:(n + 1) * block],
                                 async_op=True, label=label) for n in range(outer_size)]
