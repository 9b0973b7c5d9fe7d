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
  (the main weights and the optimizer state keep the wrap-time layout). Chunk ``r`` of the input is
  therefore rank ``r``'s trainable pieces of the group's layout, back to back, each chunk
  ``M = max_r T_r`` elements (``T_r``: trainable elements in rank ``r``'s shard; rounded up to the
  alignment), so the collective covers ``dp * M`` elements and each rank unpacks its chunk into its
  own gradient rows. A model frozen before wrapping reduce-scatters ``dp * S`` (``S``: the shard of
  the trainable-only layout, ``>= ceil(sum T_r / dp)``). The two are equal when the trainable
  elements are spread evenly over the wrap-time shards (``M == S``); otherwise ``dp * M`` is larger
  (at most ``dp * sum T_r``: all trainable rows on one rank), and no single reduce-scatter can do
  better, because its output is equal-sized per rank and rank ``r`` needs ``T_r`` elements of it.
  Matching ``dp * S`` exactly would mean moving the main weights and the optimizer state to the
  trainable-only layout at every freeze and unfreeze (or a second collective per step to move the
  reduced rows to their owners): more bytes than it saves.

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
    all-reduce). ``moves``: every trainable piece's place in the input. ``own``: ``(at, offset,
    numel)`` triples, ``at`` in this rank's received chunk and ``offset`` in its reduced-gradient
    buffer laid out like ``main_shard`` (``ParamGroup.main_grad_buffer``)."""

    numel: int
    chunk: int
    moves: tuple
    own: tuple

    def pack_flat(self, packed: torch.Tensor, source: torch.Tensor, layout: FlatLayout) -> None:
        """``packed`` from ``source``, a buffer laid out by ``layout`` (DDP / ZeRO-1's full grads)."""
        with torch.no_grad():
            packed.zero_()
            for move in self.moves:
                start = layout.offsets[move.index]
                n = move.param_end - move.param_start
                packed[move.packed:move.packed + n].copy_(source[start + move.param_start:start + move.param_end])

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
    if not scatter:
        sub = build_layout([layout.shapes[i] for i in indices], layout.dp_size, layout.alignment)
        moves = tuple(Move(i, 0, layout.numels[i], sub.offsets[k]) for k, i in enumerate(indices))
        own = tuple((m.packed, layout.offsets[m.index], layout.numels[m.index]) for m in moves)
        return TrainablePack(sub.total_numel, sub.total_numel, moves, own)
    per_rank = []
    for r in range(layout.dp_size):
        pieces = [(i, layout.shard_slice(i, r)) for i in indices]
        per_rank.append([(i, piece) for i, piece in pieces if piece.numel])
    most = max(1, max(sum(piece.numel for _, piece in pieces) for pieces in per_rank))
    chunk = -(-most // layout.alignment) * layout.alignment
    moves, own = [], []
    for r, pieces in enumerate(per_rank):
        at = 0
        for i, piece in pieces:
            moves.append(Move(i, piece.param_start, piece.param_end, r * chunk + at))
            if r == rank:
                own.append((at, piece.shard_start, piece.numel))
            at += piece.numel
    return TrainablePack(layout.dp_size * chunk, chunk, tuple(moves), tuple(own))
