"""The gradient norm's terms of a rank (``clip_grad_norm_``): each process group's share, made whole
over it when the strategy shards the gradients' owners (expert parameters have their own group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..row_sharded import local_piece

__all__ = ["clip_norm_terms"]


def clip_norm_terms(engine, groups, comm, norm_type: float) -> torch.Tensor:
    """This rank's share of the gradient norm (sum of |g|^p, or the max for inf) of ``groups``,
    made whole over ``comm`` when the strategy shards gradients' owners over it."""
    inf = norm_type == float("inf")
    grads = [local_piece(m.grad) for g in groups for m in g.main_params
             if m.grad is not None and local_piece(m.grad).numel()]
    device = engine.groups[0].device
    if inf:
        total = max((gr.detach().abs().max().float() for gr in grads), default=torch.zeros((), device=device))
        total = total.clone().to(device)
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for gr in grads:
            total += gr.detach().float().norm(norm_type) ** norm_type
    if engine.strategy.optim_sharded:      # disjoint shards: add (or max) them; unsharded grads are replicated
        comm.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, label="grad norm")
    return total
