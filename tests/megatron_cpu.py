"""CPU test harness for Megatron-Core 0.19.2 (gloo, several real processes, no GPU).

Lets a tiny ``GPTModel`` (local layer spec, fp32) be built and trained on CPU, driven by
Megatron's own ``get_forward_backward_func()`` schedule and ``finalize_model_grads``.

Megatron hard-codes CUDA in a few places.  ``patch_megatron_for_cpu()`` patches exactly those,
and only inside Megatron modules (never ``torch.cuda`` itself and never package code), so code
under test that hard-codes CUDA still fails on CPU.  See ``patch_megatron_for_cpu`` for the list;
the patches and the parallel-state helpers live in ``testing/cpu_compat.py``
(checkout scaffolding shared with ``make demo``, not installed) and are re-exported here.

Typical use (inside a worker started by ``run_distributed``)::

    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        model, config = build_tiny_gpt(seed=1234)
        batches = synthetic_batches(seed=100 + dp_rank, n=iters * nmb, micro_batch_size=2,
                                    seq=16, vocab=64)
        res = train_reference(model, config, batches, num_microbatches=nmb, iters=iters, lr=0.1)

Gradient semantics (identical to Megatron-LM training): the loss function returns
``(sum_of_token_losses, num_tokens, {...})``; with ``calculate_per_token_loss=False`` the
schedule divides each micro-batch loss by its ``num_tokens`` and by ``num_microbatches``
(schedules.py ``forward_step_calc_loss``), gradients are *summed* over the micro-batches of
an iteration (backward accumulates), and the data-parallel reduction *averages* over the DP
group (Megatron DDP: pre-scale by 1/dp then SUM all-reduce; torch DDP: AVG).  So the final
gradient is the gradient of ``mean_over_dp_ranks(mean_over_microbatches(mean_over_tokens))``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Any, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = [
    "patch_megatron_for_cpu",
    "megatron_on_cpu",
    "init_megatron_parallel_state",
    "destroy_megatron_parallel_state",
    "cpu_model_parallel_manual_seed",
    "build_tiny_gpt",
    "sequence_parallel_torch_norms",
    "synthetic_batches",
    "forward_step_func",
    "loss_func",
    "TorchDDPForMegatron",
    "wrap_megatron_ddp",
    "train_reference",
    "TrainResult",
    "run_distributed",
    "reference_worker",
    "state_dicts_equal",
    "constant_param_scheduler",
    "writing_our_earlier_optimizer_layout",
]


# ---------------------------------------------------------------------------------------------
# CPU patches and parallel state: shared with the demo, see testing/cpu_compat.py
# ---------------------------------------------------------------------------------------------

from testing.cpu_compat import (  # noqa: E402  (re-exported)
    UNFUSED_KERNELS,
    cpu_model_parallel_manual_seed,
    destroy_megatron_parallel_state,
    init_megatron_parallel_state,
    patch_megatron_for_cpu,
)
from testing.megatron_gpt import forward_step, local_gpt, loss_func, tiny_cpu_config  # noqa: E402,F401


@contextlib.contextmanager
def megatron_on_cpu(world_size: int, **parallel_state_kwargs):
    """Inside a worker: ``patch_megatron_for_cpu()`` with Megatron's parallel state initialised
    (``init_megatron_parallel_state``) for the block and destroyed after it."""
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size, **parallel_state_kwargs)
        try:
            yield
        finally:
            destroy_megatron_parallel_state()


# ---------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------


def build_tiny_gpt(
    seed: int = 1234,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    seq: int = 16,
    layer_spec=None,
    stage: Optional[Dict[str, Any]] = None,
    **config_overrides,
):
    """Build a tiny fp32 ``GPTModel`` with the local (non-TE) layer spec on CPU.

    Initialisation depends only on ``seed`` (CPU RNG, ``use_cpu_initialization=True``), so it is
    identical on every rank.  Dropout is 0 so that training is deterministic.  Returns
    ``(model, config)``.
    """
    config = tiny_cpu_config(layers, hidden, heads, **config_overrides)
    stage = stage or {}     # pipeline stage: pre_process, post_process, vp_stage
    return local_gpt(config, vocab, seq, seed=seed, layer_spec=layer_spec, **stage), config


@contextlib.contextmanager
def sequence_parallel_torch_norms():
    """Megatron's local spec builds torch norms, which refuse ``sequence_parallel=True``; its
    fused norms (Transformer Engine, apex) accept it and mark their parameters
    ``sequence_parallel`` so that ``finalize_model_grads`` all-reduces their gradients over the
    tensor-parallel group. Inside this context the torch norms do the same (a test-only patch of
    ``WrappedTorchNorm``)."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__dict__["__new__"]

    def build(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = original(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = build
    try:
        yield
    finally:
        torch_norm.WrappedTorchNorm.__new__ = original


def synthetic_batches(
    seed: int, n: int, micro_batch_size: int = 2, seq: int = 16, vocab: int = 64
) -> List[Dict[str, torch.Tensor]]:
    """``n`` deterministic micro-batches shaped like Megatron-LM's GPT ``get_batch`` output.

    Each dict holds ``tokens`` / ``labels`` (int64 [b, s], labels = tokens shifted by one),
    ``loss_mask`` (float [b, s], all ones), ``attention_mask`` (bool [1, 1, s, s], True = masked,
    i.e. causal) and ``position_ids`` (int64 [b, s]).  Use a rank-dependent ``seed`` to give every
    data-parallel rank different data.
    """
    g = torch.Generator().manual_seed(seed)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    pos = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(micro_batch_size, seq)
    out = []
    for _ in range(n):
        # A learnable signal: each sequence is an arithmetic progression mod vocab.
        start = torch.randint(0, vocab, (micro_batch_size, 1), generator=g)
        step = torch.randint(1, 4, (micro_batch_size, 1), generator=g)
        seq_tokens = (start + step * torch.arange(seq + 1).unsqueeze(0)) % vocab
        out.append(
            dict(
                tokens=seq_tokens[:, :-1].contiguous(),
                labels=seq_tokens[:, 1:].contiguous(),
                loss_mask=torch.ones(micro_batch_size, seq, dtype=torch.float32),
                attention_mask=causal.clone(),
                position_ids=pos.clone(),
            )
        )
    return out


# Megatron-LM's loss and forward step for the GPT: testing/megatron_gpt.py (shared with the
# functional suite, the demo and the benchmarks).
forward_step_func = forward_step


# ---------------------------------------------------------------------------------------------
# DDP wrappers usable by finalize_model_grads
# ---------------------------------------------------------------------------------------------


class TorchDDPForMegatron(torch.nn.parallel.DistributedDataParallel):
    """torch DDP with the members ``finalize_model_grads`` / the schedule need.

    finalize_model_grads (0.19.2) calls ``model_chunk.finish_grad_sync(force_all_reduce=...)``
    on every chunk, reads ``model_chunk.ddp_config.use_megatron_fsdp`` only on TP>1 / shared-
    embedding-with-PP paths, and calls ``model_chunk.scale_gradients(s)`` only when
    ``calculate_per_token_loss``.  ``get_model_config``/``set_input_tensor`` are found through
    ``.module``.  Gradients are averaged by torch DDP during the last micro-batch's backward
    (earlier ones run inside ``no_sync()``), so ``finish_grad_sync`` has nothing left to do.
    """

    def __init__(self, module, **kwargs):
        from megatron.core.distributed import DistributedDataParallelConfig

        super().__init__(module, **kwargs)
        self.ddp_config = DistributedDataParallelConfig()

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
        pass

    def start_grad_sync(self, *unused):
        pass

    def scale_gradients(self, scaling_factor: float):
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling_factor)

    def zero_grad_buffer(self):
        for p in self.module.parameters():
            p.grad = None


def wrap_megatron_ddp(model, config, **ddp_config_kwargs):
    """Wrap ``model`` in Megatron's own ``DistributedDataParallel`` (needs the CPU patches).

    Default config: no bucketing overlap, ``average_in_collective=False`` (gloo has no AVG:
    grads are pre-scaled by 1/dp and SUM-reduced), grads accumulate in fp32 ``param.main_grad``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


# ---------------------------------------------------------------------------------------------
# Reference training loop
# ---------------------------------------------------------------------------------------------


class TrainResult(NamedTuple):
    losses: List[float]  # per iteration: token-mean loss over all micro-batches and DP ranks
    state_dict: Dict[str, torch.Tensor]  # final unwrapped-model tensors (cloned, CPU)
    local_losses: List[float]  # per iteration: token-mean loss of this rank's micro-batches
    grad_norms: List[Optional[float]]  # per iteration, megatron_* optimizers with clip_grad > 0


def _reduce_lm_loss(forward_data_store, dp_group) -> tuple:
    """Megatron training.py style: sum [loss_sum, num_tokens] over micro-batches, then DP."""
    # on the device the losses live on: NCCL reduces only CUDA tensors (tests/functional/test_moe.py
    # runs this on GPUs)
    device = forward_data_store[0]["lm loss"].device if forward_data_store else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for d in forward_data_store:
        total += d["lm loss"].double()
    local = (total[0] / total[1]).item()
    dist.all_reduce(total, group=dp_group)
    return (total[0] / total[1]).item(), local


def train_reference(
    model,
    config,
    batches: List[Dict[str, torch.Tensor]],
    num_microbatches: int,
    iters: int,
    lr: float,
    *,
    ddp: str = "megatron",
    optimizer: str = "sgd",
    clip_grad: float = 0.0,
    micro_batch_size: Optional[int] = None,
    seq_length: Optional[int] = None,
    weight_decay: float = 0.0,
    adam_eps: Optional[float] = None,
    after_step: Optional[Callable[[], None]] = None,
) -> TrainResult:
    """Train the replicated unwrapped ``model`` with plain data parallelism as the reference.

    Each iteration consumes ``num_microbatches`` of this rank's ``batches`` through
    ``get_forward_backward_func()`` with ``config.finalize_model_grads_func =
    finalize_model_grads`` and ``config.no_sync_func = wrapper.no_sync``, then steps the optimizer:
    ``"sgd"`` / ``"adamw"``: a torch optimizer on the parameters (weight decay 0, no clipping);
    ``"megatron_sgd"`` / ``"megatron_adam"``: ``get_megatron_optimizer`` with
    ``use_distributed_optimizer=False`` (-> ``FP32Optimizer``), ``clip_grad`` and
    ``weight_decay`` (default 0; applied per param group as ``weight_decay * wd_mult`` by a
    constant ``OptimizerParamScheduler``, as Megatron-LM does: Megatron's standard overrides give
    biases and 1-D parameters ``wd_mult=0``) and ``adam_eps`` (default: OptimizerConfig's).

    ``ddp="megatron"``: Megatron's ``DistributedDataParallel`` (fp32 ``param.main_grad`` buffers,
    pre-scale 1/dp + SUM all-reduce in ``finish_grad_sync``); before the step ``param.grad`` is
    pointed at ``param.main_grad`` as Megatron's FP32Optimizer does.
    ``ddp="torch"``: ``TorchDDPForMegatron`` (AVG all-reduce during the last backward).
    Either way: grad = mean over DP of the sum over micro-batches of (loss_mb / num_microbatches).
    Must run inside ``patch_megatron_for_cpu()`` after ``init_megatron_parallel_state``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    assert len(batches) >= iters * num_microbatches, "not enough micro-batches"
    if micro_batch_size is None:
        micro_batch_size = batches[0]["tokens"].shape[0]
    if seq_length is None:
        seq_length = batches[0]["tokens"].shape[1]

    if ddp == "megatron":
        wrapped = wrap_megatron_ddp(model, config)
        use_main_grad = True
    elif ddp == "torch":
        wrapped = TorchDDPForMegatron(model)
        use_main_grad = False
    else:
        raise ValueError(ddp)

    params = [p for p in model.parameters() if p.requires_grad]
    megatron_opt = optimizer.startswith("megatron_")
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    elif megatron_opt:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt_config = OptimizerConfig(
            optimizer=optimizer[len("megatron_") :],
            lr=lr,
            weight_decay=weight_decay,
            clip_grad=clip_grad,
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
            sgd_momentum=0.0,  # OptimizerConfig default is 0.9
            use_distributed_optimizer=False,
        )
        if adam_eps is not None:
            opt_config.adam_eps = adam_eps
        opt = get_megatron_optimizer(opt_config, [wrapped])
        if weight_decay:
            constant_param_scheduler(opt, lr, weight_decay)
    else:
        raise ValueError(optimizer)
    if clip_grad and not megatron_opt:
        raise ValueError("clip_grad needs a megatron_* optimizer")
    if weight_decay and not megatron_opt:
        raise ValueError("weight_decay needs a megatron_* optimizer")

    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_sync_func = None
    config.param_sync_func = None
    forward_backward = get_forward_backward_func()
    dp_group = ps.get_data_parallel_group()

    losses, local_losses = [], []
    model.train()
    grad_norms: List[Optional[float]] = []
    for it in range(iters):
        wrapped.zero_grad_buffer()  # Megatron-LM training.py does this every iteration
        opt.zero_grad(set_to_none=True)
        data = iter(batches[it * num_microbatches : (it + 1) * num_microbatches])
        store = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=data,
            model=[wrapped],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        g, l = _reduce_lm_loss(store, dp_group)
        losses.append(g)
        local_losses.append(l)
        if megatron_opt:
            ok, grad_norm, _ = opt.step()  # FP32Optimizer: param.grad = param.main_grad, clip
            assert ok
            grad_norms.append(None if grad_norm is None else float(grad_norm))
        else:
            if use_main_grad:
                for p in params:
                    p.grad = p.main_grad
            opt.step()
            grad_norms.append(None)
        if after_step is not None:     # e.g. read Megatron's per-iteration MoE auxiliary-loss tracker
            after_step()

    config.no_sync_func = None
    config.finalize_model_grads_func = None
    state = {
        k: v.detach().clone().cpu()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    return TrainResult(losses, state, local_losses, grad_norms)


def constant_param_scheduler(optimizer, lr: float, weight_decay: float):
    """Megatron's ``OptimizerParamScheduler`` with constant lr and weight decay.

    Constructing it sets every param group's ``lr`` and ``weight_decay = weight_decay * wd_mult``
    (what Megatron-LM's training loop relies on for the standard no-weight-decay overrides).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_steps=1 << 30,
        lr_decay_style="constant", start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=1 << 30, wd_incr_style="constant",
    )


def reference_worker(rank: int, world_size: int, spec: Optional[Dict[str, Any]] = None) -> Dict:
    """Ready-made ``run_distributed`` target: build the tiny GPT and ``train_reference`` it.

    ``spec`` keys (defaults): model_seed=1234, data_seed=100 (rank r uses ``data_seed + r``
    unless ``batches`` is given), iters=3, num_microbatches=2, micro_batch_size=2, seq=16,
    vocab=64, lr=0.5, ddp="megatron", optimizer="sgd", clip_grad=0.0, weight_decay=0.0, adam_eps=None,
    batches=None (explicit list of micro-batches for this rank; a list of lists is indexed by rank).
    Returns ``{"result": TrainResult, "init_state": initial state dict}``.
    """
    spec = dict(spec or {})
    seq, vocab = spec.get("seq", 16), spec.get("vocab", 64)
    iters, nmb = spec.get("iters", 3), spec.get("num_microbatches", 2)
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            return _reference_worker_body(rank, spec, seq, vocab, iters, nmb)
        finally:
            destroy_megatron_parallel_state()


def _reference_worker_body(rank, spec, seq, vocab, iters, nmb):
    model, config = build_tiny_gpt(spec.get("model_seed", 1234), vocab=vocab, seq=seq)
    init_state = {
        k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
    }
    batches = spec.get("batches")
    if batches is None:
        batches = synthetic_batches(
            spec.get("data_seed", 100) + rank, iters * nmb, spec.get("micro_batch_size", 2), seq,
            vocab,
        )
    elif isinstance(batches[0], list):
        batches = batches[rank]
    result = train_reference(
        model,
        config,
        batches,
        nmb,
        iters,
        spec.get("lr", 0.5),
        ddp=spec.get("ddp", "megatron"),
        optimizer=spec.get("optimizer", "sgd"),
        clip_grad=spec.get("clip_grad", 0.0),
        weight_decay=spec.get("weight_decay", 0.0),
        adam_eps=spec.get("adam_eps"),
    )
    return {"result": result, "init_state": init_state}


def state_dicts_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], atol=0.0, rtol=0.0):
    """True when both dicts have the same keys and (close) tensors."""
    if a.keys() != b.keys():
        return False
    return all(torch.allclose(a[k], b[k], atol=atol, rtol=rtol) for k in a)


# ---------------------------------------------------------------------------------------------
# Multi-process launcher: the persistent gloo worker pool (tests/dist_pool.py), re-exported
# ---------------------------------------------------------------------------------------------

# ``run_distributed(fn, world_size, *args, timeout=300.0, fresh=False)``: results may contain tensors.
# A pool worker keeps Megatron imported between cases; ``patch_megatron_for_cpu`` is a context
# manager (undone on exit, also when the case raises), and the pool tears down Megatron's parallel
# state / global variables a case left set and retires a worker that still has the patches applied.
from tests.dist_pool import run_distributed  # noqa: E402


def wrap_through_the_launcher(world: int, flags: list, parallel_state_kwargs: Callable, build: Callable):
    """Megatron-LM's argument parsing and validation of the test launcher arguments plus ``flags``
    (``examples/pretrain_gpt.py``), Megatron's parallel state from ``parallel_state_kwargs(args)``,
    then ``get_model``'s wrapping call under the launcher's hook on ``build(args)``'s
    ``(model, config)``. Returns ``(args, chunk)``; the chunk must be ``FullyShardedDataParallel``."""
    import os

    from megatron.training import training

    from examples import pretrain_gpt
    from megatron_fsdp_v2.megatron import FullyShardedDataParallel
    from tests.unit.test_megatron_model_parallel import LAUNCHER_ARGS

    saved_env = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        args = pretrain_gpt.parse_args(LAUNCHER_ARGS + flags)
    finally:
        os.environ.pop("WORLD_SIZE") if saved_env is None else os.environ.__setitem__("WORLD_SIZE", saved_env)
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world, **parallel_state_kwargs(args))
        model, config = build(args)
        with pretrain_gpt.use_fully_sharded_data_parallel():
            (chunk,) = training.wrap_model_chunks_with_ddp([model], config, training.get_megatron_ddp_config(args),
                                                          DP=training.DDP, pg_collection=None, bucket_sizes=[None],
                                                          disable_bucketing_per_chunk=[False])
    assert type(chunk) is FullyShardedDataParallel, type(chunk)
    return args, chunk


@contextlib.contextmanager
def writing_our_earlier_optimizer_layout(optimizer, format_version: int = 2):
    """Within it, ``optimizer``'s leaves (``get_optimizer``'s) save in our own optimizer layout, as
    ``save_dist_checkpoint`` did by default before ``fully_reshardable`` (format 2: state under
    Megatron's stacked keys; format 1: under parameter names, before pipeline parallelism). The
    writer is the reading side's own template (``ShardedOptimizerCheckpoint._our_layout``), which
    the library keeps for loading such checkpoints; its content metadata marks the format."""
    import types

    from megatron_fsdp_v2.checkpoint.state_dict import optimizer_state_dict
    from megatron_fsdp_v2.megatron.checkpoint.dist_checkpoint import FORMAT_KEY, FORMAT_VERSION

    leaves = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])

    def earlier(self, model_sharded_state_dict=None, is_loading=False, sharding_type=None, metadata=None, **unused):
        if metadata is not None:
            metadata.pop("distrib_optim_sharding_type", None)
            metadata[FORMAT_KEY] = FORMAT_VERSION
        return self._our_layout(optimizer_state_dict(self._fsdp_v2_model, self.optimizer))

    for leaf in leaves:
        leaf._fsdp_v2_format = format_version
        leaf.sharded_state_dict = types.MethodType(earlier, leaf)
    try:
        yield
    finally:
        for leaf in leaves:
            del leaf.sharded_state_dict
            leaf.__dict__.pop("_fsdp_v2_format", None)
