"""The functional suite's collective counter: the CPU suite's, filtered to one process group."""

from __future__ import annotations

import torch.distributed as dist

from tests.comm_counter import CollectiveCounter as _Counter


class CollectiveCounter(_Counter):
    """Counts the collectives on ``group`` (default: the world group)."""

    def __init__(self, group=None) -> None:
        super().__init__(group if group is not None else dist.group.WORLD)
