"""Transform whole matrices whose rows are spread over ranks: each on one owner rank, the rows
there and the results' rows back in one all-to-all each per process group (matrix_owners.py,
[Note: distributed Muon's exchange]). ``transform_whole_matrices`` is the one entry point; Muon
(muon.py) and Megatron's orthogonalized optimizers (megatron/muon.py) both step through it."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..comm import Communicator
from ..row_sharded import local_piece
from .matrix_owners import Exchange, build_exchange
from .placement import matrix_rows

__all__ = ["MatrixBucket", "transform_whole_matrices"]


class MatrixBucket:
    """``put_rows`` each matrix's rows, ``start_gather``, ``transform`` (waits, runs the owner's
    work, starts the scatter back), then ``result_rows`` (waits once) gives this rank's rows of each
    result."""

    comm: Communicator
    exchange: Exchange
    mine: torch.Tensor            # this rank's rows of every matrix, grouped by owner (sent, then received back)
    owned: torch.Tensor           # the matrices this rank owns, whole, grouped by source rank
    _pending: Optional[object]    # the all-to-all in flight (a torch.distributed Work)

    def __init__(self, comm: Communicator, shapes: Sequence, row_splits: Sequence, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.comm = comm
        self.exchange = build_exchange(shapes, row_splits, comm.size, comm.rank)
        self.mine = torch.empty(self.exchange.mine_numel, dtype=dtype, device=device)
        self.owned = torch.empty(self.exchange.owned_numel, dtype=dtype, device=device)
        self._pending = None

    def put_rows(self, index: int, rows: torch.Tensor) -> None:
        """This rank's rows of matrix ``index`` (cast to the exchange's dtype as they are copied in)."""
        start, numel = self.exchange.mine[index]
        self.mine[start:start + numel].view(rows.shape).copy_(rows)

    def start_gather(self) -> None:
        ex = self.exchange
        self._pending = self.comm.all_to_all(self.owned, self.mine, ex.owned_splits, ex.mine_splits, ex.covered_numel,
                                             async_op=True, label="matrix rows to their owners")

    def transform(self, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """Wait for the gather; replace each owned matrix by ``fn(index, whole matrix)`` (same shape)
        in the slots its rows came from; start the scatter back."""
        self._wait()
        ex = self.exchange
        for index, pieces in ex.owned.items():
            rows, cols = ex.shapes[index]
            whole = torch.cat([self.owned[start:start + numel] for start, numel in pieces]).view(rows, cols)
            result = fn(index, whole)
            row = 0
            for start, numel in pieces:      # (matrices have elements: empty ones never get here)
                self.owned[start:start + numel].view(numel // cols, cols).copy_(result[row:row + numel // cols])
                row += numel // cols
        self._pending = self.comm.all_to_all(self.mine, self.owned, ex.mine_splits, ex.owned_splits, ex.covered_numel,
                                             async_op=True, label="transformed rows back to their ranks")

    def result_rows(self, index: int, local_shape: torch.Size) -> torch.Tensor:
        """This rank's rows of matrix ``index``'s result (a view of ``mine``)."""
        self._wait()
        start, numel = self.exchange.mine[index]
        return self.mine[start:start + numel].view(local_shape)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def transform_whole_matrices(params: Sequence[torch.Tensor], rows: Sequence[torch.Tensor],
                             fn: Callable[[int, torch.Tensor], torch.Tensor], dtype: torch.dtype,
                             communicators: dict, placements: dict,
                             meanwhile: Optional[Callable[[], None]] = None) -> list:
    """``fn(i, M_i)`` for each matrix ``M_i`` whose rows ``rows[i]`` this rank holds of the 2-D
    parameter ``params[i]``; returns this rank's rows of each result.

    Matrices every rank holds whole are transformed here, on ``rows[i]`` as it is; the others in one
    bucket per process group: rows cast to ``dtype`` go to each matrix's owner, which runs ``fn``,
    and come back (results in ``dtype``). ``meanwhile()`` runs while the rows travel.
    ``communicators`` / ``placements`` are the caller's caches (placement.py). Every rank must pass
    the same parameters in the same order."""
    buckets: dict = {}          # id(comm) -> (bucket inputs)
    results: list = [None] * len(params)
    for i, p in enumerate(params):
        key = id(p)
        if key not in placements:
            placements[key] = matrix_rows(p, communicators, f"parameter of shape {tuple(p.shape)}")
        where = placements[key]
        if where is not None and p.numel():
            buckets.setdefault(id(where.comm), (where.comm, []))[1].append((i, where))
    started = []
    for comm, members in buckets.values():
        bucket = MatrixBucket(comm, [w.shape for _, w in members], [w.row_splits for _, w in members],
                              rows[members[0][0]].device, dtype)
        for index, (i, _) in enumerate(members):
            bucket.put_rows(index, rows[i])
        bucket.start_gather()
        started.append((bucket, members))
    if meanwhile is not None:
        meanwhile()
    sharded = {i for _, members in started for i, _ in members}
    for i in range(len(params)):
        if i not in sharded:
            results[i] = fn(i, rows[i])
    for bucket, members in started:
        bucket.transform(lambda index, whole, members=members: fn(members[index][0], whole))
    for bucket, members in started:
        for index, (i, _) in enumerate(members):
            results[i] = bucket.result_rows(index, local_piece(params[i]).shape)
    return results
