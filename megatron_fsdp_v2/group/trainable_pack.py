"""Reducing only what requires grad: where a group's trainable parameters go in a packed reduce buffer
once some of them were frozen after wrapping.

[Note: reducing what requires grad]
A group is laid out once, at wrap time, over every parameter it holds (layout.py). Parameters
frozen *before* wrapping sit in a group of their own that is never reduced; parameters frozen
*after* wrapping (``requires_grad_(False)`` between steps, honoured at the next training forward:
``Engine.sync_requires_grad``) share their group's buffer with the parameters still trained. Reducing
that whole buffer would move the frozen parameters' zeros too (a model whose weights were frozen,
biases left: the weights' bytes). So such a group reduces a packed buffer of its trainable part:

* all-reduce (``no_shard``): every rank needs every trainable gradient. The packed buffer is laid
  out exactly as the group a model frozen before wrapping would have built for the same parameters
  (``build_layout`` of their shapes, same data-parallel size and alignment): the same bytes, the same
  calls, bitwise the same sums.
* reduce-scatter (``optim``, ``optim_grads``, ``optim_grads_params``): rank ``r`` must receive the
  rows of the trainable parameters that *its* main shard holds, since its optimizer steps those rows
  (the main weights and the optimizer state keep the wrap-time layout). Rank ``r``'s chunk of the
  input is therefore its trainable pieces of the group's layout, back to back: ``T_r`` elements,
  which differ between ranks, so the collective is torch's list ``reduce_scatter`` with uneven
  chunks (NCCL runs it as grouped reduces, gloo natively). Its input is sized as the
  trainable-only layout a model frozen before wrapping would have built (``build_layout`` of the
  same shapes, same data-parallel size and alignment: ``dp * S`` elements, ``S`` its shard): the
  ``dp * S - sum T_r`` elements that layout spends on padding are zeros at the end of the last
  rank's chunk. So freezing before or after wrapping reduces the same bytes in the same number of
  calls, whatever the wrap-time layout did with the trainable rows (a single equal-chunk
  reduce-scatter would have to cover ``dp * max_r T_r``: all trainable rows on one rank made it
  ``dp`` times the trainable bytes).

Hybrid sharding's average across replicas all-reduces the same packed part of this rank's reduced
gradients (``chunk`` elements). HFSDP (``outer_sharding_strategy``) keeps reducing the whole
buffer: its reduce runs block by block over two levels of shards.

Unfreezing a parameter that was trainable at wrap time puts it back in the pack; with every
parameter trainable again the group reduces its whole buffer as before (no pack at all).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch

from .layout import FlatLayout, build_layout

__all__ = ["Move", "TrainablePack", "trainable_pack"]


class Move(NamedTuple):
    """Elements ``[param_start, param_end)`` of flattened parameter ``index`` at ``packed`` in the
    packed reduce input."""

    index: int
    param_start: int
    param_end: int
    packed: int


class TrainablePack(NamedTuple):
    """The packed reduce of a group's trainable parameters (see the note above).

    ``numel``: the collective's input; ``chunk``: what this rank receives (the whole input for an
    all-reduce); ``splits``: every rank's chunk of the input, in rank order (reduce-scatter; empty
    for an all-reduce). ``moves``: every trainable piece's place in the input. ``own``: ``(at, offset,
    numel)`` triples, ``at`` in this rank's received chunk and ``offset`` in its reduced-gradient
    buffer laid out like ``main_shard`` (``ParamGroup.main_grad_buffer``)."""

    numel: int
    chunk: int
    moves: tuple
    own: tuple
    splits: tuple = ()

    def pack_flat(self, packed: torch.Tensor, source: torch.Tensor, layout: FlatLayout) -> None:
        """``packed`` from ``source``, a buffer laid out by ``layout`` in the order its collective
        reads (DDP / ZeRO-1's full grads; a move never crosses a rank's piece)."""
        with torch.no_grad():
            packed.zero_()
            for move in self.moves:
                start = layout.buffer_position(move.index, move.param_start)
                n = move.param_end - move.param_start
                packed[move.packed:move.packed + n].copy_(source[start:start + n])

    def gather_own(self, buffer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``chunk`` elements) holding this rank's trainable pieces of ``buffer``."""
        with torch.no_grad():
            out.zero_()
            for at, offset, n in self.own:
                out[at:at + n].copy_(buffer[offset:offset + n])
        return out

    def scatter_own(self, received: torch.Tensor, buffer: torch.Tensor, add: bool = False, alpha: float = 1.0) -> None:
        """This rank's pieces of ``received`` written (or, ``add``, added times ``alpha``) into ``buffer``."""
        with torch.no_grad():
            for at, offset, n in self.own:
                piece = received[at:at + n].to(buffer.dtype)
                if add:
                    buffer[offset:offset + n].add_(piece, alpha=alpha)
                else:
                    buffer[offset:offset + n].copy_(piece)


@functools.lru_cache(maxsize=1024)
def trainable_pack(layout: FlatLayout, trainable: Sequence[bool], scatter: bool, rank: int) -> Optional[TrainablePack]:
    """The pack of ``trainable``'s parameters (a tuple of flags), or None when every one is trainable
    (reduce the whole buffer) or none is (nothing to reduce). Cached: a group asks at every reduce."""
    if all(trainable) or not any(trainable):
        return None
    indices = [i for i, keep in enumerate(trainable) if keep]
    sub = build_layout([layout.shapes[i] for i in indices], layout.dp_size, layout.alignment, layout.per_parameter)
    if not scatter:
        moves = tuple(Move(i, 0, layout.numels[i], sub.offsets[k]) for k, i in enumerate(indices))
        own = tuple((m.packed, layout.offsets[m.index], layout.numels[m.index]) for m in moves)
        return TrainablePack(sub.total_numel, sub.total_numel, moves, own)
    moves, own, splits, cursor = [], [], [], 0
    for r in range(layout.dp_size):
        at = 0
        for i in indices:
            piece = layout.shard_slice(i, r)
            if not piece.numel:
                continue
            moves.append(Move(i, piece.param_start, piece.param_end, cursor + at))
            if r == rank:
                own.append((at, piece.shard_start, piece.numel))
            at += piece.numel
        splits.append(at)
        cursor += at
    splits[-1] += sub.total_numel - cursor       # the trainable-only layout's padding ([Note] above)
    return TrainablePack(sub.total_numel, splits[rank], tuple(moves), tuple(own), tuple(splits))
