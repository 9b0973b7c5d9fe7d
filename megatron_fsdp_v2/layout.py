"""Pure flat-buffer layout: where each parameter lives in a group's buffer and which rank owns what.

No torch.distributed here, no tensors: integers in, a frozen record out, so the invariants can be
checked exhaustively by property tests.

A group's parameters are packed back to back into one flat buffer, each starting at a multiple of
``alignment`` elements (default 1: no per-parameter padding at all). The end is padded to a
multiple of ``dp_size`` so the buffer splits into ``dp_size`` equal, contiguous shards::

    offsets:  0        a(p0)        a(p1)                          total
    buffer:   |  p0  |.|    p1    |.|   p2   |pad|   (. = alignment gap, pad < dp_size)
    shards:   |   rank 0    |    rank 1   |   rank 2   |   rank 3  |
                             ^ p1 straddles ranks 0 and 1

Padding beyond alignment is at most ``dp_size - 1`` elements per buffer. We never pad rows to a
common multiple of row sizes (Megatron-FSDP's LCM padding grew to 1,032,192-element chunks on
DeepSeek-V3 shapes); a parameter may straddle two or more ranks' shards instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class ShardSlice:
    """The part of one parameter inside one rank's shard.

    ``param_start:param_end`` indexes the flattened parameter, ``shard_start`` is where that
    piece begins inside the rank's shard. Empty when ``param_start == param_end``.
    """

    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of every parameter in one flat buffer and the equal split of it over ``dp_size`` ranks."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    alignment: int
    dp_size: int
    data_numel: int     # end of the last parameter
    total_numel: int    # padded: a multiple of dp_size

    @property
    def shard_numel(self) -> int:
        return self.total_numel // self.dp_size

    @property
    def padding_numel(self) -> int:
        """Elements of the buffer that belong to no parameter (alignment gaps and end padding)."""
        return self.total_numel - sum(self.numels)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in buffer coordinates."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank must be in [0, {self.dp_size}), got {rank}.")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_range(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of parameter ``index`` in buffer coordinates."""
        return self.offsets[index], self.offsets[index] + self.numels[index]

    def shard_slice(self, index: int, rank: int) -> ShardSlice:
        """The piece of parameter ``index`` that ``rank`` owns (possibly empty)."""
        p_start, p_end = self.param_range(index)
        s_start, s_end = self.shard_range(rank)
        lo, hi = max(p_start, s_start), min(p_end, s_end)
        if lo >= hi:
            return ShardSlice(0, 0, 0)
        return ShardSlice(lo - p_start, hi - p_start, lo - s_start)


def build_layout(numels: Sequence[int], dp_size: int, alignment: int = 1) -> FlatLayout:
    """Pack parameters of the given element counts into one buffer split over ``dp_size`` ranks."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be positive, got {dp_size}.")
    if alignment < 1:
        raise ValueError(f"alignment must be a positive number of elements, got {alignment}.")
    offsets = []
    cursor = 0
    for numel in numels:
        if numel < 0:
            raise ValueError(f"parameter sizes must be >= 0, got {numel}.")
        cursor = _round_up(cursor, alignment)
        offsets.append(cursor)
        cursor += numel
    total = _round_up(cursor, dp_size)
    return FlatLayout(tuple(int(n) for n in numels), tuple(offsets), alignment, dp_size, cursor, total)
