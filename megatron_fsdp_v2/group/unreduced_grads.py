"""ZeRO-2/3: one backward's gradients of a group, kept as autograd made them until the group reduces.

[Note: unreduced gradients stay per parameter]
ZeRO-2/3 reduce-scatter a group's gradients in the backward that produced them. Copying each
gradient into a full-size flat buffer when it arrives would allocate the whole group's bytes at
its *first* gradient: in a transformer layer the MLP's gradients come first, and the attention
backward that follows (where the activation memory peaks) would then find slots allocated for
attention gradients that do not exist yet. So a group keeps autograd's tensors (the parameter's
``.grad`` is cleared at once, so nothing else holds them) and, when it reduces, copies them, cast
to the collective's dtype in the same copy, straight into the reduce input: no full-size buffer
in the compute dtype exists at all, and a bf16 model reducing in fp32 no longer holds a bf16 and
an fp32 copy of the group at the same time. FSDP2 keeps per-parameter gradients the same way
(``foreach_reduce`` copies the unsharded gradients into its reduce-scatter input).
"""

from __future__ import annotations

from typing import Optional

import torch

from .layout import FlatLayout
from .shard_order import write_rank_major

__all__ = ["UnreducedGrads"]


class UnreducedGrads:
    """Per parameter index: the gradient this backward produced (summed if it came more than once)."""

    def __init__(self, count: int) -> None:
        self._grads: list[Optional[torch.Tensor]] = [None] * count
        self._held = 0          # how many are not None (asked at every gradient: no scan)

    def add(self, index: int, grad: torch.Tensor) -> None:
        held = self._grads[index]
        # A second gradient in one backward (a parameter used twice): out of place, since the
        # first tensor came from autograd and may be shared with nothing we can see.
        self._grads[index] = grad if held is None else held + grad
        self._held += held is None

    def any(self) -> bool:
        return self._held > 0

    def nbytes(self) -> int:
        return sum(grad.numel() * grad.element_size() for grad in self._grads if grad is not None)

    def clear(self) -> None:
        self._grads = [None] * len(self._grads)
        self._held = 0

    def write_into(self, flat: torch.Tensor, layout: FlatLayout) -> None:
        """Fill ``flat`` (laid out by ``layout``, any dtype): each parameter's gradient in its range,
        zeros where none arrived and in the padding; then let the gradients go (one kernel for the
        group where the layout allows, ``_write_in_one_copy``; else one by one). Per-parameter shards
        (layout.py): each gradient goes to its pieces of the rank-major buffer the reduce-scatter
        reads, so it needs no reordering copy of its own."""
        if self._write_in_one_copy(flat, layout):
            return
        if layout.per_parameter:
            self._write_rank_major(flat, layout)
            return
        with torch.no_grad():
            cursor = 0
            for index in sorted(range(len(self._grads)), key=lambda i: layout.param_range(i)[0]):
                start, end = layout.param_range(index)
                if start > cursor:
                    flat[cursor:start].zero_()
                grad, self._grads[index] = self._grads[index], None
                if grad is None:
                    flat[start:end].zero_()
                else:
                    flat[start:end].copy_(grad.reshape(-1))
                del grad
                cursor = max(cursor, end)
            if cursor < flat.numel():
                flat[cursor:].zero_()
        self._held = 0

    def _write_in_one_copy(self, flat: torch.Tensor, layout: FlatLayout) -> bool:
        """Every gradient in one ``torch._chunk_cat`` (cast and zero-padded in the same kernel, as
        FSDP2's reduce-scatter copy-in), where the layout is that kernel's order
        (``chunk_cat_chunks``) and every parameter got a plain gradient, all of one dtype; else
        False. One launch per group instead of one or two per parameter: what a latency-bound
        step pays for. The gradients all live until it is queued, as they do at the start of the
        per-parameter copies, so the peak is the same."""
        chunks = layout.chunk_cat_chunks
        if not chunks or self._held != len(self._grads) or flat.numel() != layout.total_numel:
            return False
        dtype = self._grads[0].dtype       # the kernel takes plain tensors of one dtype
        if any(type(g) is not torch.Tensor or g.dtype != dtype for g in self._grads):
            return False
        grads, self._grads, self._held = self._grads, [None] * len(self._grads), 0
        written = flat[:layout.data_numel] if chunks == 1 else flat
        with torch.no_grad():
            torch._chunk_cat(grads, 0, chunks, out=written.view(chunks, -1))
            if written.numel() < flat.numel():
                flat[written.numel():].zero_()
        return True

    def _write_rank_major(self, flat: torch.Tensor, layout: FlatLayout) -> None:
        widths = sum(layout.piece_numel(i) for i in range(len(self._grads)))
        with torch.no_grad():
            flat.view(layout.dp_size, layout.shard_numel)[:, widths:].zero_()   # the shard's end padding
            for index in range(len(self._grads)):
                grad, self._grads[index] = self._grads[index], None
                write_rank_major(flat, layout, index, None if grad is None else grad.reshape(-1))
                del grad
        self._held = 0

    def write_packed(self, flat: torch.Tensor, moves) -> None:
        """Fill ``flat`` with the pieces ``moves`` name (trainable_pack.py, [Note: reducing what requires
        grad]), zeros elsewhere; each gradient is let go after its last piece is written."""
        last = {move.index: k for k, move in enumerate(moves)}
        with torch.no_grad():
            flat.zero_()
            for k, move in enumerate(moves):
                grad = self._grads[move.index]
                if grad is not None:
                    piece = grad.reshape(-1)[move.param_start:move.param_end]
                    flat[move.packed:move.packed + piece.numel()].copy_(piece)
                if last[move.index] == k:
                    self._grads[move.index] = None
                del grad
        self.clear()
