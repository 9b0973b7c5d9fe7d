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
``broadcast_buffers``: once per training forward, like the inner group).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist

__all__ = ["split_process_group"]


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
