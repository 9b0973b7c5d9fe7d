"""What the wrapper's constructor reads from Megatron's configs before it wraps anything: the
strategy and its checks (``_checked_strategy``: the constructor's arguments and, through
settings.py, every field of the DDP config), the model-config settings this wrapper cannot honour,
the mixed-precision policy, and the offload policy of an ``OptimizerConfig``. All local: no
collective, so every rank raises alike."""

from __future__ import annotations

import importlib.util
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from ..mixed_precision import MixedPrecisionPolicy
from ..offload.policy import OffloadPolicy
from ..strategy import STRATEGY_NAMES, get_strategy
from .settings import check_ddp_config, main_params_dtype, transformer_engine_installed

__all__ = ["megatron_adam_kernel", "offload_policy"]


def megatron_adam_kernel() -> str:
    """The kernel of the Adam Megatron's ``get_megatron_optimizer`` builds, for the plan
    (plan/optimizer_step.py): Transformer Engine's or Apex's FusedAdam, updating in place
    (``"fused"``), when either is installed (megatron/core/optimizer/__init__.py tries them in that
    order), else torch's AdamW with its default kernel, ``"foreach"`` on CUDA."""
    fused = any(importlib.util.find_spec(name) is not None for name in ("transformer_engine", "apex"))
    return "fused" if fused else "foreach"


def _group_size(group) -> int:
    if group is None:
        return 1
    if isinstance(group, (list, tuple)):
        return max((_group_size(g) for g in group), default=1)
    return dist.get_world_size(group)


def _parallel_sizes(pg_collection) -> dict:
    """Sizes of the model-parallel groups this wrapper cannot combine with (1 when absent)."""
    names = {"ep": "expert", "expt_tp": "expert tensor"}
    sizes = {}
    if pg_collection is not None:
        for attr in names:
            sizes[attr] = _group_size(getattr(pg_collection, attr, None))
        return sizes
    from megatron.core import parallel_state as ps

    getters = {
        "ep": ps.get_expert_model_parallel_world_size,
        "expt_tp": ps.get_expert_tensor_parallel_world_size,
    }
    for attr, getter in getters.items():
        try:
            sizes[attr] = int(getter() or 1)
        except (AssertionError, AttributeError, RuntimeError, TypeError):
            sizes[attr] = 1
    return sizes


def _unsupported_settings(config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                          module: nn.Module, sizes: dict) -> List[str]:
    """Every model-config setting (and combination with the model) this wrapper cannot honour, each
    naming the setting and its flag; ``ddp_config``'s own fields are settings.py's table."""
    problems = []

    def check(bad: bool, text: str) -> None:
        if bad:
            problems.append(text)

    # Expert sizes matter only with experts (Megatron defaults the expert tensor-parallel size to
    # the tensor-parallel size, experts or not): a TP-only layout is never refused for them.
    experts = bool(getattr(config, "num_moe_experts", None))
    if experts:
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        etp = max(int(getattr(config, "expert_tensor_parallel_size", None) or tp), sizes.get("expt_tp", 1))
        check(etp != tp, f"expert_tensor_parallel_size={etp} (--expert-tensor-parallel-size) with "
                         f"tensor_model_parallel_size={tp}: expert parameters are sharded over Megatron's expert-data-"
                         f"parallel group, which must lie inside the data-parallel group; use the same size (Megatron's "
                         f"default)")
        check(ddp_config.num_distributed_optimizer_instances > 1,
              f"num_distributed_optimizer_instances={ddp_config.num_distributed_optimizer_instances} "
              "(--num-distributed-optimizer-instances) with expert parameters (--num-experts): hybrid sharding of "
              "experts is not supported")
        check(module is not None and any(p.is_meta for p in module.parameters()),
              "init_model_with_meta_device=True (--init-model-with-meta-device) with expert parameters "
              "(--num-experts): every expert-parallel rank would initialize its experts alike")
    check(getattr(config, "fp8", None) is not None and not transformer_engine_installed(),
          f"fp8={config.fp8!r} (--fp8-format): FP8 compute runs in Transformer Engine's modules, and Transformer "
          "Engine is not installed")
    check(getattr(config, "fp4", None) is not None,
          f"fp4={getattr(config, 'fp4', None)!r} (--fp4-format): FP4 compute weights are not supported")
    check(bool(getattr(config, "gradient_accumulation_fusion", False)),
          "gradient_accumulation_fusion=True: the fused wgrad kernels write into param.main_grad, which "
          "this wrapper does not provide; pass --no-gradient-accumulation-fusion")
    graphs = _per_layer_graphs_problem(getattr(config, "cuda_graph_impl", "none"))
    check(graphs is not None, graphs)
    check(bool(getattr(config, "delay_wgrad_compute", False)),
          "delay_wgrad_compute=True (--delay-wgrad-compute): weight gradients computed later by backward_dw() "
          "would bypass this wrapper's gradient reduction")
    return problems


_WHOLE_ITERATION = ("; allowed: 'none' or 'full_iteration' (--cuda-graph-impl full_iteration: the whole "
                    "forward-backward as one graph)")


def _per_layer_graphs_problem(impl) -> Optional[str]:
    """Why Megatron's per-layer CUDA graphs (``local``, ``transformer_engine``) cannot run with this
    wrapper, or None (``none``, ``full_iteration``: the engine runs capture-safe, adapter.py)."""
    got = f"cuda_graph_impl={impl!r} (--cuda-graph-impl): "
    if impl in (None, "none", "full_iteration"):
        return None
    if impl == "local":
        return (got + "Megatron's per-layer graphs add each layer's weight gradients to param.main_grad inside "
                "the graph and hand autograd none, so no gradient reaches this wrapper (it keeps no "
                "param.main_grad; its gradient hooks run on autograd's accumulation)" + _WHOLE_ITERATION)
    if impl == "transformer_engine" and not transformer_engine_installed():
        return (got + "these per-layer graphs are made by Transformer Engine's make_graphed_callables, and "
                "Transformer Engine is not installed" + _WHOLE_ITERATION)
    if impl == "transformer_engine":
        return (got + "Transformer Engine's make_graphed_callables refuses modules with hooks registered, and "
                "this wrapper registers its hooks on every unit (a TransformerLayer by default)" + _WHOLE_ITERATION)
    return got + "unknown implementation" + _WHOLE_ITERATION


def offload_policy(config) -> Optional[OffloadPolicy]:
    """Megatron's optimizer offload settings (``OptimizerConfig``: ``optimizer_cpu_offload``,
    ``optimizer_offload_fraction``, ``overlap_cpu_optimizer_d2h_h2d``, ``pin_cpu_params`` /
    ``pin_cpu_grads``) as our ``OffloadPolicy``; None without ``optimizer_cpu_offload`` (Megatron
    reads the others only with it). ``get_optimizer`` applies it (optimizer.py).

    Megatron's argument check demands ``--use-precision-aware-optimizer`` with
    ``--optimizer-cpu-offload`` (its hybrid optimizer reuses that code path); that flag changes
    nothing here as long as the optimizer's dtypes stay fp32, so other dtypes are refused."""
    if not getattr(config, "optimizer_cpu_offload", False):
        return None
    fraction = config.optimizer_offload_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError("optimizer_offload_fraction (--optimizer-offload-fraction) must be a number with "
                         f"0 <= fraction <= 1, got {fraction!r}.")
    if bool(config.pin_cpu_params) != bool(config.pin_cpu_grads):
        raise ValueError(f"pin_cpu_params ({config.pin_cpu_params}) and pin_cpu_grads ({config.pin_cpu_grads}) must "
                         "agree with optimizer_cpu_offload: host main weights and gradients are pinned alike.")
    if getattr(config, "use_precision_aware_optimizer", False):
        dtypes = {name: getattr(config, name, torch.float32)
                  for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")}
        lower = {name: str(dtype) for name, dtype in dtypes.items() if dtype != torch.float32}
        if lower:
            raise ValueError(f"use_precision_aware_optimizer with optimizer_cpu_offload: only fp32 optimizer dtypes "
                             f"are supported, got {lower}.")
    return OffloadPolicy(fraction=float(fraction), pin_memory=bool(config.pin_cpu_params),
                         overlap=bool(config.overlap_cpu_optimizer_d2h_h2d))


def _mixed_precision(config: TransformerConfig, ddp_config: DistributedDataParallelConfig) -> MixedPrecisionPolicy:
    """Compute weights in bf16/fp16 per ``config``; main weights (and the gradients, which a main
    weight's ``.grad`` views) in ``megatron_fsdp_main_params_dtype``, with ``None`` the compute dtype
    (settings.py checked ``megatron_fsdp_main_grads_dtype`` against it)."""
    if config.bf16 and config.fp16:
        raise ValueError("config: bf16 and fp16 are both set; choose one (--bf16 or --fp16).")
    param_dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
    main = main_params_dtype(config, ddp_config)
    grads = getattr(ddp_config, "megatron_fsdp_main_grads_dtype", None) or main
    comm = getattr(ddp_config, "megatron_fsdp_grad_comm_dtype", None)
    if comm is None:
        comm = torch.float32 if (ddp_config.grad_reduce_in_fp32 or param_dtype is None) else param_dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, main_params_dtype=main, main_grads_dtype=grads,
                                grad_comm_dtype=comm)


def _checked_strategy(config, ddp_config, module: nn.Module, pg_collection, full_param_layout, device,
                      auto_strategy) -> tuple:
    """(the strategy to plan or wrap with, whether it is ``auto``) after checking the constructor's
    arguments and every field of ``ddp_config`` (settings.py), on every rank before any collective."""
    if not isinstance(ddp_config, DistributedDataParallelConfig):
        raise TypeError(f"ddp_config must be a DistributedDataParallelConfig, got {type(ddp_config).__name__}.")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
    strategy_name = ddp_config.data_parallel_sharding_strategy
    if strategy_name not in STRATEGY_NAMES + ("auto",):
        raise ValueError(
            f"ddp_config.data_parallel_sharding_strategy (--data-parallel-sharding-strategy) must be one of "
            f"{list(STRATEGY_NAMES) + ['auto']}, got {strategy_name!r}.")
    if auto_strategy is not None and strategy_name != "auto":
        raise ValueError(f"auto_strategy is used with data_parallel_sharding_strategy='auto' only, got "
                         f"{strategy_name!r}.")
    auto = strategy_name == "auto"
    # auto: planned with the layer units ZeRO-3 uses (disable_bucketing does not merge them then)
    strategy = get_strategy("optim_grads_params" if auto else strategy_name,
                            argument="ddp_config.data_parallel_sharding_strategy")
    if full_param_layout is not None:
        raise ValueError("full_param_layout: pre-computed Megatron DDP buffer layouts do not apply to "
                         "FullyShardedDataParallel; pass None.")
    if device is not None:
        want = torch.device(device)
        elsewhere = sorted({str(p.device) for p in module.parameters()
                            if p.device.type != want.type or want.index not in (None, p.device.index)})
        if elsewhere:
            raise ValueError(f"device={device}: module parameters are on {elsewhere}; move the module "
                             "before wrapping it.")
    # every field of ddp_config: honoured, refused (raised here, on every rank) or warned once
    check_ddp_config(ddp_config, config, _unsupported_settings(config, ddp_config, module,
                                                               _parallel_sizes(pg_collection)))
    return strategy, auto
