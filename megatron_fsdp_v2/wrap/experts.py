"""Mixture-of-experts: expert parameters sharded and reduced over their own process group.

[Note: expert parameters]
With expert parallelism (EP) every expert-parallel rank holds different experts under the same
parameter names, and the ranks holding the *same* experts form the expert-data-parallel group.
``fully_shard(..., expert_process_group=G, expert_params=pred)`` puts every parameter ``pred(name,
param)`` selects into groups of their own (per unit, next to the dense groups) that the strategy
shards and reduces over ``G``; everything else uses ``process_group``. So per step each kind of
group runs the strategy table's collectives over its own ranks, and ``comm_stats()["experts"]``
counts those over ``G`` apart.

* Gradient scale. An expert's gradient on one rank already sums the tokens every expert-parallel
  peer routed to it, so the sum over ``G`` divided by the *dense* data-parallel size is the mean
  over all ranks' tokens: every group divides by the same factor (Megatron DDP's
  ``expert_gradient_scaling_factor = 1 / dp_size`` in megatron-core 0.19.2's
  ``distributed_data_parallel.py``; torchtitan's expert ``gradient_divide_factor``).
* Start values. At wrap time dense parameters take rank 0 of ``process_group``'s values, expert
  parameters rank 0 of ``G``'s (Megatron DDP's ``broadcast_params``): expert-parallel peers keep
  their different experts.
* Gradient norm (``clip_grad_norm_``). ``G`` must lie inside ``process_group``, whose ranks then
  split into ``process_group.size / G.size`` expert-parallel peers holding different experts. The
  expert part is first made whole over ``G`` (sharded strategies), then summed over
  ``process_group`` and divided by ``G.size`` (each peer's value arrives once from each of its
  ``G.size`` ranks): every expert element counts once, as on one unsharded model.
* Not with experts: hybrid sharding, a model on the meta device (it would initialize every
  expert-parallel peer's experts alike), and the core's torch.distributed.checkpoint state dicts
  (expert names repeat across expert-parallel ranks with different values, so DCP would keep one
  rank's): Megatron's ``dist_checkpointing`` through the adapter stores them under global keys.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["check_expert_arguments", "check_expert_group_inside", "expert_names_refusal",
           "expert_param_ids"]


def check_expert_arguments(expert_process_group, expert_params, process_group_is_hybrid: bool) -> None:
    """Both or neither; a group and a callable; no hybrid sharding."""
    if (expert_process_group is None) != (expert_params is None):
        raise ValueError("expert_process_group and expert_params go together: pass both (the expert-data-parallel "
                         f"group and a callable (name, parameter) -> bool) or neither, got expert_process_group="
                         f"{type(expert_process_group).__name__} and expert_params={type(expert_params).__name__}.")
    if expert_process_group is None:
        return
    if not isinstance(expert_process_group, dist.ProcessGroup):
        raise TypeError(f"expert_process_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(expert_process_group).__name__}.")
    if not callable(expert_params):
        raise TypeError(f"expert_params must be a callable (name, parameter) -> bool, got {type(expert_params).__name__}.")
    if process_group_is_hybrid:
        raise ValueError("expert_process_group: expert parameters with hybrid sharding (an (outer, inner) "
                         "process_group) are not supported; pass one data-parallel group.")


def expert_param_ids(module: nn.Module, expert_params: Optional[Callable]) -> set:
    """ids of the parameters ``expert_params(name, param)`` selects (each parameter asked once,
    under its first name)."""
    if expert_params is None:
        return set()
    chosen = set()
    for name, param in module.named_parameters():
        if bool(expert_params(name, param)):
            chosen.add(id(param))
    return chosen


def check_expert_group_inside(expert_comm, dense_comm) -> None:
    """The expert group must be part of the dense group (see the note: the gradient norm)."""
    inner = set(dist.get_process_group_ranks(expert_comm.group))
    outer = set(dist.get_process_group_ranks(dense_comm.group))
    if not inner <= outer or dense_comm.size % expert_comm.size:
        raise ValueError(f"expert_process_group: its ranks {sorted(inner)} must be a subset of process_group's "
                         f"{sorted(outer)}, with a size dividing it (the expert-data-parallel group of the "
                         f"data-parallel group's ranks).")


def expert_names_refusal(what: str) -> ValueError:
    return ValueError(
        f"{what}: this model has expert parameters (expert_process_group), whose names repeat across "
        "expert-parallel ranks with different values; torch.distributed.checkpoint would keep one rank's. "
        "Save them through Megatron's dist_checkpointing (megatron_fsdp_v2.megatron.FullyShardedDataParallel."
        "sharded_state_dict), which stores experts under global keys.")
