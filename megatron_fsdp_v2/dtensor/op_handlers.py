"""DTensor op handlers for what torch's DTensor gets wrong on our parameters: max-like reductions
where a rank holds no rows, a Python scalar read from a partial result, and ``SGD(fused=True)``.

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

[Note: a scalar of a partial result]
A full reduction of a ``Shard(0)`` DTensor (``p.sum()``, ``p.max()``, ``p.norm()``) is lazily
``Partial``: each rank holds its piece's sum, and only a redistribution to ``Replicate``
(``full_tensor()``, or an op that needs it) combines them. ``float(p.sum())``, ``p.max().item()`` and
``bool((p > 0).any())`` read the local tensor directly (``aten._local_scalar_dense``), so they return
this rank's partial value: silently wrong, different on every rank (torch 2.11 to 2.15; FSDP2's
parameters too). For a DTensor on one of this package's meshes (its dimension is named
``megatron_fsdp_v2_dp_*``: what our parameters and everything computed from them live on) the
handler makes the partial value whole first, one all-reduce of one element, which every rank
issues, since every rank reads the same scalar (as any op on a sharded tensor is called on every
rank). DTensors on other meshes take DTensor's path unchanged: a user reading a scalar on one
rank only of their own partial tensor must not be made to wait for the others.

[Note: fused SGD on DTensors]
torch registers DTensor rules for the fused Adam and AdamW kernels but not for fused SGD
(``aten._fused_sgd_``: "does not have a sharding strategy registered", torch 2.11 to 2.15), so
``torch.optim.SGD(fused=True)`` cannot step FSDP2's parameters. The kernel is elementwise over
its lists (parameters, gradients, momentum buffers), so when every DTensor in them has the same
placements it runs on the local pieces, as DTensor runs fused Adam.
"""

from __future__ import annotations

import math
import threading

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["OUR_MESH_PREFIX", "default_path", "install_dtensor_op_handlers", "on_our_mesh"]

OUR_MESH_PREFIX = "megatron_fsdp_v2_dp_"      # row_sharded.mesh_of_group names its meshes so

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


def default_path(op, args, kwargs):
    """DTensor's own path for ``op``: the handler steps aside for the call."""
    with _LOCK:
        handler = DTensor._op_dispatcher._custom_op_handlers.pop(op)
        try:
            return op(*args, **kwargs)
        finally:
            DTensor._op_dispatcher._custom_op_handlers[op] = handler


def _reduction_handler(op, args, kwargs):
    fill = _fill_for(op, args, kwargs)
    if fill is not None:
        if op is _aten._foreach_norm.Scalar:
            args = ([_filled(t, fill) for t in args[0]],) + tuple(args[1:])
        else:
            args = (_filled(args[0], fill, _reduced_dims(op, args, kwargs)),) + tuple(args[1:])
    return default_path(op, args, kwargs)


def on_our_mesh(tensor: DTensor) -> bool:
    names = tensor.device_mesh.mesh_dim_names or ()
    return any(name.startswith(OUR_MESH_PREFIX) for name in names)


def _scalar_handler(op, args, kwargs):
    """[Note: a scalar of a partial result]"""
    tensor = args[0]
    if on_our_mesh(tensor) and any(isinstance(p, Partial) for p in tensor.placements):
        whole = tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
        return whole.to_local().item()
    return default_path(op, args, kwargs)


def _local_pieces(value):
    if isinstance(value, DTensor):
        return value._local_tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_local_pieces(v) for v in value)
    return value


def _fused_sgd_handler(op, args, kwargs):
    """[Note: fused SGD on DTensors]"""
    tensors = [t for group in args[:3] for t in group if isinstance(t, DTensor)]
    if tensors and len({(t.device_mesh, tuple(t.placements)) for t in tensors}) == 1:
        return op(*_local_pieces(args), **{k: _local_pieces(v) for k, v in kwargs.items()})
    return default_path(op, args, kwargs)


_REDUCTIONS = (_aten.max.default, _aten.min.default, _aten.amax.default, _aten.amin.default,
               _aten.linalg_vector_norm.default, _aten._foreach_norm.Scalar)


def install_dtensor_op_handlers() -> None:
    """Register the handlers (idempotent; an op that already has a handler of torch's is left alone)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _REDUCTIONS:
        handlers.setdefault(op, _reduction_handler)
    handlers.setdefault(_aten._local_scalar_dense.default, _scalar_handler)
    for op in (_aten._fused_sgd_.default, _aten._fused_sgd_.tensor_lr):
        handlers.setdefault(op, _fused_sgd_handler)
