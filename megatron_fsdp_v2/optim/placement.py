"""Where an optimizer-facing parameter's rows live: asked of the wrapped model that holds it (its
group's Communicator, so the exchange is counted in ``model.comm_stats()``), else read off a
DTensor ``Shard(0)`` (e.g. FSDP2's parameters), else the tensor is whole on every rank."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..comm import Communicator
from ..runtime.optimizer_hook import engine_holding
from ..row_sharded import chunk_splits

__all__ = ["MatrixRows", "matrix_rows"]


class MatrixRows(NamedTuple):
    """A matrix some ranks hold rows of: rank r holds ``[row_splits[r], row_splits[r + 1])``."""

    comm: Communicator
    shape: torch.Size
    row_splits: tuple


def matrix_rows(param: torch.Tensor, communicators: dict, what: str) -> Optional[MatrixRows]:
    """The rows ``param`` (2-D as the optimizer sees it) holds on each rank, or None where every
    rank holds it whole (``no_shard``, a one-rank group, a plain tensor). ``communicators`` caches
    the Communicators made for process groups no wrapped model owns; ``what`` names the parameter
    in errors."""
    engine = engine_holding(param)
    if engine is not None:
        where = engine.main_rows(param)
        if where.on_host:
            raise ValueError(f"{what}: its group is offloaded to the host (OffloadPolicy); Muon orthogonalizes "
                             f"matrices on the device: keep matrices on the device (a smaller offload fraction) "
                             f"or step offloaded groups with AdamW (use_muon=False).")
        if where.row_splits is None or where.comm.size == 1:
            return None
        return MatrixRows(where.comm, where.shape, tuple(where.row_splits))
    if not isinstance(param, DTensor):
        return None
    placements = tuple(param.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    if param.device_mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"{what}: Muon gathers matrices sharded by rows over one mesh dimension (Shard(0)), got "
                         f"placements {placements} on a {param.device_mesh.ndim}-D mesh.")
    size = param.device_mesh.size()
    if size == 1:
        return None
    group = param.device_mesh.get_group()
    comm = communicators.get(group)
    if comm is None:
        comm = communicators[group] = Communicator(group)
    splits = getattr(param, "row_splits", None) or chunk_splits(param.shape[0], size)
    return MatrixRows(comm, param.shape, tuple(splits))
