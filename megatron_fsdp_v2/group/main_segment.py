"""ZeRO-3's main-weight shards of one rank as views of one allocation per dtype.

[Note: one segment for the main shards]
A group's main shard is a flat buffer kept for the whole run. Allocated one per group, a shard a
little under a multiple of the CUDA caching allocator's 2 MiB segment rounding gets a segment of
its own whose remainder, under the allocator's 1 MiB split threshold, is never split off: it stays
in the block and counts as allocated. Measured on one H200 with FSDP2's memory-test model at world
1 (benchmarks/held_at_step.py): each block's 28.34 MB shard held a 28 MiB block, 3 x 1.02 MB above
FSDP2, whose sharded parameters are allocated one by one. So the main shards of the groups that
stay on the device are views of one allocation per main dtype: one remainder in all.

Only ZeRO-3 without hybrid sharding: ZeRO-1/2 and HFSDP refresh a group's compute weights when the
version counter of its main shard moves, and views of one allocation share one counter (a step of
one group would refresh every group). ZeRO-3 gathers at every use and reads no version.

How: every group builds its main shard in a buffer of its own, piece by piece from its parameters
(a ZeRO-3 group then frees them), and once all are built ``compact`` moves them into the segment,
before the main parameters (possibly DTensors, which cannot be re-pointed) are made. The move holds
this rank's main shards twice for a moment: 8 bytes per parameter / dp in fp32, below what the
first step holds (16 / dp) and, for a model wrapped on the device, below the model it started from
(dp >= 2) or equal to it (dp = 1). From meta there is nothing to move: the groups wait for the
segment without a buffer, and wrap/meta_init.py writes the values into it. Groups that ``set_offload``
later moves to the host leave holes: ``compact`` again moves the others into a new segment.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..strategy import ShardingStrategy

__all__ = ["compact", "segment_views", "shares_main_segment"]


def shares_main_segment(strategy: ShardingStrategy, hybrid: bool) -> bool:
    """Whether this strategy's device main shards come from one segment (see the Note)."""
    return strategy.weights_sharded and not hybrid


def segment_views(requests: Sequence[Optional[tuple[int, torch.dtype]]], device: torch.device,
                  alignment: int = 1) -> list[Optional[torch.Tensor]]:
    """For each ``(numel, dtype)`` request a 1-D view of one allocation per dtype (None for None),
    each starting at a multiple of ``alignment`` elements (the layout's, layout.default_alignment:
    where a buffer of its own would put it for the kernels). A shard is a whole number of
    alignment units except at dp 1, so the views are back to back but for that. Contents are
    undefined."""
    offsets: list[Optional[int]] = []
    ends: dict = {}
    for request in requests:
        if request is None:
            offsets.append(None)
            continue
        numel, dtype = request
        offsets.append(-(-ends.get(dtype, 0) // alignment) * alignment)
        ends[dtype] = offsets[-1] + numel
    segments = {dtype: torch.empty(end, dtype=dtype, device=device) for dtype, end in ends.items()}
    return [None if request is None else segments[request[1]][start:start + request[0]]
            for request, start in zip(requests, offsets)]


def compact(groups: Sequence) -> None:
    """Move the main shards of the groups marked ``main_in_segment`` into one new segment per dtype
    (after building; after ``set_offload``, leaving out the groups it moved to the host). What they
    were in before is freed with its last view."""
    members = [g for g in groups if getattr(g, "main_in_segment", False)]
    if not members:
        return
    views = segment_views([(g.main.numel, g.dtypes.main) for g in members], members[0].device,
                          members[0].layout.alignment)
    for group, view in zip(members, views):
        group.main.rehome(view)
