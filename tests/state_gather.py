"""Full optimizer state from every rank's shards, for tests that compare checkpoints bitwise
(CPU suite and functional suite)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def full_optimizer_state(model, optimizer, group=None, group_of=None) -> dict:
    """``{"state.<name>.<key>": full tensor}`` of ``optimizer`` (torch or Megatron) over ``model``
    (fully_shard module or the Megatron adapter): each rank's flat range, summed over ``group``
    (the ranges are disjoint, so the sum assembles them), or over ``group_of(key)`` where that
    is not None (expert parameters: their expert-data-parallel group). Hyperparameters are left out."""
    from megatron_fsdp_v2.checkpoint import optimizer_state_dict
    from megatron_fsdp_v2.checkpoint.dcp_format import FlatRangeShard

    if not isinstance(optimizer, torch.optim.Optimizer):      # the Megatron adapter's objects
        from megatron_fsdp_v2.megatron import checkpoint_targets

        model, optimizer = checkpoint_targets(model, optimizer)

    full = {}
    for key, value in optimizer_state_dict(model, optimizer).items():
        if key.startswith("param_groups."):
            continue
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif isinstance(value, FlatRangeShard):
            flat = torch.zeros(value.shape.numel(), dtype=value.dtype, device=value.local_flat.device)
            flat[value.flat_start:value.flat_end] = value.local_flat
            dist.all_reduce(flat, group=(group_of(key) if group_of is not None else None) or group)
            value = flat.view(value.shape)
        full[key] = value.detach().cpu().clone()
    return full
