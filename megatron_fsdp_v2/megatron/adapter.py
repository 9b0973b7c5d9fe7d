"""``FullyShardedDataParallel``: megatron_fsdp_v2 behind Megatron-Core's data-parallel wrapper API.

Drop-in for ``megatron.core.distributed.DistributedDataParallel`` (0.19.2)::

    model = FullyShardedDataParallel(config, ddp_config, gpt_model)   # strategy from ddp_config
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_optimizer(OptimizerConfig(...), [model])          # see optimizer.py

How Megatron's settings map onto ``fully_shard``:

=================================================  ===============================================
Megatron                                           megatron_fsdp_v2
=================================================  ===============================================
``ddp_config.data_parallel_sharding_strategy``     ``sharding_strategy`` (``no_shard``, ``optim``,
                                                   ``optim_grads``, ``optim_grads_params``)
``pg_collection.dp_cp`` (or parallel_state's DP   ``process_group`` (tensor-parallel peers and
with context parallel)                             pipeline stages are never reduced together)
``fsdp_unit_modules`` (default: every              ``unit_modules``: all-gather / reshard and
``TransformerLayer``; with ``disable_bucketing``   gradient-reduce granularity (what Megatron calls
and no ZeRO-3: one root unit)                      buckets for the other strategies)
``config.bf16`` / ``config.fp16``                  ``param_dtype`` (compute weights); main weights
                                                   ``ddp_config.megatron_fsdp_main_params_dtype``
                                                   (fp32; ``None``: the compute dtype), grads alike
``grad_reduce_in_fp32`` (else the param dtype),    ``grad_comm_dtype``
``megatron_fsdp_grad_comm_dtype`` overrides
``overlap_grad_reduce=False``                      grads of ``no_shard``/``optim`` accumulate
                                                   locally and are reduced in ``finish_grad_sync``
                                                   (Megatron installs ``no_sync`` only with overlap)
``check_for_nan_in_grad``                          ``check_for_nan_in_grad``
experts (``allreduce=False``; ``--num-experts``,   ``expert_process_group``: Megatron's expert-data-
``--expert-model-parallel-size``)                  parallel group (``expt_dp``); divided like dense
                                                   grads (1 / dp size), as Megatron DDP does
``num_distributed_optimizer_instances`` > 1        hybrid sharding: ``process_group=(inter_dist_opt,
                                                   intra_dp_cp)``; ``outer_dp_sharding_strategy``
                                                   ``optim``: ``outer_sharding_strategy="optim"`` (HFSDP)
``calculate_per_token_loss``                       grads are DP means; ``scale_gradients`` (called
                                                   by ``finalize_model_grads`` with 1/tokens)
                                                   multiplies by the DP size to give Megatron's sums
``config.cuda_graph_impl="full_iteration"`` (or    the engine runs ``capture_safe`` (below, [Note:
``megatron_fsdp_cuda_graph_mode``)                 Megatron's full-iteration CUDA graph])
=================================================  ===============================================

Every field of ``DistributedDataParallelConfig`` is honoured, refused or warned about (once) as
``settings.py``'s table says (docs/megatron_settings.md).

The class derives from Megatron's ``DistributedDataParallel`` (so ``training.py``'s
``isinstance(model[0], (megatron_FSDP, DDP))`` gates, ``unwrap_model`` and the optimizer see a
DDP wrapper) but never runs its buffer-building ``__init__``: it initialises
``_BaseDataParallel`` and keeps Megatron's DDP bookkeeping lists (``buffers``, ``bucket_groups``,
...) empty. Every member the training loop, ``finalize_model_grads``, the schedules and the
optimizer call is overridden here.

[Note: Megatron's full-iteration CUDA graph]
With ``--cuda-graph-impl full_iteration`` Megatron-LM's ``FullCudaGraphWrapper`` runs
``forward_backward_func`` eagerly for ``cuda_graph_warmup_steps`` iterations, then captures it (the
k micro-batches' forward and backward and ``finalize_model_grads``, i.e. ``finish_grad_sync``) and
replays it; ``zero_grad_buffer()``, ``optimizer.zero_grad()`` and ``optimizer.step()`` stay eager.
So nothing eager may leave a collective in flight that the captured forward waits on (the capture
fails), and the tensors the graph writes must keep their addresses:
* the engine runs ``capture_safe`` (graphs/requirements.py, [Note: what a captured step needs]):
  ZeRO-1/2's weight all-gather after the step, and ``start_param_sync`` /
  ``copy_main_weights_to_model_weights`` here, land before ``optimizer.step()`` returns; ZeRO-3
  gathers its weights inside the captured forward, from the main shards the step updated in place;
* gradients persist (``persistent_grads=True``): ``zero_grad_buffer()`` zeroes them in place, and
  with the graph ``get_optimizer``'s ``FP32Optimizer`` leaves (SGD, Muon) zero ``.grad`` in place
  instead of setting it to None (the replay writes the tensors the capture attached, with no Python
  to attach new ones);
* what reads the host during the step is refused: ``check_for_nan_in_grad``, CPU offload
  (settings.py), ``MEGATRON_FSDP_V2_CHECK_COLLECTIVES=1``; so are Megatron's per-layer graphs
  (``local``, ``transformer_engine``: wrap_settings.py) and ``--optimizer-cuda-graph``.
Under replay no Python of ours runs: ``comm_stats()`` counts the eager warm-up iterations and the
capture, not the replays, and the rank-divergence ledger sees no new collectives.

``named_parameters()`` yields the *optimizer-facing* main weights (this rank's fp32 shard: its rows
``[rows_here, *shape[1:]]`` as plain tensors for the sharded strategies), named ``module.<original name>`` like Megatron's DDP, with
the original parameter's Megatron attributes (``allreduce``, ``tensor_model_parallel``,
``is_embedding_or_output_parameter``, ...) copied onto them and the original shape in
``ORIGINAL_SHAPE_ATTR``. ``self.ddp_config`` is a copy of the given config with
``use_megatron_fsdp=True`` so Megatron's optimizer takes its FSDP short-cuts (see optimizer.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import OrderedDict
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.transformer_config import TransformerConfig

from ..checkpoint.state_dict import model_state_dict
from ..fully_shard import fully_shard
from ..graphs import make_capture_safe
from .meta_init import megatron_init_fn
from .model_parallel import (TiedEmbeddingGradSum, check_tensor_parallel_peers_share_the_layout, data_parallel_group,
                             expert_data_parallel_group, expose_grads_to_finalize_model_grads, is_expert_parameter,
                             optimizer_instance_groups, tensor_parallel_group, tied_embedding_name)
from .checkpoint.distopt_format import bucket_offsets, buffer_dtype_name, megatron_bucket_size
from .checkpoint.dist_checkpoint import (install_model_checkpointing, megatron_layout, model_sharded_state_dict,
                              model_values_from_loaded)
from .settings import cuda_graph_mode
from .wrap_settings import (_checked_strategy, _mixed_precision, _parallel_sizes, _unsupported_settings,  # noqa: F401
                            megatron_adam_kernel, offload_policy)
from ..plan.resolve import AutoStrategy

logger = logging.getLogger(__name__)

#: Attribute set on every optimizer-facing main parameter: the ``torch.Size`` of the original
#: parameter (the main parameter itself holds this rank's rows for the sharded strategies).
ORIGINAL_SHAPE_ATTR = "megatron_fsdp_v2_original_shape"

# Attributes of model parameters that are per-tensor state, not metadata: never copied.
_NOT_COPIED = {"main_grad", "grad_added_to_main_grad", "main_param", "main_param_sharded"}


def _default_unit_classes() -> List[type]:
    """Megatron-FSDP's default ZeRO-3 units: transformer layers (MoE layers are subclasses)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    classes: List[type] = [TransformerLayer]
    try:  # needs mamba_ssm at import time on some installs
        from megatron.core.ssm.mamba_layer import MambaLayer

        classes.append(MambaLayer)
    except Exception:  # noqa: BLE001 - optional
        pass
    return classes


class WeightRefreshForMegatronOptimizer:
    """What Megatron's optimizer reaches through ``model_chunk.param_and_grad_buffer`` on its
    Megatron-FSDP path. It holds no buffer (ours live in the core): its only method, called after
    the inner optimizer step, asks for the compute weights to be rebuilt."""

    def __init__(self, wrapper: "FullyShardedDataParallel") -> None:
        self._wrapper = wrapper

    def copy_main_weights_to_model_weights(self) -> None:
        """Start rebuilding the compute weights from the updated main weights (idempotent: the
        core tracks which main weights changed; ZeRO-3 all-gathers them at the next use). In CUDA
        graph mode the rebuild lands before it returns ([Note: Megatron's full-iteration CUDA graph])."""
        self._wrapper.module.unshard(async_op=not self._wrapper.cuda_graph_mode)


class FullyShardedDataParallel(DistributedDataParallel):
    """Megatron-Core data-parallel wrapper running on megatron_fsdp_v2 (see the module docstring).

    Args:
        config: the model's ``TransformerConfig`` (dtypes; unsupported features are rejected).
        ddp_config: ``DistributedDataParallelConfig``; ``data_parallel_sharding_strategy`` picks the
            strategy.
        module: the bare model (or ``Float16Module``), already on its device. Sharded in place.
        disable_bucketing: with ``True`` and a strategy other than ZeRO-3, one root unit (one
            gradient reduce per step, like Megatron's single bucket).
        pg_collection: process groups; ``pg_collection.dp_cp`` (``dp`` without context
            parallelism) is the group states are sharded over, ``tp`` and ``embd`` are read too
            (docs/design.md, "Process groups"). ``None``: Megatron's ``parallel_state``.
        fsdp_unit_modules: module classes whose instances are units (default ``TransformerLayer``).
        full_param_layout: accepted for signature compatibility; must be ``None``.
        device: optional check that every parameter already lives there (nothing is moved).
        auto_strategy: with ``data_parallel_sharding_strategy="auto"`` (``--data-parallel-sharding-strategy
            auto`` through examples/pretrain_gpt.py): the budget, optimizer and micro-batches
            ``fully_shard(sharding_strategy="auto")`` plans for (default ``AutoStrategy()`` with the
            kernel of the Adam Megatron builds: ``megatron_adam_kernel()``).
    """

    cuda_graph_mode: bool      # Megatron's full-iteration CUDA graph: the engine runs capture_safe

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        disable_bucketing: bool = False,
        pg_collection=None,
        fsdp_unit_modules: Optional[Sequence[type]] = None,
        full_param_layout=None,
        device: Optional[torch.device] = None,
        auto_strategy: Optional[AutoStrategy] = None,
    ):
        strategy, auto = _checked_strategy(config, ddp_config, module, pg_collection, full_param_layout, device,
                                           auto_strategy)
        dp_group = data_parallel_group(pg_collection)
        # --num-distributed-optimizer-instances N: hybrid sharding, each instance shards within
        # its ranks (Megatron's intra group) and the instances average gradients (comm/replicas.py)
        shard_group, replica_group = dp_group, None
        if ddp_config.num_distributed_optimizer_instances > 1:
            shard_group, replica_group = optimizer_instance_groups(pg_collection)
        policy = _mixed_precision(config, ddp_config)
        units = self._unit_classes(module, fsdp_unit_modules, disable_bucketing, strategy.weights_sharded)

        # Where Megatron's own sharded_state_dict puts each parameter (read while they are whole),
        # so our checkpoints use its keys (stacked layers) and load into Megatron's DDP and back.
        from megatron.core.transformer.module import Float16Module

        unwrapped = module.module if isinstance(module, Float16Module) else module
        self._megatron_layout = megatron_layout(unwrapped)
        # A model built under torch.device("meta") (--init-model-with-meta-device): Megatron's own
        # layer initialization, one layer at a time, keeping only shards (meta_init.py).
        meta = any(p.is_meta for p in module.parameters())
        tied_name = tied_embedding_name(module, unwrapped)
        has_experts = any(is_expert_parameter(n, p) for n, p in module.named_parameters())
        expert_group = expert_data_parallel_group(pg_collection) if has_experts else None
        if auto and auto_strategy is None:
            auto_strategy = AutoStrategy(optimizer_kernel=megatron_adam_kernel())
        fully_shard(module, sharding_strategy="auto" if auto else strategy, unit_modules=units,
                    auto_strategy=auto_strategy if auto else None,
                    expert_process_group=expert_group, expert_params=is_expert_parameter if has_experts else None,
                    process_group=shard_group if replica_group is None else (replica_group, shard_group),
                    outer_sharding_strategy=getattr(ddp_config, "outer_dp_sharding_strategy", "no_shard"),
                    init_fn=megatron_init_fn(config) if meta else None,
                    mixed_precision=policy, check_for_nan_in_grad=bool(ddp_config.check_for_nan_in_grad),
                    # Megatron DDP: buffers are not broadcast, and every main_grad exists (zeros if unused)
                    # and persists between steps;
                    # Megatron's optimizer takes plain tensors (this rank's rows), not DTensors
                    broadcast_buffers=False, unused_param_grads="zeros", dtensor_params=False,
                    persistent_grads=True)
        _BaseDataParallel.__init__(self, config=config, module=module)
        self.cuda_graph_mode = cuda_graph_mode(config, ddp_config)
        if self.cuda_graph_mode:         # [Note: Megatron's full-iteration CUDA graph]
            make_capture_safe([module], [], where="FullyShardedDataParallel (--cuda-graph-impl full_iteration)")

        strategy = module.sharding_strategy      # auto: the one fully_shard chose
        self.ddp_config = dataclasses.replace(ddp_config, use_megatron_fsdp=True,
                                              data_parallel_sharding_strategy=strategy.name)
        self.strategy = strategy
        self.mixed_precision = policy
        self.unit_modules = units
        self.dp_group = shard_group              # what the states are sharded over (rows of each parameter)
        self.dp_cp_group = dp_group              # every data-parallel rank (with context parallel)
        self.intra_dp_cp_group = shard_group
        self.replica_group = replica_group       # across distributed-optimizer instances, or None
        self.outer_sharding_strategy = getattr(ddp_config, "outer_dp_sharding_strategy", "no_shard")
        self.expt_dp_group = expert_group         # expert parameters' group (None without experts)
        self.tp_group = tensor_parallel_group(pg_collection)
        check_tensor_parallel_peers_share_the_layout(module.sharded_parameters(), self.tp_group)
        self._tied_embedding = TiedEmbeddingGradSum.across_stages(tied_name, pg_collection,
                                                                  module.sharded_parameters(), shard_group)
        self.pg_collection = pg_collection
        self._empty_megatron_ddp_bookkeeping()
        self.param_and_grad_buffer = WeightRefreshForMegatronOptimizer(self)
        # Without overlap_grad_reduce Megatron installs no no_sync_func: accumulate locally and
        # reduce once in finish_grad_sync (ZeRO-2/3 still reduce-scatter every micro-batch).
        module.set_requires_gradient_sync(bool(ddp_config.overlap_grad_reduce))
        # With per-token loss Megatron DDP sums gradients over data-parallel ranks and
        # finalize_model_grads then scales by 1 / tokens (scale_gradients below).
        if getattr(config, "calculate_per_token_loss", False):
            module.set_gradient_divide_factor(1.0)
        # Strip "module." (Float16Module) from checkpoint keys, as Float16Module.state_dict does.
        self._ckpt_prefix = "module." if unwrapped is not module else ""
        # Megatron-LM's save_checkpoint asks unwrap_model(self) (below Float16Module) for its
        # sharded_state_dict: route that to ours.
        install_model_checkpointing(unwrapped, self)
        self._annotate_main_params()
        logger.info("megatron_fsdp_v2 FullyShardedDataParallel: strategy=%s dp=%d units=%d policy=%s",
                    strategy.name, dist.get_world_size(shard_group), len(units or ()) + 1, policy)

    # ------------------------------------------------------------------ construction helpers
    def _empty_megatron_ddp_bookkeeping(self) -> None:
        """Megatron DDP's bucket bookkeeping, which training.py and the optimizer may iterate:
        always empty here (communication is per unit, not per bucket)."""
        self.bucket_size = None
        self.buffers = []
        self.expert_parallel_buffers = []
        self.bucket_groups = []
        self.expert_parallel_bucket_groups = []
        self.param_to_bucket_group = {}
        self.params_with_grad = []
        self.remove_forward_pre_hook_handles = {}
        self.force_all_reduce = False
        self.overlap_param_gather_with_optimizer_step = False

    def checkpoint_replica_ranks(self) -> tuple:
        """(data-parallel rank, instance rank): the data-parallel element of the replica ids of
        a replicated value and of a shard (the instances hold the same shards)."""
        # HFSDP: every rank holds its own shards (no copies across instances)
        copies = self.replica_group is not None and self.outer_sharding_strategy == "no_shard"
        return dist.get_rank(self.dp_cp_group), dist.get_rank(self.replica_group) if copies else 0

    def expert_checkpoint_replicas(self) -> tuple:
        """(core names of the expert parameters, this rank's expert-data-parallel rank): experts are
        replicated over that group, not the data-parallel one (Megatron's expert replica ids)."""
        if self.expt_dp_group is None:
            return frozenset(), 0
        names = frozenset(e.name for e in self.module.sharded_parameters()
                          if is_expert_parameter(e.name, e.module_param))
        return names, dist.get_rank(self.expt_dp_group)

    @staticmethod
    def _unit_classes(module, fsdp_unit_modules, disable_bucketing, weights_sharded):
        if fsdp_unit_modules is not None:
            return list(fsdp_unit_modules) or None
        if disable_bucketing and not weights_sharded:
            return None
        present = [cls for cls in _default_unit_classes() if any(isinstance(m, cls) for m in module.modules())]
        return present or None

    def _annotate_main_params(self) -> None:
        """Give each main parameter the original parameter's Megatron attributes and shape."""
        for entry in self.module.sharded_parameters():
            for key, value in vars(entry.module_param).items():
                if not key.startswith("_") and key not in _NOT_COPIED:
                    setattr(entry.main_param, key, value)
            setattr(entry.main_param, ORIGINAL_SHAPE_ATTR, entry.shape)

    def forward(self, *inputs, **kwargs):
        """The wrapped module's forward. A forward starts new gradients, so the next
        ``finish_grad_sync`` sums the tied word embedding again (also in loops that never call
        ``zero_grad_buffer``)."""
        self._rearm_tied_embedding_sum()
        return self.module(*inputs, **kwargs)

    def _rearm_tied_embedding_sum(self) -> None:
        if self._tied_embedding is not None:
            self._tied_embedding.rearm()

    # ------------------------------------------------------------------ parameters
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's main weights (what an optimizer steps), as ``module.<original name>``; as
        torch's, ``recurse=False`` lists none (the wrapper holds no parameter of its own) and
        ``remove_duplicate=False`` lists a shared weight under each of its names."""
        if not recurse:
            return
        inner = f"{prefix}.module" if prefix else "module"
        yield from self.module.named_parameters(prefix=inner, remove_duplicate=remove_duplicate)

    def parameters(self, recurse: bool = True):
        for _, param in self.named_parameters(recurse=recurse):
            yield param

    def summon_full_params(self, **kwargs):
        """The wrapped module's ``summon_full_params`` (full weights inside the context)."""
        return self.module.summon_full_params(**kwargs)

    # ------------------------------------------------------------------ gradient sync
    @contextlib.contextmanager
    def no_sync(self):
        """Defer the gradient reduce of ``no_shard`` / ``optim`` to the last micro-batch."""
        with self.module.no_sync():
            yield

    def start_grad_sync(self, *unused) -> None:
        self.module.reduce_gradients(async_op=True)

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """Reduce what is still local, wait for every reduce, expose the reduced grads as the main
        params' ``.grad``. ``force_all_reduce`` (Megatron: keep full grads for dumping them) is
        ignored: the sharded strategies only ever hold their shard of the gradients."""
        self.module.wait_gradient_reduction()
        if self._tied_embedding is not None:
            self._tied_embedding.sum_once()
        expose_grads_to_finalize_model_grads(self.parameters())

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply the reduced gradients (Megatron calls it after ``finish_grad_sync``; with
        ``calculate_per_token_loss`` the core sums over ranks, as Megatron DDP does, and this
        multiplies by 1 / tokens in the global batch)."""
        self.module.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero the gradients and keep every ``main_grad``/``.grad`` tensor (Megatron DDP's contract)."""
        self.module.zero_grad(set_to_none=False)
        self._rearm_tied_embedding_sum()

    # ------------------------------------------------------------------ weight sync
    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Rebuild the compute weights from changed main weights (async unless ``force_sync`` or in
        CUDA graph mode, where nothing may stay in flight past the step)."""
        self.module.unshard(async_op=not (force_sync or self.cuda_graph_mode))

    def synchronize_param_gather(self) -> None:
        self.module.unshard(async_op=False)

    def synchronize_gradient_reduce(self) -> None:
        self.module.wait_gradient_reduction()

    def stop_communication(self) -> None:
        """Wait for every outstanding reduce and all-gather."""
        self.synchronize_gradient_reduce()
        self.synchronize_param_gather()

    def enable_forward_pre_hook(self) -> None:
        """No-op: weights are refreshed by the core's own hooks."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        if param_sync:
            self.start_param_sync(force_sync=True)

    def reset_param_sync_dispatch_state(self) -> None:
        """No-op (Megatron DDP bucket bookkeeping)."""

    def free_overlap_buffers(self) -> None:
        """No-op: temporaries are owned by the core's allocator."""

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        raise NotImplementedError("FullyShardedDataParallel does not support offloading gradient buffers.")

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        raise NotImplementedError("FullyShardedDataParallel does not support offloading gradient buffers.")

    def broadcast_params(self) -> None:
        """Make every data-parallel rank hold data-parallel rank 0's model (parameters of the
        replicated strategy, buffers always: the sharded ones hold one logical copy)."""
        self.module.broadcast_parameters(src_rank=0)

    # ------------------------------------------------------------------ accounting
    def comm_stats(self) -> dict:
        """Calls and bytes of each collective since the last ``reset_comm_stats()``, by dtype too:
        the wrapped model's ``comm_stats()``."""
        return self.module.comm_stats()

    def reset_comm_stats(self) -> None:
        self.module.reset_comm_stats()

    def persistent_bytes(self) -> dict:
        """Bytes this rank keeps between steps (weights, main weights, grads; no optimizer state)."""
        return self.module.persistent_bytes()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        """Full (unsharded, main-precision) parameters and buffers, identical on every rank."""
        out = destination if destination is not None else OrderedDict()
        for key, value in self.module.full_state_dict().items():
            if self._ckpt_prefix and key.startswith(self._ckpt_prefix):
                key = key[len(self._ckpt_prefix):]
            out[prefix + key] = value
        return out

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """Full tensors, like Megatron DDP's (Megatron-LM's ``torch`` format saves them from one
        rank). For sharded saves use ``sharded_state_dict`` (``--ckpt-format torch_dist``)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def _checkpoint_values(self) -> "OrderedDict[str, torch.Tensor]":
        """The core's DCP state dict (this rank's shards) under ``state_dict()``'s keys."""
        cut = len(self._ckpt_prefix)
        return OrderedDict((key[cut:] if key.startswith(self._ckpt_prefix) else key, value)
                           for key, value in model_state_dict(self.module).items())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's distributed-checkpoint dict (``dist_checkpointing.save`` / ``load``): every
        parameter and buffer under its ``state_dict()`` key as ShardedTensors of this rank's shard
        (checkpoint/dist_checkpoint.py, [Note: our shards as Megatron ShardedTensors]). The unwrapped module
        Megatron-LM's ``save_checkpoint`` asks gives the same. ``metadata`` is accepted and unused."""
        dp_rank, instance = self.checkpoint_replica_ranks()
        expert_names, expert_dp_rank = self.expert_checkpoint_replicas()
        cut = len(self._ckpt_prefix)
        expert_keys = frozenset(n[cut:] if n.startswith(self._ckpt_prefix) else n for n in expert_names)
        return model_sharded_state_dict(self._checkpoint_values(), dp_rank, prefix, sharded_offsets,
                                        self._megatron_layout, self.tensor_parallel_rank(), instance,
                                        expert_keys, expert_dp_rank)

    def tensor_parallel_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp_group is not None else 0

    def tensor_parallel_slices(self) -> dict:
        """{core parameter name: (Megatron placement, this rank's shape of it)}: where each
        parameter's tensor-parallel slice sits in the whole (optimizer checkpoints use it)."""
        placements, cut, out = self._megatron_layout.placements, len(self._ckpt_prefix), {}
        for entry in self.module.sharded_parameters():
            short = entry.name[cut:] if entry.name.startswith(self._ckpt_prefix) else entry.name
            if short in placements:
                out[entry.name] = (placements[short], tuple(entry.shape))
        return out

    def megatron_buffer_layout(self) -> tuple:
        """(model-parallel rank, ({name: BucketSlot}, per-bucket element counts), the grad
        buffer's dtype name): where Megatron's DDP with the distributed optimizer would keep each
        parameter's state in its buckets at this tensor/pipeline layout (checkpoint/distopt_format.py)."""
        from megatron.core import parallel_state as ps

        pg = self.pg_collection
        mp_group = getattr(pg, "mp", None) if pg is not None else None
        mp_group = mp_group or (ps.get_model_parallel_group() if ps.model_parallel_is_initialized() else None)
        pp_group = getattr(pg, "pp", None) if pg is not None else None
        pp_group = pp_group or (ps.get_pipeline_model_parallel_group() if ps.model_parallel_is_initialized() else None)
        entries = {e.name: e for e in self.module.sharded_parameters() if e.module_param.requires_grad}
        order = [(name, tuple(entries[name].shape), bool(getattr(entries[name].module_param, "shared_embedding", False)))
                 for name, _ in self.module.named_parameters() if name in entries]
        order += [(n, tuple(e.shape), bool(getattr(e.module_param, "shared_embedding", False)))
                  for n, e in entries.items() if n not in {o[0] for o in order}]
        bucket_size = megatron_bucket_size(self.ddp_config, dist.get_world_size(self.dp_cp_group),
                                           dist.get_rank(pp_group) if pp_group is not None else 0)
        slots = bucket_offsets(order, bucket_size, self.ddp_config)
        param_dtype = self.config.params_dtype if not (self.config.bf16 or self.config.fp16) else (
            torch.bfloat16 if self.config.bf16 else torch.float16)
        grad_dtype = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param_dtype
        mp_rank = dist.get_rank(mp_group) if mp_group is not None else 0
        return mp_rank, slots, buffer_dtype_name(param_dtype, grad_dtype)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load full tensors (keys as ``state_dict()`` gives them) or what ``dist_checkpointing.load``
        returned for ``sharded_state_dict()``, from any dp size and strategy; each rank keeps its
        shard. ``*._extra_state`` entries (Transformer Engine metadata) are skipped."""
        state_dict = OrderedDict((k, v) for k, v in state_dict.items() if not k.endswith("._extra_state"))
        values = model_values_from_loaded(self._checkpoint_values(), state_dict)
        result = self.module.load_state_dict(OrderedDict((self._ckpt_prefix + k, v) for k, v in values.items()),
                                             strict=strict)
        cut = len(self._ckpt_prefix)
        return _IncompatibleKeys([k[cut:] for k in result.missing_keys], [k[cut:] for k in result.unexpected_keys])
