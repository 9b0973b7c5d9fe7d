"""Writes into an indexed piece of a sharded parameter: refused on every rank, not lost.

[Note: an index along the sharded dimension is a copy]
For a plain tensor ``p[1]`` and ``p[0:2]`` are views: ``p[1] = 7.0``, ``p[1].zero_()`` and
``p[0:2].mul_(2)`` change ``p``. For a ``Shard(0)`` DTensor (FSDP2's parameters and ours) the rows
live on several ranks, so DTensor answers ``select``/``slice`` along the sharded dimension with a
gathered, replicated *copy*, and a write into it changes nothing. Whether the write raises depends
on torch: up to 2.14 ``p[1] = 7.0`` raises ``aten.fill_.Tensor does not have a sharding strategy``,
on 2.15 that op has a rule and the assignment silently writes nothing; ``p[1].zero_()``,
``p[1].add_(1)`` and ``p[1, 2] = 4.0`` write nothing on every torch (2.11 to 2.15).

So, for DTensors on this package's meshes, the copy that such an index returns is marked, the mark
follows further ``select``/``slice`` of it, and an in-place write into a marked tensor raises the
same error on every rank (the mark depends only on placements and shapes, which every rank shares;
no collective is involved). Reads are unchanged (``p[0]`` is the full row on every rank), a
``.clone()`` is the caller's own tensor again, and an index along an unsharded dimension
(``p[:, 0] = 3.0``) is a true view, left to DTensor. FSDP2's parameters (other meshes) keep
DTensor's behaviour.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from .op_handlers import default_path, on_our_mesh

__all__ = ["install_indexed_write_handlers"]

_aten = torch.ops.aten
_COPY_MARK = "_megatron_fsdp_v2_gathered_index"     # attribute on the DTensor: the index that made it

_INDEX_OPS = (_aten.select.int, _aten.slice.Tensor)
_WRITE_OPS = (
    _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.copy_.default, _aten.zero_.default,
    _aten.add_.Tensor, _aten.add_.Scalar, _aten.sub_.Tensor, _aten.sub_.Scalar,
    _aten.mul_.Tensor, _aten.mul_.Scalar, _aten.div_.Tensor, _aten.div_.Scalar,
    _aten.clamp_.default, _aten.masked_fill_.Scalar, _aten.masked_fill_.Tensor,
    _aten.uniform_.default, _aten.normal_.default, _aten.index_put_.default,
    _aten.lerp_.Scalar, _aten.lerp_.Tensor, _aten.addcmul_.default, _aten.addcdiv_.default,
)


def _is_sharded_along(tensor: DTensor, dim: int) -> bool:
    """Whether ``tensor``'s rows along ``dim`` are spread over more than one rank."""
    dim = dim % max(tensor.dim(), 1)
    return any(isinstance(p, Shard) and p.dim == dim and tensor.device_mesh.size(i) > 1
               for i, p in enumerate(tensor.placements))


def _index_handler(op, args, kwargs):
    """[Note: an index along the sharded dimension is a copy]"""
    source = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    out = default_path(op, args, kwargs)
    if isinstance(out, DTensor) and on_our_mesh(source):
        made_by = getattr(source, _COPY_MARK, None)
        if made_by is None and _is_sharded_along(source, dim):
            made_by = f"an index along dimension {dim % max(source.dim(), 1)}, which {source.placements} spreads over ranks"
        if made_by is not None:
            setattr(out, _COPY_MARK, made_by)
            _install_write_handlers()
    return out


def _write_handler(op, args, kwargs):
    """[Note: an index along the sharded dimension is a copy]"""
    made_by = getattr(args[0], _COPY_MARK, None) if isinstance(args[0], DTensor) else None
    if made_by is not None:
        raise RuntimeError(
            f"{op}: writing into an indexed piece of a sharded parameter, made by {made_by}. DTensor answers "
            "such an index with a gathered copy, so the write would be lost on every rank. Write the whole "
            "tensor instead: full = p.full_tensor(); edit full; p.copy_(distribute_tensor(full, p.device_mesh, "
            "p.placements)) under torch.no_grad(); or take .clone() for a copy of your own.")
    return default_path(op, args, kwargs)


def _install_write_handlers() -> None:
    """The write checks, from the first marked copy on: until then no DTensor's in-place op (of
    ours or anyone's in the process) pays for them (about 6 us a call on CPU,
    ``mul_`` of a 64 x 64 DTensor: 18.0 -> 23.6 us)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    if handlers.get(_WRITE_OPS[0]) is _write_handler:
        return
    for op in _WRITE_OPS:
        handlers.setdefault(op, _write_handler)


def install_indexed_write_handlers() -> None:
    """Register the index handlers (idempotent; an op that already has a handler of torch's is left
    alone); the write handlers follow with the first marked copy."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _INDEX_OPS:
        handlers.setdefault(op, _index_handler)
