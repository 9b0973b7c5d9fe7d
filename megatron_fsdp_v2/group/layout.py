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

[Note: per-parameter shards]
Row-snapped shards can give a rank a whole parameter (dp 2, a block [attention | w1 | w2]: the one
boundary cuts w1, so one rank holds all of w2). Between steps that costs nothing, but an optimizer
that steps one parameter at a time makes temporaries the size of the largest piece a rank holds:
``Adam(foreach=False)`` makes two (``exp_avg_sq.sqrt()`` and its division), 2 x w2 on that rank
where FSDP2, which gives every rank ``ceil(rows / dp)`` rows of every parameter, makes 2 x w2 / 2.
ZeRO-1/2/3 (``build_layout(..., per_parameter=True)``) therefore shard every parameter over every rank
as FSDP2 does: parameter ``i`` is cut into ``dp`` pieces of ``piece_rows[i]`` rows (``ceil(rows /
dp)``, rounded up so a piece is a whole number of alignment units; the last pieces may be short or
empty, torch.chunk's split), and rank ``r``'s shard is its piece of every parameter, back to back,
each padded to ``piece_rows[i] * row`` elements::

    gathered (rank-major), dp 2:   | a0 b0 c0 | a1 b1 c1 |        a: rows of a split in two, ...
    unsharded (natural):           | a0 a1 | b0 b1 | c0 c1 |      parameter views, contiguous

A gathered buffer is therefore in rank-major order and the parameters read a second, natural one:
ZeRO-3 all-gathers into a temporary and copies out (shard_order.py; one
``torch.split_with_sizes_copy``, as FSDP2), and writes gradients rank-major straight into its
reduce-scatter input, which it copies them into anyway. ZeRO-1/2 use the same shards, so that every
sharded parameter is a plain ``DTensor(Shard(0))`` (``torch.chunk``'s rows): their refresh gathers
into the natural buffer in place and reorders it after (param_group.py), ZeRO-1 accumulates its
full-size gradients rank-major. Row-snapped shards remain for HFSDP (and ``no_shard``, unsharded).
Parameter ``i``'s natural range starts at ``dp * start_i`` (``start_i``: where its piece begins in
every shard), so the copy between the two orders is one strided copy per parameter.
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
    piece_rows: tuple[int, ...] = ()   # per-parameter shards: rows of each parameter per rank ([Note])
    chunk_cat_chunks: int = 0          # torch._chunk_cat's num_chunks writing a whole group in this order (0: not)

    @property
    def per_parameter(self) -> bool:
        """Whether every parameter is cut over every rank ([Note: per-parameter shards]): then a
        gathered buffer is rank-major and the parameters' natural buffer differs from it."""
        return bool(self.piece_rows)

    def piece_numel(self, index: int) -> int:
        """Per-parameter shards: the elements every rank's piece of parameter ``index`` takes."""
        return self.piece_rows[index] * self.row_numel(index)

    def piece_start(self, index: int) -> int:
        """Per-parameter shards: where parameter ``index``'s piece begins in every rank's shard."""
        return self.offsets[index] // self.dp_size

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
        if self.per_parameter:
            splits, row = self.row_splits(index), self.row_numel(index)
            if splits[rank] == splits[rank + 1] or row == 0:
                return ShardSlice(0, 0, 0)
            return ShardSlice(splits[rank] * row, splits[rank + 1] * row, self.piece_start(index))
        p_start, p_end = self.param_range(index)
        s_start, s_end = self.shard_range(rank)
        lo, hi = max(p_start, s_start), min(p_end, s_end)
        if lo >= hi:
            return ShardSlice(0, 0, 0)
        return ShardSlice(lo - p_start, hi - p_start, lo - s_start)

    def buffer_position(self, index: int, element: int) -> int:
        """Where element ``element`` of flattened parameter ``index`` sits in a buffer that a
        collective reads or fills (rank-major under per-parameter shards, else natural)."""
        if not self.per_parameter:
            return self.offsets[index] + element
        rank, column = divmod(element, self.piece_numel(index))
        return rank * self.shard_numel + self.piece_start(index) + column

    def row_splits(self, index: int) -> tuple[int, ...]:
        """``dp_size + 1`` row indices: rank ``r`` owns rows ``[splits[r], splits[r + 1])`` of
        parameter ``index`` (0-d parameters: one row)."""
        if self.per_parameter:
            rows = self.shapes[index][0] if self.shapes[index] else 1
            return tuple(min(rank * self.piece_rows[index], rows) for rank in range(self.dp_size + 1))
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


def build_layout(shapes: Sequence[Sequence[int]], dp_size: int, alignment: int = 1,
                 per_parameter: bool = False) -> FlatLayout:
    """Pack parameters of the given shapes into one buffer split over ``dp_size`` row-snapped
    shards ([Note: row-snapped shards]), or, ``per_parameter`` (and ``dp_size > 1``), cut every
    parameter over every rank ([Note: per-parameter shards])."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be positive, got {dp_size}.")
    if alignment < 1:
        raise ValueError(f"alignment must be a positive number of elements, got {alignment}.")
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    for shape in shapes:
        if any(d < 0 for d in shape):
            raise ValueError(f"parameter shapes must have sizes >= 0, got {shape}.")
    numels = tuple(math.prod(s) for s in shapes)
    if per_parameter and dp_size > 1:
        return _per_parameter_layout(shapes, numels, dp_size, alignment)
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
    contiguous = end == sum(numels)          # the packing goes in order: no gap before the end
    return FlatLayout(shapes, numels, tuple(offsets), alignment, dp_size, end, dp_size * shard,
                      chunk_cat_chunks=1 if contiguous and _chunk_cat_shapes(shapes) else 0)


def _chunk_cat_shapes(shapes) -> bool:
    """Whether ``torch._chunk_cat`` takes tensors of these shapes: at least 1-d, not empty (it
    refuses empty tensors and crashes on 0-d ones, torch 2.13)."""
    return all(shape and math.prod(shape) > 0 for shape in shapes)


def _per_parameter_layout(shapes, numels, dp_size: int, alignment: int) -> FlatLayout:
    """[Note: per-parameter shards]: ``dp`` pieces of every parameter, each a whole number of
    alignment units; parameter ``i`` at ``dp * start_i`` in the natural buffer."""
    piece_rows, offsets, start = [], [], 0
    for shape, numel in zip(shapes, numels):
        row = row_numel(shape)
        rows = shape[0] if shape else 1
        per_rank = _round_up(-(-rows // dp_size), alignment // math.gcd(alignment, row))
        piece_rows.append(per_rank)
        offsets.append(dp_size * start)
        start += per_rank * row
    shard = max(start, alignment)            # an all-gather of nothing still needs a shard
    data_end = max((o + n for o, n in zip(offsets, numels)), default=0)
    # torch._chunk_cat's order: every parameter in ceil(rows / dp)-row pieces, back to back, nothing after
    chunk_cat = (shard == start and _chunk_cat_shapes(shapes)
                 and all(rows == -(-shape[0] // dp_size) for rows, shape in zip(piece_rows, shapes)))
    return FlatLayout(shapes, numels, tuple(offsets), alignment, dp_size, data_end, dp_size * shard,
                      tuple(piece_rows), dp_size if chunk_cat else 0)


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
