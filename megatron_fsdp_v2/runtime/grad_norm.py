"""``clip_grad_norm_`` on the main gradients: the global norm from each process group's share, made
whole over it when the strategy shards the gradients' owners (expert parameters have their own
group: wrap/experts.py, [Note: expert parameters]), then every rank's gradients scaled by one factor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..row_sharded import local_piece

__all__ = ["clip_main_grads", "clip_norm_terms"]


def clip_norm_terms(groups, strategy, comm, norm_type: float) -> torch.Tensor:
    """This rank's share of the gradient norm (sum of |g|^p, or the max for inf) of ``groups``,
    made whole over ``comm`` when the strategy shards gradients' owners over it."""
    inf = norm_type == float("inf")
    grads = [local_piece(m.grad) for g in groups for m in g.main_params
             if m.grad is not None and local_piece(m.grad).numel()]
    device = groups[0].device
    if inf:
        total = max((gr.detach().abs().max().float() for gr in grads), default=torch.zeros((), device=device))
        total = total.clone().to(device)
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for gr in grads:
            total += gr.detach().float().norm(norm_type) ** norm_type
    if strategy.optim_sharded:      # disjoint shards: add (or max) them; unsharded grads are replicated
        comm.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, label="grad norm")
    return total


def clip_main_grads(groups, strategy, comm, experts, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the main gradients of ``groups`` so their global norm is at most ``max_norm``; the norm
    before clipping (fp32; one scalar all-reduce per process group, one more across expert peers)."""
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    total = None
    for group_comm in {id(g.comm): g.comm for g in groups if g.comm is not experts}.values():
        # the data-parallel group; with HFSDP the whole world the main weights are sharded over
        terms = clip_norm_terms([g for g in groups if g.comm is group_comm], strategy, group_comm, norm_type)
        total = terms if total is None else (torch.maximum(total, terms) if inf else total + terms)
    if experts is not None:
        expert_terms = clip_norm_terms([g for g in groups if g.comm is experts], strategy, experts, norm_type)
        comm.all_reduce(expert_terms, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                        label="grad norm (experts across expert-parallel peers)")
        total = torch.maximum(total, expert_terms) if inf else total + expert_terms / experts.size
    if not inf:
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in groups:
        for main in group.main_params:
            grad = local_piece(main.grad)
            if grad is not None and grad.numel():
                grad.detach().mul_(coef.to(grad.device, grad.dtype))   # (offload: host grads)
    return total
