"""Megatron's optimizer on ``FullyShardedDataParallel`` chunks.

``get_optimizer(config, model_chunks, config_overrides=None, ...)`` has the signature of
``megatron.core.optimizer.get_megatron_optimizer`` and returns what it returns, built on the
wrapper's main weights (``wrapper.named_parameters()``: this rank's fp32 rows of each parameter,
``[rows_here, *shape[1:]]``, for the sharded strategies). It differs from calling
``get_megatron_optimizer`` directly in five places (1-3 and 5 because the optimizer-facing
parameters are pieces):

1. **Weight decay by original shape.** Megatron's standard overrides skip weight decay for
   ``len(param.shape) == 1`` or names ending in ``.bias``: a piece keeps its dimensions, but a
   predicate on the shape or size would see the piece's. ``with_original_shapes(config_overrides)`` re-evaluates every ``ParamKey``
   (name, attribute and predicate matches) against a meta-device stand-in with the parameter's
   original shape and attributes. ``config_overrides=None`` means Megatron's standard overrides.
2. **The optimizer class.** ``adam``: ``use_distributed_optimizer=True``, i.e. Megatron's
   ``DistributedOptimizer`` on its ``use_megatron_fsdp`` path (the wrapper's ``ddp_config`` has
   ``use_megatron_fsdp=True``): no buffers of its own; ``zero_grad`` -> ``zero_grad_buffer()``,
   after the inner step ``param_and_grad_buffer.copy_main_weights_to_model_weights()`` and
   ``start_param_sync()`` rebuild the compute weights; fp16 loss scaling works.
   ``sgd``: ``DistributedOptimizer`` accepts only Adam-like inner optimizers, so SGD gets
   ``FP32Optimizer`` (our main weights are fp32 already); the engine's optimizer-step hook then
   rebuilds the compute weights. ``muon``: Megatron's emerging-optimizer path as for its own DDP
   (FP32Optimizer leaves: its Muon for the matrices, Adam for the rest), the Muon leaf stepping row
   pieces with each matrix orthogonalized whole on one rank (muon.py, [Note: Megatron's Muon on
   row pieces]).
3. **The grad-norm group.** Gradient norms (clipping, logging) are summed over
   ``grad_stats_parallel_group``. Sharded strategies: each rank holds a disjoint shard, so the sum
   runs over the data-parallel group; ``no_shard``: grads are replicated, so it runs over the
   model-parallel group only (summing replicas would make the norm sqrt(dp) too large); with
   experts, over the whole instance, each replicated gradient counted on one rank of its group.

4. **Settings.** Every ``OptimizerConfig`` field is honoured, refused or warned about once as
   ``settings.py``'s table says; a finite ``grad_norm_skip_threshold`` returns a
   ``ChainedOptimizer`` (Megatron skips large-norm steps there only; its FSDP path's bare optimizer
   would step).

5. **Checkpoints.** Each leaf optimizer gets ``ShardedOptimizerCheckpoint`` (checkpoint/dist_checkpoint.py):
   ``sharded_state_dict`` / ``load_state_dict`` for Megatron's ``dist_checkpointing``
   (``--ckpt-format torch_dist``), resharding across dp sizes and strategies; Megatron's own
   version only knows Megatron-FSDP's DTensors on this path.

6. **CPU offload.** ``optimizer_cpu_offload`` (``--optimizer-cpu-offload``) with
   ``optimizer_offload_fraction`` and ``overlap_cpu_optimizer_d2h_h2d``: ``adapter.offload_policy``
   maps them to an ``OffloadPolicy``, the chunks offload that fraction of their groups
   (``set_offload``; offload/host_link.py, [Note: offload by fraction]) and each leaf's inner Adam becomes
   torch's fused Adam/AdamW, which steps host and device tensors alike, instead of Megatron's
   ``HybridDeviceOptimizer``.

7. **CUDA graphs.** With chunks in CUDA graph mode (``--cuda-graph-impl full_iteration``, adapter.py
   [Note: Megatron's full-iteration CUDA graph]) CPU offload is refused and the ``FP32Optimizer``
   leaves zero ``.grad`` in place (``_zero_grads_in_place``).

Calling ``get_megatron_optimizer`` directly also works for ``adam`` with
``use_distributed_optimizer=True`` (what ``--use-megatron-fsdp`` forces): Megatron then picks the
same groups as item 3; item 1 needs ``config_overrides=with_original_shapes(...)`` and item 5
``install_optimizer_checkpointing(optimizer, model_chunks)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron.core.optimizer import (
    OptimizerConfig,
    ParamKey,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer
from megatron.core.optimizer.optimizer_config import ParamWithNamePredicate

from .adapter import ORIGINAL_SHAPE_ATTR, FullyShardedDataParallel
from .wrap_settings import offload_policy
from .checkpoint.dist_checkpoint import install_optimizer_checkpointing
from .model_parallel import is_expert_parameter
from .muon import distribute_orthogonalized, require_emerging_optimizers
from .settings import check_optimizer_config


def _stand_in(param: torch.Tensor) -> torch.Tensor:
    """A meta tensor shaped like ``param``'s original parameter, carrying its attributes."""
    shape = getattr(param, ORIGINAL_SHAPE_ATTR, None)
    if shape is None or tuple(shape) == tuple(param.shape):
        return param
    proxy = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"),
                         requires_grad=param.requires_grad)
    proxy.__dict__.update(vars(param))
    return proxy


def _matches_original(key: ParamKey, param: torch.Tensor, name: str) -> bool:
    return key.matches(_stand_in(param), name)


def with_original_shapes(config_overrides: Dict[ParamKey, dict]) -> Dict[ParamKey, dict]:
    """``config_overrides`` whose keys match parameters by their original (unsharded) shape.

    Each ``ParamKey`` becomes a ``ParamKey(with_name_predicate=...)`` that evaluates the original
    key on a stand-in with the original shape (parameters without ``ORIGINAL_SHAPE_ATTR`` are
    matched as they are). The override values are unchanged.
    """
    out: Dict[ParamKey, dict] = {}
    for index, (key, override) in enumerate(config_overrides.items()):
        predicate = ParamWithNamePredicate(name=f"megatron_fsdp_v2.original_shape[{index}]",
                                           fn=functools.partial(_matches_original, key))
        out[ParamKey(with_name_predicate=predicate)] = override
    return out


def _distributed_optimizer_instance_group(pg_collection):
    """All ranks of one distributed-optimizer instance (tensor x pipeline x context x data
    parallel; the whole world with one instance, the only count the wrapper accepts)."""
    if pg_collection is not None and getattr(pg_collection, "intra_dist_opt", None) is not None:
        return pg_collection.intra_dist_opt
    from megatron.core import parallel_state as ps

    return ps.get_intra_distributed_optimizer_instance_group()


def _count_replicated_grads_once(leaf, chunk) -> None:
    """``no_shard`` with experts: grads are replicated over the data-parallel group (dense) or the
    expert-data-parallel group (experts), and expert-parallel peers hold different experts, so no
    one group sums the norm right. The norm is summed over the whole instance instead, each
    replicated gradient counted on one rank of its group (data-parallel rank 0, expert-data-
    parallel rank 0); Megatron's own filter still drops tensor-parallel duplicates."""
    dense_rank = dist.get_rank(chunk.dp_cp_group)
    expert_rank = dist.get_rank(chunk.expt_dp_group)
    original = leaf._filter_grads_for_norm

    def filter_grads_for_norm(params, param_filter=None):
        mine = [p for p in params if (expert_rank if is_expert_parameter("", p) else dense_rank) == 0]
        return original(mine, param_filter=param_filter)

    leaf._filter_grads_for_norm = filter_grads_for_norm


def _leaf_optimizers(optimizer) -> List:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _step_on_each_device(optimizer, config: OptimizerConfig) -> None:
    """With offload some main parameters are host tensors: each leaf's inner Adam becomes torch's
    fused Adam/AdamW over the same param groups (the same dicts, so Megatron's scheduler and
    checkpoints see them), which runs the fused kernel on each device, CPU included. Megatron's
    own choice (Transformer Engine's or Apex's FusedAdam) steps device tensors only. Built
    before any step: there is no state to carry over."""
    adam = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
    for leaf in _leaf_optimizers(optimizer):
        inner = leaf.optimizer
        if inner is None or not inner.param_groups:
            continue
        if any(inner.state.values()):
            raise RuntimeError("get_optimizer: the inner optimizer already holds state; offload replaces it before "
                               "the first step only.")
        leaf.optimizer = adam(inner.param_groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                              eps=config.adam_eps, weight_decay=config.weight_decay, fused=True)


def _zero_grads_in_place(optimizer) -> None:
    """CUDA graph mode: the ``FP32Optimizer`` leaves (SGD, Muon) zero ``.grad`` in place when asked to
    set it to None (Megatron-LM's ``optimizer.zero_grad()``). A replayed forward-backward writes the
    gradient tensors its capture attached, and no Python of ours runs to attach them again, so a
    ``.grad`` set to None would stay None and the step would skip every parameter. The
    ``DistributedOptimizer`` (Adam) zeroes our buffers in place already (``zero_grad_buffer``)."""
    for leaf in _leaf_optimizers(optimizer):
        if isinstance(leaf, FP32Optimizer):
            zero_grad = leaf.zero_grad
            leaf.zero_grad = functools.partial(_zero_in_place, zero_grad)


def _zero_in_place(zero_grad, set_to_none: bool = True) -> None:
    zero_grad(set_to_none=False)


def get_optimizer(
    config: OptimizerConfig,
    model_chunks,
    config_overrides: Optional[Dict[ParamKey, dict]] = None,
    use_gloo_process_groups: bool = True,
    pg_collection=None,
    dump_param_to_param_group_map: Optional[str] = None,
):
    """``get_megatron_optimizer`` for ``FullyShardedDataParallel`` chunks (see the module docstring).

    Chunks that are not ours go to ``get_megatron_optimizer`` unchanged.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    ours = [isinstance(chunk, FullyShardedDataParallel) for chunk in chunks]
    if not any(ours):
        return get_megatron_optimizer(config, chunks, config_overrides=config_overrides,
                                      use_gloo_process_groups=use_gloo_process_groups,
                                      pg_collection=pg_collection,
                                      dump_param_to_param_group_map=dump_param_to_param_group_map)
    if not all(ours):
        raise ValueError("model_chunks: mix of FullyShardedDataParallel and other wrappers; wrap every chunk "
                         "with the same class.")
    strategies = {chunk.strategy.name for chunk in chunks}
    if len(strategies) != 1:
        raise ValueError(f"model_chunks: all chunks must use one sharding strategy, got {sorted(strategies)}.")
    # every field of config: honoured, refused (raised here) or warned once (settings.py)
    graphed = any(chunk.cuda_graph_mode for chunk in chunks)
    check_optimizer_config({f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, *strategies,
                           main_dtype=chunks[0].mixed_precision.main_params_dtype, cuda_graph=graphed)

    offload = offload_policy(config)       # --optimizer-cpu-offload: our offload, not HybridDeviceOptimizer
    if offload is not None:
        for chunk in chunks:
            chunk.module.set_offload(offload)
        config = dataclasses.replace(config, optimizer_cpu_offload=False, use_precision_aware_optimizer=False)
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    config_overrides = with_original_shapes(config_overrides)
    if config.optimizer == "adam":
        config = dataclasses.replace(config, use_distributed_optimizer=True)
    else:
        config = dataclasses.replace(config, use_distributed_optimizer=False, bf16=False, fp16=False)
    if config.optimizer == "muon":       # our rows replace Megatron's layer-wise sharding (settings.py)
        require_emerging_optimizers()
        config = dataclasses.replace(config, use_layer_wise_distributed_optimizer=False)

    optimizer = get_megatron_optimizer(config, chunks, config_overrides=config_overrides,
                                       use_gloo_process_groups=use_gloo_process_groups,
                                       pg_collection=pg_collection,
                                       dump_param_to_param_group_map=dump_param_to_param_group_map)
    if offload is not None and config.optimizer == "adam":
        _step_on_each_device(optimizer, config)
    if config.optimizer == "muon":
        distribute_orthogonalized(optimizer, chunks, _leaf_optimizers(optimizer))
    if chunks[0].strategy.optim_sharded:
        # Disjoint shards: the squared norms add up over the data-parallel (with context-parallel)
        # group and the model-parallel group, i.e. over Megatron's distributed-optimizer instance
        # (what it picks for Adam; the SGD path's FP32Optimizer would sum over model-parallel only).
        group = _distributed_optimizer_instance_group(pg_collection)
        if any(chunk.outer_sharding_strategy == "optim" for chunk in chunks):
            group = dist.group.WORLD     # HFSDP: the shards are disjoint across the instances too
        for leaf in _leaf_optimizers(optimizer):
            leaf.grad_stats_parallel_group = group
    elif any(chunk.expt_dp_group is not None for chunk in chunks):
        group = _distributed_optimizer_instance_group(pg_collection)
        for leaf in _leaf_optimizers(optimizer):
            leaf.grad_stats_parallel_group = group
            _count_replicated_grads_once(leaf, chunks[0])
    install_optimizer_checkpointing(optimizer, chunks)
    if graphed:
        _zero_grads_in_place(optimizer)
    if math.isfinite(config.grad_norm_skip_threshold) and not isinstance(optimizer, ChainedOptimizer):
        # Megatron skips a step whose grad norm exceeds the threshold in ChainedOptimizer.step only
        # (its DDP path always returns one; its FSDP path returns the bare optimizer, which steps).
        optimizer = ChainedOptimizer([optimizer])
    return optimizer
