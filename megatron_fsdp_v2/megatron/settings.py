"""What happens to every field of Megatron-Core 0.19.2's ``DistributedDataParallelConfig`` and
``OptimizerConfig`` with ``FullyShardedDataParallel`` / ``get_optimizer``: one table, as data.

Each field has one ``Setting``: its command-line flag (Megatron-LM's ``arguments.py``), a verdict and
the reason. A field is

* ``HONOURED``: it acts as in Megatron (mapped onto ``fully_shard``, or passed to Megatron's own
  optimizer, which reads it as it does for Megatron's DDP);
* ``REFUSED``: the values ``when`` selects raise ``ValueError`` naming the field, the value and the
  flag. Every rank computes the same verdict from its own config before any collective, so every
  rank raises;
* ``NO_EFFECT``: by design nothing here changes with it; the values ``when`` selects (those a user
  would set expecting an effect) warn once per process, naming the field and the flag.

``when(value, context)`` decides; it returns ``True`` (or a reason that replaces ``why`` in the
message) for the values that refuse or warn. The default ``when`` selects every value other than
the dataclass default. ``context`` holds the other configs (``"ddp"``, ``"model"``, ``"optimizer"``),
the strategy (``"strategy"``) and, for the optimizer, whether the chunks run in a CUDA graph
(``"cuda_graph"``, ``cuda_graph_mode``).

The constructor of ``FullyShardedDataParallel`` consults ``DDP_SETTINGS`` (``check_ddp_config``),
``get_optimizer`` and the ``pretrain_gpt`` launcher consult ``OPTIMIZER_SETTINGS``
(``check_optimizer_config``). ``settings_markdown()`` renders both tables for docs/megatron_settings.md.
CPU offload (honoured through ``OffloadPolicy``) and the precision-aware optimizer are in one place, ``CPU_OFFLOAD_SETTINGS``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch

__all__ = ["CPU_OFFLOAD_SETTINGS", "DDP_SETTINGS", "OPTIMIZER_SETTINGS", "Setting", "Verdict",
           "check_ddp_config", "check_optimizer_config", "cuda_graph_mode", "main_params_dtype", "settings_markdown"]


class Verdict(enum.Enum):
    HONOURED = "honoured"
    REFUSED = "refused"
    NO_EFFECT = "no effect (warns once)"


_DEFAULT = object()        # ``when``: "any value but the dataclass default"


@dataclass(frozen=True)
class Setting:
    """One config field: its flag, what happens to it here (``what``) and why."""

    field: str
    flag: Optional[str]
    verdict: Verdict
    what: str
    why: str
    when: Union[Callable[[Any, Mapping], Union[bool, str]], object] = _DEFAULT


def _honoured(field: str, flag: Optional[str], what: str, why: str = "") -> Setting:
    return Setting(field, flag, Verdict.HONOURED, what, why)


def _refused(field: str, flag: Optional[str], what: str, why: str, when=_DEFAULT) -> Setting:
    return Setting(field, flag, Verdict.REFUSED, what, why, when)


def _no_effect(field: str, flag: Optional[str], what: str, why: str, when=_DEFAULT) -> Setting:
    return Setting(field, flag, Verdict.NO_EFFECT, what, why, when)


def transformer_engine_installed() -> bool:
    """FP8 in Megatron means Transformer Engine's modules and float8 parameter classes."""
    return importlib.util.find_spec("transformer_engine") is not None


def _fp8_param_gather_without_te(value, context) -> bool:
    """--fp8-param-gather needs Transformer Engine's float8 parameter classes (they implement FSDP2's
    all-gather extension, TE PRs #2245 and #2789); without TE there is nothing to gather in FP8."""
    if not value:
        return False
    return not transformer_engine_installed()


def cuda_graph_mode(model_config, ddp_config) -> bool:
    """Whether the step runs inside Megatron's full-iteration CUDA graph (``cuda_graph_impl=
    'full_iteration'``, ``--cuda-graph-impl full_iteration``), or the DDP config asks for the
    graph-safe mode Megatron-LM sets with any CUDA graph (``megatron_fsdp_cuda_graph_mode``)."""
    return (getattr(model_config, "cuda_graph_impl", "none") == "full_iteration"
            or bool(getattr(ddp_config, "megatron_fsdp_cuda_graph_mode", False)))


_IN_A_GRAPH = ("CUDA graphs (cuda_graph_impl='full_iteration' or megatron_fsdp_cuda_graph_mode)")


def _nan_check_in_a_graph(value, context) -> Union[bool, str]:
    if value and cuda_graph_mode(context.get("model"), context["ddp"]):
        return (f"honoured, but not with {_IN_A_GRAPH}: the check reads every reduced gradient on the host, "
                f"which the captured forward-backward cannot contain; pass --no-check-for-nan-in-loss-and-grad "
                f"(check_for_nan_in_grad=False), as Megatron-LM demands with --cuda-graph-impl full_iteration")
    return False


def _all_gather_left_out_of_start_param_sync(value, context) -> bool:
    return value is False and not cuda_graph_mode(context.get("model"), context["ddp"])


def main_params_dtype(model_config, ddp_config) -> torch.dtype:
    """The main weights' dtype: ``megatron_fsdp_main_params_dtype``, or with ``None`` (Megatron-
    FSDP: the compute weights are the main weights) the compute dtype."""
    main = getattr(ddp_config, "megatron_fsdp_main_params_dtype", torch.float32)
    if main is not None:
        return main
    if getattr(model_config, "bf16", False):
        return torch.bfloat16
    if getattr(model_config, "fp16", False):
        return torch.float16
    return getattr(model_config, "params_dtype", None) or torch.float32


# ---------------------------------------------------------------- CPU offload
# --optimizer-cpu-offload is our offload by fraction (adapter.offload_policy, offload/host_link.py): the
# chunks offload whole groups and their inner Adam steps on each device. Megatron's argument
# validation demands --use-precision-aware-optimizer with it (its hybrid optimizer reuses that
# path); with fp32 optimizer dtypes that flag changes nothing here, so it is accepted with offload
# and refused without (Transformer Engine's FusedAdam with decoupled gradients is not supported).
_PRECISION_AWARE_WHY = ("the precision-aware optimizer (Transformer Engine's FusedAdam with decoupled "
                        "gradients) is not supported; with --optimizer-cpu-offload it is accepted for "
                        "Megatron's argument check and changes nothing while the optimizer dtypes stay fp32")


def _precision_aware_without_offload(value, context) -> bool:
    return bool(value) and not getattr(context["optimizer"], "optimizer_cpu_offload", False)


CPU_OFFLOAD_SETTINGS: Dict[str, Setting] = {s.field: s for s in (
    _refused("optimizer_cpu_offload", "--optimizer-cpu-offload",
             "honoured: offload by fraction (fully_shard's OffloadPolicy), the offloaded groups step on the CPU; "
             "refused with CUDA graphs (--cuda-graph-impl full_iteration)",
             "offloaded groups copy their gradients to the host and step there, which the captured forward-backward "
             "cannot contain; use no offload with --cuda-graph-impl full_iteration",
             when=lambda value, context: bool(value) and context.get("cuda_graph", False)),
    _refused("use_precision_aware_optimizer", "--use-precision-aware-optimizer",
             "accepted with --optimizer-cpu-offload (fp32 optimizer dtypes), refused otherwise", _PRECISION_AWARE_WHY,
             when=_precision_aware_without_offload),
    _honoured("optimizer_offload_fraction", "--optimizer-offload-fraction",
              "honoured: the fraction of main-weight bytes (whole groups) kept in host memory; 0 <= f <= 1"),
    _honoured("use_torch_optimizer_for_cpu_offload", "--use-torch-optimizer-for-cpu-offload",
              "honoured: offloaded groups always step with torch's fused CPU Adam/AdamW"),
    _honoured("overlap_cpu_optimizer_d2h_h2d", "--overlap-cpu-optimizer-d2h-h2d",
              "honoured: gradient and weight copies on a side stream, overlapped (False: synchronous)"),
    _honoured("pin_cpu_grads", "--no-pin-cpu-grads", "honoured: host buffers pinned; must equal pin_cpu_params"),
    _honoured("pin_cpu_params", "--no-pin-cpu-params", "honoured: host buffers pinned; must equal pin_cpu_grads"),
    _honoured("store_param_remainders", None,
              "honoured: read only with the precision-aware optimizer's lower-precision main weights (not used)"),
)}
_DECOUPLED_GRAD = _refused(
    "megatron_fsdp_use_decoupled_grad", "set by --use-precision-aware-optimizer", "refused when True",
    "decoupled gradients (the precision-aware optimizer's .decoupled_grad) are not supported; the launcher "
    "clears it with --optimizer-cpu-offload, where --use-precision-aware-optimizer changes nothing")


# ---------------------------------------------------------------- DistributedDataParallelConfig
def _outer_strategy_problem(value, context) -> Union[bool, str]:
    ddp = context["ddp"]
    if value not in ("no_shard", "optim"):
        return "'no_shard' (HSDP) or 'optim' (HFSDP) are supported"
    if value == "optim" and ddp.num_distributed_optimizer_instances < 2:
        return ("'optim' shards across distributed-optimizer instances: it needs "
                "num_distributed_optimizer_instances > 1 (--num-distributed-optimizer-instances)")
    if value == "optim" and ddp.data_parallel_sharding_strategy == "no_shard":
        return ("with data_parallel_sharding_strategy='no_shard' the inner strategy must shard the optimizer "
                "state ('optim', 'optim_grads' or 'optim_grads_params')")
    return False


def _main_grads_differ(value, context) -> Union[bool, str]:
    main = main_params_dtype(context.get("model"), context["ddp"])
    if value is not None and value != main:
        return (f"it must equal megatron_fsdp_main_params_dtype ({main}) with megatron_fsdp_v2 (a main "
                f"weight's .grad is a view of its reduced gradient); lower-precision gradient reduction is "
                f"megatron_fsdp_grad_comm_dtype (or grad_reduce_in_fp32=False)")
    return False


def _fp32_patterns_without_fp32_grads(value, context) -> bool:
    return bool(value) and main_params_dtype(context.get("model"), context["ddp"]) != torch.float32


def _align_with_pipeline(value, context) -> bool:
    pipeline = int(getattr(context.get("model"), "pipeline_model_parallel_size", 1) or 1)
    return bool(value) and bool(context["ddp"].overlap_param_gather) and pipeline > 1


_UNITS = ("communication is per unit (fsdp_unit_modules, a TransformerLayer by default): each unit's "
          "weights are all-gathered and its gradients reduced as one flat buffer")
_ALLOCATOR = ("temporaries come from the core's allocator (storage_freeing: freed after each use); "
              "fully_shard(allocator='trace_pool') is the persistent pool")
_NO_NCCL_UB = "NCCL user-buffer registration (nccl_ub) is refused, so there is nothing to register"

DDP_SETTINGS: Dict[str, Setting] = {s.field: s for s in (
    _honoured("grad_reduce_in_fp32", "--accumulate-allreduce-grads-in-fp32",
              "honoured: gradient collectives in fp32 (else in the compute dtype)",
              "gradients accumulate in the main-weight dtype either way"),
    _honoured("overlap_grad_reduce", "--overlap-grad-reduce",
              "honoured: True reduces each micro-batch's gradients as backward produces them (no_sync defers "
              "no_shard/optim to the last one); False reduces no_shard/optim once in finish_grad_sync",
              "ZeRO-2/3 reduce-scatter every micro-batch either way (they hold only their shard)"),
    _honoured("overlap_param_gather", "--overlap-param-gather",
              "always on, whatever the value: ZeRO-3 prefetches the next unit's weights during forward and "
              "backward; ZeRO-1/2 issue the post-step weight all-gather asynchronously and wait at first use",
              "the engine's schedule overlaps every all-gather; False does not turn it off"),
    _no_effect("align_param_gather", "--no-align-param-gather",
               "no effect; warns when True with overlap_param_gather and pipeline parallelism",
               "each pipeline stage all-gathers its weights when its own forward needs them",
               when=_align_with_pipeline),
    _honoured("use_distributed_optimizer", "--use-distributed-optimizer",
              "honoured as Megatron-FSDP means it (its argument validation forces it with --use-megatron-fsdp): "
              "the strategy decides what is sharded; 'optim', 'optim_grads' and 'optim_grads_params' shard the "
              "optimizer state, 'no_shard' keeps it replicated",
              "Megatron's DDP with the distributed optimizer is ZeRO-1, which is "
              "--data-parallel-sharding-strategy optim here"),
    _honoured("num_distributed_optimizer_instances", "--num-distributed-optimizer-instances",
              "honoured: hybrid sharding (shards within an instance, gradients averaged across instances); "
              "refused with experts"),
    _refused("check_for_nan_in_grad", "--no-check-for-nan-in-loss-and-grad",
             "honoured: after each reduce, raises naming the first parameter whose gradient holds NaN/Inf; "
             "refused (True) with CUDA graphs (cuda_graph_impl='full_iteration' or megatron_fsdp_cuda_graph_mode)",
             "", when=_nan_check_in_a_graph),
    _refused("check_for_large_grads", "--check-for-large-grads", "refused when True",
             "Megatron's check runs its rerun state machine on each DDP bucket's gradient norm; this wrapper "
             "has no DDP buckets (check_for_nan_in_grad is supported)"),
    _no_effect("bucket_size", "--ddp-bucket-size", "no effect; warns when set", _UNITS),
    _no_effect("num_buckets", "--ddp-num-buckets", "no effect; warns when set", _UNITS),
    _no_effect("pad_buckets_for_high_nccl_busbw", "--ddp-pad-buckets-for-high-nccl-busbw",
               "no effect; warns when True", _UNITS + "; their padding is the flat layout's own"),
    _refused("reduce_scatter_with_fp32_accumulation", "--ddp-reduce-scatter-with-fp32-accumulation",
             "refused when True",
             "the low-precision-on-the-wire, fp32-accumulating reduce-scatter is not implemented; "
             "grad_reduce_in_fp32 (--accumulate-allreduce-grads-in-fp32) reduces in fp32"),
    _refused("param_name_patterns_for_fp32_local_accumulation", "--ddp-param-name-patterns-for-fp32-local-accumulation",
             "honoured with fp32 main weights (every gradient accumulates in fp32 already); refused with "
             "lower-precision main weights (megatron_fsdp_main_params_dtype=None and bf16/fp16)",
             "gradients accumulate in the main-weight dtype, one dtype for all parameters",
             when=_fp32_patterns_without_fp32_grads),
    _no_effect("average_in_collective", "--ddp-average-in-collective", "no effect; warns when True",
               "gradients are summed in the collective and divided by the data-parallel size afterwards, in "
               "the gradient dtype (the same mean)"),
    _refused("fp8_param_gather", "--fp8-param-gather",
             "honoured with Transformer Engine installed; refused when True without it",
             "its FP8 parameters are Transformer Engine's Float8Tensor / MXFP8Tensor, gathered through FSDP2's "
             "all-gather extension (extensions/weights.py), and Transformer Engine is not installed",
             when=_fp8_param_gather_without_te),
    _refused("fp4_param_gather", "--fp4-param-gather", "refused when True", "FP4 compute weights are not supported"),
    _refused("reuse_grad_buf_for_mxfp8_param_ag", "--reuse-grad-buf-for-mxfp8-param-ag", "refused when True",
             "MXFP8 parameter all-gathers are not supported"),
    _honoured("use_megatron_fsdp", "--use-megatron-fsdp",
              "set: the wrapper's ddp_config copy always has True, so Megatron's optimizer takes its FSDP "
              "path; examples/pretrain_gpt.py takes the flag as selecting this package (Megatron's argument "
              "validation runs with it, then get_model wraps with FullyShardedDataParallel)"),
    _honoured("use_custom_fsdp", None, "not read (Megatron's deprecated alias of use_megatron_fsdp)"),
    _honoured("data_parallel_sharding_strategy", "--data-parallel-sharding-strategy",
              "honoured: fully_shard's sharding_strategy"),
    _no_effect("gradient_reduce_div_fusion", "--no-gradient-reduce-div-fusion", "no effect; warns when False",
               "the division by the data-parallel size always follows the collective (no fused pre-multiply)"),
    _no_effect("suggested_communication_unit_size", "--suggested-communication-unit-size",
               "no effect; warns when set", _UNITS + "; ZeRO-3 prefetches one unit ahead"),
    _no_effect("keep_fp8_transpose_cache", "--keep-fp8-transpose-cache", "no effect; warns when True",
               "FP8 compute weights are refused, so there is no transpose cache"),
    _refused("nccl_ub", "--use-nccl-ub", "refused when True", "NCCL user-buffer registration is not supported"),
    _no_effect("fsdp_double_buffer", "--fsdp-double-buffer", "no effect; warns when True", _ALLOCATOR),
    _no_effect("fsdp_db_use_persist_buf_on_alloc_fail", "--fsdp-db-use-persist-buf-on-alloc-fail",
               "no effect; warns when True", _ALLOCATOR),
    _no_effect("fsdp_all_gather_in_start_param_sync", None,
               "no effect; warns when False outside CUDA graphs (Megatron-LM sets it False with "
               "--cuda-graph-impl full_iteration)",
               "start_param_sync (and Megatron's optimizer step) rebuild ZeRO-1/2's compute weights by an all-gather "
               "either way; in CUDA graph mode it is waited before optimizer.step() returns, so no all-gather crosses "
               "the captured forward's boundary (what False is for in Megatron-FSDP)",
               when=_all_gather_left_out_of_start_param_sync),
    _refused("outer_dp_sharding_strategy", "--outer-dp-sharding-strategy",
             "honoured: 'no_shard' (HSDP) and 'optim' (HFSDP) with num_distributed_optimizer_instances > 1; "
             "refused otherwise", "", when=_outer_strategy_problem),
    _no_effect("disable_symmetric_registration", "--disable-symmetric-registration", "no effect; warns when True",
               _NO_NCCL_UB),
    _no_effect("fsdp_manual_registration", "--fsdp-manual-registration", "no effect; warns when True", _NO_NCCL_UB),
    _refused("delay_wgrad_compute", "--delay-wgrad-compute", "refused when True",
             "weight gradients computed later by backward_dw() would bypass this wrapper's gradient reduction"),
    _honoured("megatron_fsdp_main_params_dtype", "--megatron-fsdp-main-params-dtype",
              "honoured: the main weights' dtype; None: the compute dtype, no separate main weights (no_shard's "
              "compute weights are the main weights; the sharded strategies keep this rank's shard in it)"),
    _refused("megatron_fsdp_main_grads_dtype", "--megatron-fsdp-main-grads-dtype",
             "honoured when None (the main-weight dtype) or equal to it; refused otherwise", "",
             when=_main_grads_differ),
    _honoured("megatron_fsdp_grad_comm_dtype", "--megatron-fsdp-grad-comm-dtype",
              "honoured: the gradient collectives' dtype (overrides grad_reduce_in_fp32)"),
    _DECOUPLED_GRAD,
    _honoured("megatron_fsdp_cuda_graph_mode", None,
              "honoured: True runs the engine capture-safe (Engine.capture_safe: every collective a step issues is "
              "waited within it), as cuda_graph_impl='full_iteration' does; Megatron-LM sets it with "
              "--use-megatron-fsdp and any --cuda-graph-impl",
              "ZeRO-1/2's weight all-gather after optimizer.step() then lands before the step returns, not during "
              "the next (captured) forward"),
    _no_effect("megatron_fsdp_enable_fine_grained_param_gather", "--megatron-fsdp-enable-fine-grained-param-gather",
               "no effect; warns when True", _UNITS),
    _no_effect("megatron_fsdp_max_pool_double_buffer", "--megatron-fsdp-max-pool-double-buffer",
               "no effect; warns when True", _ALLOCATOR),
)}


# ---------------------------------------------------------------- OptimizerConfig
def _not_adam_sgd_or_muon(value, context) -> bool:
    return value not in ("adam", "sgd", "muon")


def _muon_only(values: tuple):
    """Refused when optimizer='muon' and the value is not one of ``values``."""
    def when(value, context) -> bool:
        return getattr(context.get("optimizer"), "optimizer", "adam") == "muon" and value not in values
    return when


def _clipping_low_precision_grads(value, context) -> Union[bool, str]:
    main = context.get("main_dtype")
    if value and value > 0.0 and main is not None and main != torch.float32:
        return (f"the main weights (and their gradients) are {main} (ddp_config.megatron_fsdp_main_params_dtype="
                f"None with bf16/fp16) and Megatron's gradient clipping takes fp32 gradients only; pass "
                f"clip_grad=0 (--clip-grad 0) or keep fp32 main weights")
    return False


def _fp16_with_sgd(value, context) -> bool:
    return bool(value) and getattr(context.get("optimizer"), "optimizer", "adam") == "sgd"


_MEGATRON = "honoured: Megatron's optimizer reads it as for its own DDP"
_SCALER = "honoured: Megatron's loss scaler (fp16 with optimizer='adam')"
_OTHER_OPTIMIZERS = "honoured: read only by optimizer='{}', which is refused here (Megatron ignores it for adam and sgd too)"
_MUON = ("honoured: Megatron's Muon reads it (optimizer='muon'; each matrix is orthogonalized whole on its owner "
         "rank, megatron/muon.py)")


def _read_only_by(optimizer: str, fields: str, flags: Mapping[str, Optional[str]]) -> List[Setting]:
    return [_honoured(name, flags.get(name), _OTHER_OPTIMIZERS.format(optimizer)) for name in fields.split()]


_MUON_FLAGS = {"muon_momentum": "--muon-momentum", "muon_split_qkv": "--muon-no-split-qkv",
               "muon_nesterov": "--muon-nesterov", "muon_scale_mode": "--muon-scale-mode",
               "muon_fp32_matmul_prec": "--muon-fp32-matmul-prec", "muon_coefficient_type": "--muon-coefficient-type",
               "muon_num_ns_steps": "--muon-num-ns-steps", "muon_tp_mode": "--muon-tp-mode",
               "muon_extra_scale_factor": "--muon-extra-scale-factor",
               "muon_scalar_optimizer": "--muon-scalar-optimizer", "lion_beta1": "--lion-beta1",
               "lion_beta2": "--lion-beta2"}

OPTIMIZER_SETTINGS: Dict[str, Setting] = {s.field: s for s in (
    _honoured("lr", "--lr", _MEGATRON),
    _honoured("min_lr", "--min-lr", _MEGATRON),
    _honoured("decoupled_lr", "--decoupled-lr", _MEGATRON,
              "the main weights carry is_embedding_or_output_parameter"),
    _honoured("decoupled_min_lr", "--decoupled-min-lr", _MEGATRON),
    _honoured("weight_decay", "--weight-decay", _MEGATRON,
              "which parameters decay is decided on their original shapes (with_original_shapes)"),
    _honoured("apply_wd_to_qk_layernorm", "--apply-wd-to-qk-layernorm", _MEGATRON),
    _honoured("fp8_recipe", "--fp8-recipe", "honoured: read by Transformer Engine with --fp8-format / --fp8-param-gather (refused without it)"),
    _refused("fp16", "--fp16", "honoured with optimizer='adam' (loss scaling); refused with 'sgd'",
             "loss scaling needs optimizer='adam' (sgd runs FP32Optimizer on the fp32 main weights)",
             when=_fp16_with_sgd),
    _honoured("bf16", "--bf16", "honoured: adam's mixed-precision optimizer over the main weights (sgd: "
                                "FP32Optimizer, the main weights are fp32 already)"),
    _refused("reuse_grad_buf_for_mxfp8_param_ag", "--reuse-grad-buf-for-mxfp8-param-ag", "refused when True",
             "MXFP8 parameter all-gathers are not supported"),
    _honoured("params_dtype", None, "not read by Megatron's optimizer (the model's dtype is the TransformerConfig's)"),
    *CPU_OFFLOAD_SETTINGS.values(),
    *(_honoured(name, flag, "honoured: fp32, the only value Megatron allows without "
                            "use_precision_aware_optimizer",
                "the main weights' dtype is ddp_config.megatron_fsdp_main_params_dtype; Adam keeps its state in it")
      for name, flag in (("main_grads_dtype", "--main-grads-dtype"), ("main_params_dtype", "--main-params-dtype"),
                         ("exp_avg_dtype", "--exp-avg-dtype"), ("exp_avg_sq_dtype", "--exp-avg-sq-dtype"))),
    _refused("optimizer", "--optimizer", "honoured for 'adam', 'sgd' and 'muon' (Megatron's Muon, each matrix "
                                         "orthogonalized whole on one data-parallel rank: megatron/muon.py); "
                                         "refused otherwise",
             "the other emerging optimizers are not wired to row-sharded parameters",
             when=_not_adam_sgd_or_muon),
    *(_honoured(name, "--" + name.replace("_", "-"), _SCALER)
      for name in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")),
    *(_honoured(name, flag, _MEGATRON) for name, flag in (
        ("adam_beta1", "--adam-beta1"), ("adam_beta2", "--adam-beta2"), ("adam_eps", "--adam-eps"),
        ("decoupled_weight_decay", None), ("sgd_momentum", "--sgd-momentum"))),
    *(_honoured(name, _MUON_FLAGS[name], _MUON) for name in (
        "muon_momentum muon_split_qkv muon_nesterov muon_scale_mode muon_fp32_matmul_prec muon_coefficient_type "
        "muon_num_ns_steps muon_extra_scale_factor").split()),
    _refused("muon_tp_mode", "--muon-tp-mode", "honoured: 'blockwise' (Megatron's default); refused otherwise",
             "each tensor-parallel block is orthogonalized whole on one data-parallel rank; the 'duplicated' and "
             "'distributed' modes would run tensor-parallel collectives on that rank alone",
             when=_muon_only(("blockwise",))),
    _refused("muon_scalar_optimizer", "--muon-scalar-optimizer", "honoured: 'adam' (Megatron's default); refused "
                                                                "otherwise",
             "the non-matrix parameters step with Megatron's Adam; Lion is not wired here",
             when=_muon_only(("adam",))),
    *_read_only_by("lion", "lion_beta1 lion_beta2", _MUON_FLAGS),
    *_read_only_by("soap", "soap_shampoo_beta soap_precondition_frequency soap_use_kl_shampoo", {}),
    *_read_only_by("adaptive_muon", "adaptive_muon_moment2_method adaptive_muon_beta2 adaptive_muon_eps", {}),
    _honoured("use_distributed_optimizer", "--use-distributed-optimizer",
              "set by get_optimizer (True for adam: Megatron's DistributedOptimizer on its FSDP path, with every "
              "strategy; False for sgd)",
              "with 'no_shard' the DistributedOptimizer steps replicated main weights and sums gradient norms over "
              "the model-parallel group only, as for Megatron-FSDP"),
    _honoured("use_layer_wise_distributed_optimizer", "--use-distributed-optimizer (with muon)",
              "honoured by the strategy, as use_distributed_optimizer: Megatron-LM sets it for --optimizer muon "
              "with --use-distributed-optimizer; Muon's momentum is sharded like its parameter (optim, "
              "optim_grads, optim_grads_params) and each matrix is gathered to one owner rank per step, so "
              "get_optimizer builds Megatron's Muon without its layer-wise wrapper (megatron/muon.py)"),
    _honoured("overlap_param_gather", "--overlap-param-gather",
              "honoured: Megatron's optimizer reads it only with reuse_grad_buf_for_mxfp8_param_ag (refused); "
              "see ddp_config.overlap_param_gather"),
    _refused("overlap_param_gather_with_optimizer_step", "--overlap-param-gather-with-optimizer-step",
             "refused when True", "the compute weights are rebuilt from the main weights after the step "
                                  "(asynchronously), not bucket by bucket inside it"),
    _refused("clip_grad", "--clip-grad",
             "honoured: the global norm over every rank's shard (grad_stats_parallel_group, optimizer.py); "
             "refused (> 0) with main weights below fp32", "", when=_clipping_low_precision_grads),
    _honoured("grad_norm_skip_threshold", None,
              "honoured: a larger gradient norm skips the step (update_successful=False), as Megatron's "
              "ChainedOptimizer does; get_optimizer returns one when the threshold is finite",
              "Megatron's FSDP path returns the bare optimizer, whose step never skips"),
    _honoured("log_num_zeros_in_grad", "--log-num-zeros-in-grad",
              "honoured: counted over the grad-norm group (every rank's shard)"),
    _honoured("barrier_with_L1_time", "--no-barrier-with-level-1-timing", _MEGATRON),
    _honoured("timers", None, _MEGATRON),
    _honoured("config_logger_dir", "--config-logger-dir", _MEGATRON),
    _refused("optimizer_cuda_graph", "--optimizer-cuda-graph", "refused when True",
             "a graph of optimizer.step() would replay, without the Python that runs around the step here, which "
             "groups changed and ZeRO-1/2's weight all-gather, and is not verified with this wrapper; "
             "--cuda-graph-impl full_iteration captures forward and backward and keeps the step eager"),
)}


# ---------------------------------------------------------------- applying the table
_WARNED: set = set()


def _defaults(config_class) -> Dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config_class):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _triggered(setting: Setting, value, default, context) -> Union[bool, str]:
    if setting.when is _DEFAULT:
        return not _same(value, default)
    return setting.when(value, context)


def _text(setting: Setting, value, reason: str) -> str:
    flag = f" ({setting.flag})" if setting.flag else ""
    return f"{setting.field}={value!r}{flag}: {reason}"


def apply_settings(table: Mapping[str, Setting], values: Mapping[str, Any], defaults: Mapping[str, Any],
                   context: Mapping, owner: str) -> List[str]:
    """Warn once for each triggered ``NO_EFFECT`` field; return the texts of the triggered
    ``REFUSED`` ones (field=value (flag): why). ``values``: field -> value (absent fields skipped)."""
    problems = []
    for name, setting in table.items():
        if name not in values or setting.verdict is Verdict.HONOURED:
            continue
        hit = _triggered(setting, values[name], defaults.get(name), context)
        if not hit:
            continue
        reason = hit if isinstance(hit, str) else setting.why
        if setting.verdict is Verdict.REFUSED:
            problems.append(_text(setting, values[name], reason))
        elif (owner, name) not in _WARNED:
            _WARNED.add((owner, name))
            warnings.warn(f"megatron_fsdp_v2: {owner}.{_text(setting, values[name], reason)}; this setting has "
                          f"no effect here (docs/megatron_settings.md).", UserWarning, stacklevel=4)
    return problems


def check_ddp_config(ddp_config, model_config, extra_problems: List[str] = ()) -> None:
    """Refuse (every rank, before any collective) or warn once for ``ddp_config``'s fields."""
    from megatron.core.distributed import DistributedDataParallelConfig

    values = {f.name: getattr(ddp_config, f.name) for f in dataclasses.fields(DistributedDataParallelConfig)}
    context = {"ddp": ddp_config, "model": model_config}
    problems = list(extra_problems) + apply_settings(DDP_SETTINGS, values, _defaults(DistributedDataParallelConfig),
                                                     context, "ddp_config")
    if problems:
        raise ValueError("FullyShardedDataParallel does not support: " + "; ".join(problems) + ".")


def check_optimizer_config(values: Mapping[str, Any], strategy: Optional[str], where: str = "get_optimizer",
                           main_dtype: Optional[torch.dtype] = None, cuda_graph: bool = False) -> None:
    """Refuse or warn once for an ``OptimizerConfig``'s fields (``values``: field -> value; the
    launcher passes its parsed arguments, whose names are the fields'). ``strategy`` and
    ``main_dtype``: the model chunks' (None: not known yet). ``cuda_graph``: the chunks run in CUDA
    graph mode (``cuda_graph_mode``); the launcher's arguments say it by ``cuda_graph_impl``."""
    from megatron.core.optimizer import OptimizerConfig

    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    present = {k: v for k, v in values.items() if k in names}
    cuda_graph = cuda_graph or values.get("cuda_graph_impl") == "full_iteration"
    context = {"optimizer": _Values(present), "strategy": strategy, "main_dtype": main_dtype, "cuda_graph": cuda_graph}
    problems = apply_settings(OPTIMIZER_SETTINGS, present, _defaults(OptimizerConfig), context, "optimizer_config")
    if problems:
        raise ValueError(f"{where}: FullyShardedDataParallel does not support " + "; ".join(problems) + ".")


class _Values:
    """Attribute access to a field -> value mapping (what the ``when`` functions read)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)


def settings_markdown() -> str:
    """Both tables as Markdown (docs/megatron_settings.md holds this text)."""
    lines = []
    for title, table in (("DistributedDataParallelConfig", DDP_SETTINGS), ("OptimizerConfig", OPTIMIZER_SETTINGS)):
        lines += [f"### `{title}`", "", "| field | flag | verdict | what happens here | why |", "|---|---|---|---|---|"]
        for setting in table.values():
            flag = f"`{setting.flag}`" if setting.flag and setting.flag.startswith("--") else (setting.flag or "")
            cells = [f"`{setting.field}`", flag, setting.verdict.value, setting.what, setting.why]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)
