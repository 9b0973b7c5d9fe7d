"""Copies between a group's two buffer orders under per-parameter shards (layout.py, [Note:
per-parameter shards]): *rank-major*, what an all-gather fills and a reduce-scatter reads (rank
``r``'s shard, then rank ``r + 1``'s), and *natural*, each parameter contiguous, what the
parameter views read. Under row-snapped shards the two are one buffer (``own_from_natural`` is
then a slice, copied).

Parameter ``i`` takes columns ``[start_i, start_i + piece_i)`` of the rank-major buffer viewed as
``[dp, shard]`` and elements ``[dp * start_i, dp * (start_i + piece_i))`` of the natural one viewed
as ``[dp, piece_i]``: the same ``[dp, piece_i]`` block. Gathered weights go to natural order in
one ``torch.split_with_sizes_copy`` over all parameters (as FSDP2 copies its all-gather output
out); gradients go the other way one parameter at a time (``write_rank_major``), each let go as
soon as it is written.
"""

from __future__ import annotations

import torch

from .layout import FlatLayout

__all__ = ["add_rank_major", "natural_from_gathered", "own_from_natural", "write_rank_major"]


def _pieces(layout: FlatLayout) -> list[int]:
    """Column widths of the rank-major ``[dp, shard]`` view: every parameter's piece, then the
    shard's end padding (if any)."""
    widths = [layout.piece_numel(i) for i in range(len(layout.shapes))]
    tail = layout.shard_numel - sum(widths)
    return widths + [tail] if tail else widths


def _natural_blocks(natural: torch.Tensor, layout: FlatLayout, widths: list[int]) -> list[torch.Tensor]:
    blocks, start = [], 0
    for width in widths:
        blocks.append(natural[layout.dp_size * start:layout.dp_size * (start + width)].view(layout.dp_size, width))
        start += width
    return blocks


def natural_from_gathered(gathered: torch.Tensor, layout: FlatLayout, natural: torch.Tensor) -> None:
    """Write a rank-major buffer (an all-gather's output) into ``natural`` (both ``total_numel``)."""
    widths = _pieces(layout)
    with torch.no_grad():
        torch.split_with_sizes_copy(gathered.view(layout.dp_size, layout.shard_numel), widths, dim=1,
                                    out=_natural_blocks(natural, layout, widths))


def own_from_natural(natural: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    """A copy of this rank's shard of a natural buffer."""
    start, end = layout.shard_range(rank)
    if not layout.per_parameter:
        return natural[start:end].clone()
    widths = _pieces(layout)
    with torch.no_grad():
        return torch.cat([block[rank] for block in _natural_blocks(natural, layout, widths)])


def _rank_major_block(flat: torch.Tensor, layout: FlatLayout, index: int) -> torch.Tensor:
    """Parameter ``index``'s ``[dp, piece]`` columns of the rank-major ``flat``."""
    start, width = layout.piece_start(index), layout.piece_numel(index)
    return flat.view(layout.dp_size, layout.shard_numel)[:, start:start + width]


def add_rank_major(flat: torch.Tensor, layout: FlatLayout, index: int, values: torch.Tensor) -> None:
    """Add parameter ``index``'s flattened ``values`` into its pieces of the rank-major ``flat``
    (ZeRO-1 accumulates its full-size gradients in the order its reduce-scatter reads)."""
    width = layout.piece_numel(index)
    if width == 0:
        return
    block = _rank_major_block(flat, layout, index)
    full_ranks, rest = divmod(values.numel(), width)
    with torch.no_grad():
        block[:full_ranks].add_(values[:full_ranks * width].view(full_ranks, width))
        if rest:
            block[full_ranks, :rest].add_(values[full_ranks * width:])


def write_rank_major(flat: torch.Tensor, layout: FlatLayout, index: int, values) -> None:
    """Parameter ``index``'s flattened ``values`` (None: zeros) into its pieces of the rank-major
    ``flat``, the padding of its short pieces zeroed."""
    width = layout.piece_numel(index)
    if width == 0:
        return
    block = _rank_major_block(flat, layout, index)
    with torch.no_grad():
        if values is None:
            block.zero_()
            return
        full_ranks, rest = divmod(values.numel(), width)
        block[:full_ranks].copy_(values[:full_ranks * width].view(full_ranks, width))
        if full_ranks < layout.dp_size:
            block[full_ranks, :rest].copy_(values[full_ranks * width:])
            block[full_ranks, rest:].zero_()
            block[full_ranks + 1:].zero_()
