"""How ``FullyShardedDataParallel`` composes with Megatron's tensor, context and pipeline
parallelism and its distributed-optimizer instances: which process group it shards over, and the
two places where Megatron's own gradient handling would miss what this wrapper holds
(docs/design.md, "Process groups").
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch.distributed as dist
import torch.nn as nn

from ..row_sharded import gather_rows


# ---------------------------------------------------------------- process groups
def data_parallel_group(pg_collection):
    """The group gradients are reduced and states sharded over: Megatron DDP's (data parallel
    with context parallel, ``intra_dp_cp_group`` with one optimizer instance): context-parallel
    ranks hold different tokens of the same samples, so their gradients add up like data
    parallel ones (Megatron DDP scales them by 1 / (dp * cp), as the core's mean over this
    group does). Tensor-parallel peers hold different slices and are never reduced together."""
    if pg_collection is not None:
        group = getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None)
        if group is None:
            raise ValueError("pg_collection: the data-parallel group (pg_collection.dp_cp, or pg_collection.dp "
                             "without context parallelism) is required.")
        return group
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("FullyShardedDataParallel: pass pg_collection or initialise Megatron's "
                           "parallel_state (initialize_model_parallel) first.")
    return ps.get_data_parallel_group(with_context_parallel=True)


def optimizer_instance_groups(pg_collection):
    """(the ranks of this distributed-optimizer instance, the group linking the instances):
    Megatron's ``intra_dp_cp`` and ``inter_dist_opt`` groups (hybrid sharding, comm/replicas.py)."""
    if pg_collection is not None:
        shard, replica = getattr(pg_collection, "intra_dp_cp", None), getattr(pg_collection, "inter_dist_opt", None)
        if shard is None or replica is None:
            raise ValueError("pg_collection: with num_distributed_optimizer_instances > 1 the groups "
                             "pg_collection.intra_dp_cp and pg_collection.inter_dist_opt are required.")
        return shard, replica
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
            ps.get_inter_distributed_optimizer_instance_group())


def expert_data_parallel_group(pg_collection):
    """The ranks holding the same experts (Megatron's expert-data-parallel group,
    ``pg_collection.expt_dp``): expert parameters (``allreduce=False``) are sharded and reduced over
    it, as Megatron DDP's ``expert_parallel_buffers`` are (wrap/experts.py in the core)."""
    if pg_collection is not None:
        group = getattr(pg_collection, "expt_dp", None)
        if group is None:
            raise ValueError("pg_collection: with expert parameters the expert-data-parallel group "
                             "(pg_collection.expt_dp) is required.")
        return group
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_group()


def is_expert_parameter(name: str, param: nn.Parameter) -> bool:
    """Megatron's marker of an expert-parallel parameter (``allreduce=False``, set by its MoE
    experts; the router and shared experts are dense)."""
    return not getattr(param, "allreduce", True)


def tensor_parallel_group(pg_collection):
    if pg_collection is not None:
        return getattr(pg_collection, "tp", None)
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def _embedding_group(pg_collection):
    if pg_collection is not None:
        return getattr(pg_collection, "embd", None)
    from megatron.core import parallel_state as ps

    return ps.get_embedding_group(check_initialized=False)


# ---------------------------------------------------------------- tensor parallelism
def check_tensor_parallel_peers_share_the_layout(sharded_parameters: Iterable, group) -> None:
    """Megatron's ``finalize_model_grads`` all-reduces the gradients of sequence-parallel
    layer norms (and q/k layer norms) over the tensor-parallel group *elementwise on what this
    wrapper holds*: this rank's rows of each. That is right only when tensor-parallel peers cut
    every parameter at the same rows, i.e. hold parameters of the same shapes in the same order
    (the layout is a function of the shapes). Megatron's tensor-parallel layers split evenly,
    so this holds; a model that splits unevenly is refused here rather than averaged wrongly."""
    if group is None or dist.get_world_size(group) == 1:
        return
    mine = [(entry.name, tuple(entry.shape)) for entry in sharded_parameters]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]           # every rank words the error alike: each peer against peer 0
    differing = [(i, [a for a, b in zip(theirs, first) if a != b][:3] or f"{len(theirs)} vs {len(first)} parameters")
                 for i, theirs in enumerate(everyone) if theirs != first]
    if differing:
        raise ValueError(f"module: tensor-parallel peers hold parameters of different shapes (peer: its first "
                         f"(name, shape) differing from peer 0's: {differing}); FullyShardedDataParallel needs "
                         "every tensor-parallel rank to hold the same parameter shapes in the same order.")


def expose_grads_to_finalize_model_grads(params: Iterable) -> None:
    """Megatron's ``finalize_model_grads`` all-reduces the gradients of sequence-parallel and q/k
    layer norms over the tensor-parallel group, reading them from ``named_parameters()`` as
    ``param.grad._local_tensor`` (megatron-core 0.19.2 takes that branch whenever
    ``ddp_config.use_megatron_fsdp``, expecting Megatron-FSDP's DTensors). Ours are plain tensors
    (this rank's rows), which are their own local tensor: each carries itself under that name, so
    the all-reduce writes into the gradient in place."""
    for param in params:
        grad = param.grad
        if grad is not None and getattr(grad, "_local_tensor", None) is not grad:
            grad._local_tensor = grad


# ---------------------------------------------------------------- pipeline parallelism
def tied_embedding_name(module: nn.Module, unwrapped: nn.Module) -> Optional[str]:
    """The name (in ``module``) of the word embedding this pipeline stage shares with another:
    the first stage's input embedding or the last stage's output layer of a model with
    ``share_embeddings_and_output_weights``; None when this chunk holds neither."""
    if not getattr(unwrapped, "share_embeddings_and_output_weights", False):
        return None
    if not (getattr(unwrapped, "pre_process", False) or getattr(unwrapped, "post_process", False)):
        return None
    weight = unwrapped.shared_embedding_or_output_weight()
    return next((name for name, p in module.named_parameters() if p is weight), None)


class TiedEmbeddingGradSum:
    """With pipeline parallelism the first stage's word embedding and the last stage's output
    layer are one weight held twice; their gradients must be summed over Megatron's embedding
    group after the data-parallel reduce, as Megatron DDP's ``finalize_model_grads`` does.
    Megatron's own all-reduce reads the module's weight's ``.grad``, which this wrapper never
    fills (gradients live in its buffers), and skips a None gradient without a word: left to
    it, the two copies would drift apart. The stages lay out different parameter sets, so their
    rows of this weight differ: each gathers the whole gradient over the data-parallel group,
    sums it over the embedding group and keeps its rows. Once per step: ``rearm()`` (a forward,
    ``zero_grad_buffer``) allows the next sum."""

    def __init__(self, entry, embedding_group, shard_group) -> None:
        self.entry, self.embedding_group, self.shard_group = entry, embedding_group, shard_group
        self.summed = False

    @classmethod
    def across_stages(cls, name: Optional[str], pg_collection, sharded_parameters: Iterable,
                      shard_group) -> Optional["TiedEmbeddingGradSum"]:
        """The sum for this rank's copy of the word embedding (``name``, from ``tied_embedding_name``)
        when it has a twin on another pipeline stage, else None."""
        if name is None:
            return None
        group = _embedding_group(pg_collection)
        if group is None or dist.get_world_size(group) == 1 or dist.get_rank() not in dist.get_process_group_ranks(group):
            return None
        return cls(next(e for e in sharded_parameters if e.name == name), group, shard_group)

    def rearm(self) -> None:
        self.summed = False

    def sum_once(self) -> None:
        if self.summed:
            return
        self.summed = True
        entry, grad = self.entry, self.entry.main_param.grad
        if grad is None:
            raise RuntimeError(f"{entry.name}: the tied word embedding has no gradient to sum over the pipeline "
                               "stages (FullyShardedDataParallel gives every parameter one).")
        if entry.row_splits is None:
            dist.all_reduce(grad, group=self.embedding_group)
            return
        full = gather_rows(grad, entry.row_splits, self.shard_group)
        dist.all_reduce(full, group=self.embedding_group)
        rank = dist.get_rank(self.shard_group)
        grad.copy_(full[entry.row_splits[rank]:entry.row_splits[rank + 1]])
