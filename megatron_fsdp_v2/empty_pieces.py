"""Max-like reductions of a DTensor where this rank holds no rows.

[Note: reductions over an empty piece]
``torch.chunk``'s split leaves a rank without rows whenever a parameter has fewer rows than there
are ranks (a bias of 2 rows at dp 3, a 0-d parameter at dp 2). DTensor reduces a ``Shard(0)``
tensor by reducing each piece locally and combining the partial results (``Partial("max")``); for
``max``, ``min``, ``amax``, ``amin`` and the +-inf norms the local step raises on an empty piece
(``max(): Expected reduction dim to be specified for input.numel() == 0``) while the other ranks
wait in the combining collective: FSDP2's parameters hang there the same way. Every other op is
right on an empty piece (a sum is 0, a mean divides by the global count).

So these ops get a DTensor op handler (DTensor's own mechanism for ops whose sharding rule needs
more than propagation; ``loss_parallel`` installs its handlers the same way): an empty piece is
replaced by one element per empty dimension holding the reduction's identity (-inf for a max,
+inf for a min, 0 for an inf-norm), and DTensor then runs its ordinary rule on every rank, so
every rank joins the same collective and the result is the full tensor's. A piece that is not
empty, and a DTensor of any other placement, takes DTensor's path unchanged: the handler only
changes what would have raised. It is installed once, when the package is imported, for every
DTensor of the process.
"""

from __future__ import annotations

import math
import threading

import torch
from torch.distributed.tensor import DTensor

__all__ = ["install_empty_piece_reductions"]

_aten = torch.ops.aten
_LOCK = threading.RLock()


def _identity(dtype: torch.dtype, largest: bool):
    """What a max (``largest`` False: a min) of nothing is."""
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point:
        return math.inf if largest else -math.inf
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


def _filled(value, fill, dims=None) -> object:
    """``value`` with an empty local piece replaced by ``fill`` in one element along each empty
    dimension the reduction covers (``dims``: None or empty, every dimension); unchanged when no
    reduced dimension is empty (the local reduction is then right as it is)."""
    if not isinstance(value, DTensor) or value._local_tensor.numel() != 0:
        return value
    local = value._local_tensor
    reduced = set(range(local.dim())) if not dims else {d % max(local.dim(), 1) for d in dims}
    if not any(local.shape[d] == 0 for d in reduced):
        return value
    shape = tuple(1 if d in reduced and size == 0 else size for d, size in enumerate(local.shape))
    stand_in = torch.full(shape, fill(local.dtype), dtype=local.dtype, device=local.device)
    return DTensor(stand_in, value._spec, requires_grad=False)


def _reduced_dims(op, args, kwargs):
    """The dimensions a call reduces over (None: all of them)."""
    if op in (_aten.amax.default, _aten.amin.default):
        return args[1] if len(args) > 1 else kwargs.get("dim")
    if op is _aten.linalg_vector_norm.default:
        return args[2] if len(args) > 2 else kwargs.get("dim")
    return None


def _norm_identity(ord_value) -> object:
    """An inf-norm's identity on an empty piece, or None for any other order (right as it is)."""
    if ord_value == math.inf:
        return lambda dtype: 0.0
    if ord_value == -math.inf:
        return lambda dtype: math.inf
    return None


def _fill_for(op, args, kwargs):
    """The identity maker for this call, or None when DTensor's path is right as it is."""
    if op in (_aten.max.default, _aten.amax.default):
        return lambda dtype: _identity(dtype, largest=False)
    if op in (_aten.min.default, _aten.amin.default):
        return lambda dtype: _identity(dtype, largest=True)
    ord_value = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    return _norm_identity(ord_value)


def _handler(op, args, kwargs):
    fill = _fill_for(op, args, kwargs)
    if fill is not None:
        if op is _aten._foreach_norm.Scalar:
            args = ([_filled(t, fill) for t in args[0]],) + tuple(args[1:])
        else:
            args = (_filled(args[0], fill, _reduced_dims(op, args, kwargs)),) + tuple(args[1:])
    with _LOCK:                 # DTensor's own path for the (filled) call: the handler stepped aside
        handler = DTensor._op_dispatcher._custom_op_handlers.pop(op)
        try:
            return op(*args, **kwargs)
        finally:
            DTensor._op_dispatcher._custom_op_handlers[op] = handler


_OPS = (_aten.max.default, _aten.min.default, _aten.amax.default, _aten.amin.default,
        _aten.linalg_vector_norm.default, _aten._foreach_norm.Scalar)


def install_empty_piece_reductions() -> None:
    """Register the handler for the max-like reductions (idempotent; an op that already has a
    handler of torch's is left alone)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _OPS:
        handlers.setdefault(op, _handler)
