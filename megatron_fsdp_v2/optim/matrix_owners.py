"""Which rank orthogonalizes which matrix, and where every piece of the two exchanges sits (pure:
no tensors, no torch.distributed).

[Note: distributed Muon's exchange]
Each rank holds some rows of every matrix (``torch.chunk``'s under ZeRO-1/2/3; HFSDP's row-snapped
ones; possibly none); Newton-Schulz needs a matrix whole. Every matrix gets one owner
(``assign_owners``: the largest first, each to the least-loaded rank, so each rank orthogonalizes
about 1/N of the elements). One all-to-all brings every owner its matrices' rows from every rank;
the owner orthogonalizes them and writes each result back into the slots its rows came from; the
reverse all-to-all returns every rank its rows of the updates, into the slots it sent them from.
Matrices A, C (owner 0) and B (owner 1) at dp 2, rank r holding rows A_r, B_r, C_r:

    "mine" (what a rank sends; grouped by owner)      "owned" (what an owner gets; grouped by source)
    rank 0: | A_0 C_0 | B_0 |                         rank 0: | A_0 C_0 | A_1 C_1 |   A = [A_0; A_1]
              to 0      to 1                                    from 0    from 1       C = [C_0; C_1]
    rank 1: | A_1 C_1 | B_1 |                         rank 1: | B_0 | B_1 |          B = [B_0; B_1]

    gather:  all_to_all(out=owned, in=mine)    scatter: all_to_all(out=mine, in=owned)

So a rank keeps two flat buffers of the exchange's dtype: ``mine`` (its rows, ~Psi_matrix/N) and
``owned`` (its matrices whole, ~Psi_matrix/N by the balance). Over all ranks each exchange moves every
matrix's elements once: 2 Psi_matrix per step (in bfloat16: newton_schulz.py, [Note: why the rows
travel in bfloat16]). Pieces a rank sends itself are counted too (they are in that sum); they never
leave it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Exchange", "assign_owners", "build_exchange"]


def assign_owners(numels: Sequence[int], ranks: int) -> tuple[int, ...]:
    """Owner rank of each matrix: the largest first, each to the rank with the fewest elements so
    far (ties: the lower rank; equal sizes: the earlier matrix first). The same on every rank."""
    if ranks < 1:
        raise ValueError(f"ranks must be positive, got {ranks}.")
    load = [0] * ranks
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += numels[index]
    return tuple(owners)


@dataclass(frozen=True)
class Exchange:
    """One rank's view of the two all-to-alls of a bucket of matrices (see the Note above).

    ``mine[i]``: where this rank's rows of matrix i sit in ``mine`` (start, numel);
    ``owned[i]``: for a matrix this rank owns, where each source rank's rows sit in ``owned``, in rank
    (= row) order; ``mine_splits`` / ``owned_splits``: elements per peer rank, the all-to-all splits.
    """

    shapes: tuple[tuple[int, int], ...]
    owners: tuple[int, ...]
    mine: tuple[tuple[int, int], ...]
    owned: dict
    mine_splits: tuple[int, ...]
    owned_splits: tuple[int, ...]
    covered_numel: int                   # every matrix's elements: what each exchange moves over all ranks

    @property
    def mine_numel(self) -> int:
        return sum(self.mine_splits)

    @property
    def owned_numel(self) -> int:
        return sum(self.owned_splits)


def build_exchange(shapes: Sequence[Sequence[int]], row_splits: Sequence[Sequence[int]], size: int,
                   rank: int) -> Exchange:
    """The exchange of matrices ``shapes`` whose rows rank r holds ``[row_splits[i][r],
    row_splits[i][r + 1])``, seen from ``rank`` of ``size``."""
    shapes = tuple((int(s[0]), int(s[1])) for s in shapes)
    for (rows, _), splits in zip(shapes, row_splits):
        assert len(splits) == size + 1 and splits[0] == 0 and splits[-1] == rows, (rows, splits, size)
    owners = assign_owners([r * c for r, c in shapes], size)
    by_owner = [[i for i in range(len(shapes)) if owners[i] == r] for r in range(size)]

    def piece(i: int, r: int) -> int:
        return (row_splits[i][r + 1] - row_splits[i][r]) * shapes[i][1]

    mine: list = [None] * len(shapes)
    mine_splits, offset = [], 0
    for dest in range(size):
        start = offset
        for i in by_owner[dest]:
            mine[i] = (offset, piece(i, rank))
            offset += piece(i, rank)
        mine_splits.append(offset - start)
    owned: dict = {i: [] for i in by_owner[rank]}
    owned_splits, offset = [], 0
    for source in range(size):
        start = offset
        for i in by_owner[rank]:
            owned[i].append((offset, piece(i, source)))
            offset += piece(i, source)
        owned_splits.append(offset - start)
    return Exchange(shapes, owners, tuple(mine), {i: tuple(p) for i, p in owned.items()}, tuple(mine_splits),
                    tuple(owned_splits), sum(r * c for r, c in shapes))
