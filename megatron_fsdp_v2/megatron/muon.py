"""``--optimizer muon`` on FullyShardedDataParallel chunks: Megatron's own Muon (``TensorParallelMuon``,
an ``emerging_optimizers`` ``OrthogonalizedOptimizer``) stepping the main weights' rows, each matrix
orthogonalized whole on one rank (the core's optim/matrix_bucket.py).

[Note: Megatron's Muon on row pieces]
Megatron builds its Muon leaf as for its own DDP (``get_optimizer``: no distributed optimizer,
FP32Optimizer, Adam for the non-matrix parameters). Its step is, per parameter: weight decay,
momentum ``lerp``, Nesterov ``lerp`` (elementwise, so on a rank's rows as on the whole), then
``orthogonalize(p, M)`` (Newton-Schulz in fp32 under ``muon_fp32_matmul_prec``, the QKV split, the
scale factor: it needs M whole), then ``p += -lr * O``. The leaf's class is swapped for a subclass
whose step runs the elementwise parts on each rank's rows and hands the matrices to
``transform_whole_matrices`` with ``orthogonalize`` itself as the owner's work: Megatron's update,
exactly, with the rows travelling in fp32 (its Newton-Schulz takes fp32 only). QKV is tagged from
the parameter's original shape (Megatron tags it from the shape it sees, which for a piece is the
piece's rows).
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from ..optim.matrix_bucket import transform_whole_matrices
from .adapter import ORIGINAL_SHAPE_ATTR

__all__ = ["distribute_orthogonalized", "require_emerging_optimizers"]

_SUBCLASSES: dict = {}


def require_emerging_optimizers() -> None:
    try:
        import emerging_optimizers  # noqa: F401
    except ImportError as exc:
        raise ImportError("get_optimizer: optimizer='muon' (--optimizer muon) runs Megatron's Muon, which needs the "
                          "emerging-optimizers package: pip install 'megatron_fsdp_v2[muon]' (emerging-optimizers "
                          "0.3.0).") from exc


def distribute_orthogonalized(optimizer, chunks, leaves: list) -> None:
    """Make every Muon leaf of ``optimizer`` (over ``chunks``' main weights) step row pieces; see
    [Note: Megatron's Muon on row pieces]."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    for leaf in leaves:
        inner = getattr(leaf, "optimizer", None)
        if not isinstance(inner, TensorParallelMuon):
            continue
        if type(inner) is not TensorParallelMuon:
            raise ValueError(f"get_optimizer: {type(inner).__name__} (a Muon variant) is not supported here; "
                             f"optimizer='muon' is.")
        inner.__class__ = _row_pieces_class(TensorParallelMuon)
        _tag_qkv_by_original_shape(inner, chunks)


def _tag_qkv_by_original_shape(inner, chunks) -> None:
    split = inner.qkv_split_shapes
    names = {id(p): n for chunk in chunks for n, p in chunk.named_parameters()}
    for group in inner.param_groups:
        for p in group["params"]:
            shape = tuple(getattr(p, ORIGINAL_SHAPE_ATTR, None) or p.shape)
            if "linear_qkv.weight" in names.get(id(p), "") and len(shape) == 2 and split:
                p.is_qkv = shape[0] % sum(split) == 0
                if p.is_qkv:
                    p.qkv_split_shapes = split


def _row_pieces_class(base: type) -> type:
    if base not in _SUBCLASSES:
        # torch's global step hooks (the engine's weight refresh after the step) wrap a class's step
        # when its first instance is built; the swapped-in class's step is wrapped here instead
        step = Optimizer.profile_hook_step(_step)
        step.hooked = True
        _SUBCLASSES[base] = type(f"RowPieces{base.__name__}", (base,), {"step": step, "initial_state": _initial_state})
    return _SUBCLASSES[base]


def _initial_state(self, param) -> dict:
    """The state the first step makes (checkpoint/state_dict.py saves it before any step)."""
    return {"momentum_buffer": torch.zeros_like(param)}


@torch.no_grad()
def _step(self, closure=None):
    """``OrthogonalizedOptimizer.step`` on row pieces (emerging_optimizers 0.3.0's order)."""
    from emerging_optimizers import utils

    if closure is not None:
        raise ValueError("closure is not supported")
    jobs = []
    for group in self.param_groups:
        self._init_group(group)
        for p in group["params"]:
            if p.grad is None:
                continue
            grad, state = p.grad, self.state[p]
            self._apply_weight_decay_inplace(p, grad, group["lr"], group["weight_decay"])
            state["momentum_buffer"].lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(state["momentum_buffer"], group["momentum"]) if self.nesterov else state["momentum_buffer"]
            jobs.append((group, p, update))

    def orthogonalize(i: int, matrix: torch.Tensor) -> torch.Tensor:
        group, p, _ = jobs[i]
        with utils.fp32_matmul_precision(self.fp32_matmul_prec):
            return self.orthogonalize(p, matrix, **{k: v for k, v in group.items() if k != "params"})

    communicators, placements = self.__dict__.setdefault("_fsdp_v2_placement_caches", ({}, {}))
    results = transform_whole_matrices([p for _, p, _ in jobs], [u for _, _, u in jobs], orthogonalize, torch.float32,
                                       communicators, placements)
    for (group, p, _), update in zip(jobs, results):
        self.pre_weight_update_fn_inplace(p, update)
        p.add_(update, alpha=-group["lr"])
        self.post_weight_update_fn_inplace(p)
    return None
