"""ZeRO-3's main-weight shards of one rank as views of one allocation per dtype.

[Note: one segment for the main shards]
A group's main shard is a flat buffer kept for the whole run. Allocated one per group, a shard a
little under a multiple of the CUDA caching allocator's 2 MiB segment rounding gets a segment of
its own whose remainder, under the allocator's 1 MiB split threshold, is never split off: it stays
in the block and counts as allocated. Measured on one H200 with FSDP2's memory-test model at world
1 (docs/benchmarks_history.md, "ZeRO-3 at FSDP2's memory-test points"): each block's 28.34 MB
shard held a 28 MiB block, 3 x 1.02 MB above FSDP2, whose sharded parameters are allocated one by
one. So the main shards of the groups that stay on the device are views of one allocation per main
dtype: one remainder in all.

Only ZeRO-3 without hybrid sharding: ZeRO-1/2 and HFSDP refresh a group's compute weights when the
version counter of its main shard moves, and views of one allocation share one counter (a step of
one group would refresh every group). ZeRO-3 gathers at every use and reads no version.

How, so that the wrap never holds more than FSDP2's ``fully_shard`` (which replaces each
module's parameters by their shards one module at a time: the model plus one module's shards):
every group builds its main shard in a buffer of its own, piece by piece from its parameters, and
frees them (ZeRO-3 and parameters that gather themselves: the module's tensors are not read again);
once all are built ``compact`` moves them into the segment, before the main parameters (possibly
DTensors, which cannot be re-pointed) are made. The move holds this rank's main shards twice for a
moment, when the model's own tensors are gone: 8 bytes per parameter / dp in fp32, at dp >= 2 no
more than the model the wrap started from. Allocating the segment first instead would hold it
beside the whole model (M + M / dp, where FSDP2 peaks at M + one module's shards).

At dp 1 (a group whose shard is its whole weight) the move would hold the model twice: such a
group builds its shard on the host (``build_device``) and ``compact`` copies it up once the
model's tensors on the device are gone, so the device peak is the model. On the CPU, where the
host is the device, such a group keeps its own buffer (``joins_main_segment``): the CPU allocator
does not round, so there is no remainder to save. From meta there is nothing to move: the groups
wait for the segment without a buffer, and wrap/meta_init.py writes the values into it. Groups that
``set_offload`` later moves to the host leave holes: ``compact`` again moves the others into a new
segment.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..strategy import ShardingStrategy

__all__ = ["build_device", "compact", "joins_main_segment", "segment_views"]


def joins_main_segment(strategy: ShardingStrategy, hybrid: bool, device: torch.device, shard_ranks: int,
                       from_meta: bool) -> bool:
    """Whether a group's device main shard comes from the segment (see the Note): ZeRO-3 without
    hybrid sharding, except a group over one rank built from values on the CPU."""
    whole_on_cpu = shard_ranks == 1 and device.type == "cpu" and not from_meta
    return strategy.weights_sharded and not hybrid and not whole_on_cpu


def build_device(device: torch.device, shard_ranks: int) -> torch.device:
    """Where a segment member builds its main shard before ``compact`` moves it: the host when the
    shard is the whole weight (one rank), else the device (see the Note)."""
    return torch.device("cpu") if shard_ranks == 1 else device


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
    (after building, from wherever ``build_device`` put them; after ``set_offload``, leaving out the
    groups it moved to the host). What they were in before is freed with its last view."""
    members = [g for g in groups if getattr(g, "main_in_segment", False)]
    if not members:
        return
    views = segment_views([(g.main.numel, g.dtypes.main) for g in members], members[0].device,
                          members[0].layout.alignment)
    for group, view in zip(members, views):
        group.main.rehome(view)
