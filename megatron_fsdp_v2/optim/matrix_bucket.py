"""The matrices of one step over one process group: their two all-to-alls and the two flat
buffers they move (matrix_owners.py, [Note: distributed Muon's exchange])."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..comm import Communicator
from .matrix_owners import Exchange, build_exchange
from .newton_schulz import WIRE_DTYPE

__all__ = ["MatrixBucket"]


class MatrixBucket:
    """``put_rows`` each matrix's rows, ``start_gather``, ``orthogonalize`` (waits, runs the owner's
    work, starts the scatter back), then ``update_rows`` (waits once) gives this rank's rows of each
    update."""

    comm: Communicator
    exchange: Exchange
    mine: torch.Tensor            # this rank's rows of every matrix, grouped by owner (sent, then received back)
    owned: torch.Tensor           # the matrices this rank owns, whole, grouped by source rank
    _pending: Optional[object]    # the all-to-all in flight (a torch.distributed Work)

    def __init__(self, comm: Communicator, shapes: Sequence, row_splits: Sequence, device: torch.device) -> None:
        self.comm = comm
        self.exchange = build_exchange(shapes, row_splits, comm.size, comm.rank)
        self.mine = torch.empty(self.exchange.mine_numel, dtype=WIRE_DTYPE, device=device)
        self.owned = torch.empty(self.exchange.owned_numel, dtype=WIRE_DTYPE, device=device)
        self._pending = None

    def put_rows(self, index: int, rows: torch.Tensor) -> None:
        """This rank's rows of matrix ``index`` (cast to the wire dtype as they are copied in)."""
        start, numel = self.exchange.mine[index]
        self.mine[start:start + numel].view(rows.shape).copy_(rows)

    def start_gather(self) -> None:
        ex = self.exchange
        self._pending = self.comm.all_to_all(self.owned, self.mine, ex.owned_splits, ex.mine_splits, ex.covered_numel,
                                             async_op=True, label="Muon: matrix rows to their owners")

    def orthogonalize(self, transform: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """Wait for the gather; replace each owned matrix by ``transform(index, whole matrix)`` (same
        shape) in the slots its rows came from; start the scatter back."""
        self._wait()
        ex = self.exchange
        for index, pieces in ex.owned.items():
            rows, cols = ex.shapes[index]
            whole = torch.cat([self.owned[start:start + numel] for start, numel in pieces]).view(rows, cols)
            result = transform(index, whole)
            row = 0
            for start, numel in pieces:      # (matrices have elements: the optimizer steps empty ones locally)
                self.owned[start:start + numel].view(numel // cols, cols).copy_(result[row:row + numel // cols])
                row += numel // cols
        self._pending = self.comm.all_to_all(self.mine, self.owned, ex.mine_splits, ex.owned_splits, ex.covered_numel,
                                             async_op=True, label="Muon: updates back to the rows' ranks")

    def update_rows(self, index: int, local_shape: torch.Size) -> torch.Tensor:
        """This rank's rows of matrix ``index``'s update (a view of ``mine``)."""
        self._wait()
        start, numel = self.exchange.mine[index]
        return self.mine[start:start + numel].view(local_shape)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
