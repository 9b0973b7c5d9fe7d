"""Pure flat-buffer layout: where each parameter lives in a group's buffer and which rank owns what.

No torch.distributed here, no tensors: shapes in, a frozen record out, so the invariants can be
checked exhaustively by property tests.

[Note: row-snapped shards]
A group's parameters are packed in order into one flat buffer that splits into ``dp_size`` equal,
contiguous shards of ``shard_numel`` elements: one all-gather and one reduce-scatter per group,
and a gathered parameter is a contiguous view of the gathered buffer (no copy-out). Every rank
boundary that falls inside a parameter falls on one of its *row* boundaries (a row: one index of
dim 0, ``prod(shape[1:])`` elements), so a rank's piece of a parameter is ``[rows_here,
*shape[1:]]``, the shape torch's optimizers and ``p.ndim`` rules expect::

    rows of 4 elements, dp 3, shard 12:   |p0 p0 p0 p0 p0 p0 p0 p0 .  .  q  q |q  q  r  r  r  r  r  r  r  r  r  r | ...
                                           rank 0                              rank 1
    q (2 rows of 2) would straddle the boundary mid-row at offset 9: it moves right by one
    element (the gap ".") so the boundary at 12 falls between its rows.

Two rules give that, with padding only where a row would be cut:

1. A parameter that would be cut mid-row by the next boundary moves right by the remainder
   (``< row`` elements; it then starts at most one row before its first boundary's row edge).
2. A parameter larger than a shard can span two boundaries; then the distance between them,
   ``shard_numel``, must itself be a multiple of its row. ``shard_numel`` is therefore rounded up
   to the least common multiple of the row sizes of such parameters ("large rows": the shard only
   grows from an even split, so they are among the parameters larger than ``sum(numels) / dp``).

[Note: the padding bound]
    padding <= (dp_size - 1) * max_row  (rule 1: one gap per boundary)
             + dp_size * lcm(alignment, large rows)  (rule 2: rounding the shard up)
             + alignment gaps + dp_size  (end padding)
The lcm runs only over rows of parameters larger than an even split, never over every row, so it
stays small on transformers (Megatron-FSDP's LCM over all rows grew to 1,032,192-element chunks
on DeepSeek-V3 shapes). GPT, hidden 4096, one layer per buffer (12 * 4096^2 elements), dp 8: the
large rows are 4096 and 16384, so padding <= 7 * 16384 + 8 * 16384 + 8 = 0.12% of the buffer.
``padding_numel`` says the exact figure; tests assert the bound.

0-d parameters count as one row of one element; 1-d parameters as rows of one element, so any
boundary falls on a row edge and they are never moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def row_numel(shape: Sequence[int]) -> int:
    """Elements of one dim-0 row of a tensor of ``shape`` (1 for 0-d and 1-d tensors)."""
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


@dataclass(frozen=True)
class ShardSlice:
    """The part of one parameter inside one rank's shard.

    ``param_start:param_end`` indexes the flattened parameter (row-aligned), ``shard_start`` is
    where that piece begins inside the rank's shard. Empty when ``param_start == param_end``.
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

    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    alignment: int
    dp_size: int
    data_numel: int     # end of the last parameter
    total_numel: int    # dp_size * shard_numel

    @property
    def shard_numel(self) -> int:
        return self.total_numel // self.dp_size

    @property
    def padding_numel(self) -> int:
        """Elements of the buffer that belong to no parameter (gaps and end padding)."""
        return self.total_numel - sum(self.numels)

    def row_numel(self, index: int) -> int:
        return row_numel(self.shapes[index])

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in buffer coordinates."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank must be in [0, {self.dp_size}), got {rank}.")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_range(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of parameter ``index`` in buffer coordinates."""
        return self.offsets[index], self.offsets[index] + self.numels[index]

    def shard_slice(self, index: int, rank: int) -> ShardSlice:
        """The piece of parameter ``index`` that ``rank`` owns (possibly empty): whole rows."""
        p_start, p_end = self.param_range(index)
        s_start, s_end = self.shard_range(rank)
        lo, hi = max(p_start, s_start), min(p_end, s_end)
        if lo >= hi:
            return ShardSlice(0, 0, 0)
        return ShardSlice(lo - p_start, hi - p_start, lo - s_start)

    def row_splits(self, index: int) -> tuple[int, ...]:
        """``dp_size + 1`` row indices: rank ``r`` owns rows ``[splits[r], splits[r + 1])`` of
        parameter ``index`` (0-d parameters: one row)."""
        row = self.row_numel(index)
        start, end = self.param_range(index)
        if row == 0:             # no elements: all its (empty) rows on the rank where it starts
            rows = self.shapes[index][0]
            owner = min(start // self.shard_numel, self.dp_size - 1)
            return tuple(0 if rank <= owner else rows for rank in range(self.dp_size + 1))
        splits = [0]
        for rank in range(self.dp_size):
            boundary = min(max((rank + 1) * self.shard_numel, start), end)
            splits.append((boundary - start) // row)
        return tuple(splits)


class _NeedsMultipleOf(Exception):
    """Packing found a parameter spanning two boundaries whose row does not divide the shard."""

    def __init__(self, row: int) -> None:
        self.row = row


def _pack(shapes, numels, shard: int, alignment: int) -> tuple[list[int], int]:
    """Offsets of each parameter and the end of the last, for shards of ``shard`` elements."""
    offsets, cursor = [], 0
    for shape, numel in zip(shapes, numels):
        row = row_numel(shape)
        start = _round_up(cursor, alignment)
        first = (start // shard + 1) * shard         # the first boundary after the start
        if start + numel > first:
            start += (first - start) % row            # rule 1
            first = (start // shard + 1) * shard
            if start + numel > first and (first - start) % row:
                raise _NeedsMultipleOf(row)           # it now starts on a boundary and spans the next
            if start + numel > first + shard and shard % row:
                raise _NeedsMultipleOf(row)           # rule 2
        offsets.append(start)
        cursor = start + numel
    return offsets, cursor


def build_layout(shapes: Sequence[Sequence[int]], dp_size: int, alignment: int = 1) -> FlatLayout:
    """Pack parameters of the given shapes into one buffer split over ``dp_size`` row-snapped
    shards ([Note: row-snapped shards])."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be positive, got {dp_size}.")
    if alignment < 1:
        raise ValueError(f"alignment must be a positive number of elements, got {alignment}.")
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    for shape in shapes:
        if any(d < 0 for d in shape):
            raise ValueError(f"parameter shapes must have sizes >= 0, got {shape}.")
    numels = tuple(math.prod(s) for s in shapes)
    multiple = alignment          # aligned boundaries keep aligned parameters aligned after rule 1
    shard = max(1, -(-sum(numels) // dp_size))
    while True:
        shard = _round_up(shard, multiple)
        if dp_size == 1:
            offsets, end = _pack_unsplit(numels, alignment)
            shard = max(shard, end)
            break
        try:
            offsets, end = _pack(shapes, numels, shard, alignment)
        except _NeedsMultipleOf as need:
            multiple = math.lcm(multiple, need.row)
            continue
        if end <= dp_size * shard:
            break
        shard += -(-(end - dp_size * shard) // dp_size)
    return FlatLayout(shapes, numels, tuple(offsets), alignment, dp_size, end, dp_size * shard)


def _pack_unsplit(numels, alignment: int) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for numel in numels:
        cursor = _round_up(cursor, alignment)
        offsets.append(cursor)
        cursor += numel
    return offsets, cursor


def default_alignment(device) -> int:
    """Elements each parameter's offset is rounded up to: 1 on CPU (no padding), 64 on GPUs so
    every parameter view starts on a 128-byte boundary that vectorised kernels like."""
    return 64 if getattr(device, "type", device) == "cuda" else 1
