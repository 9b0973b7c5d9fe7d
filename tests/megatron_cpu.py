"""CPU test harness for Megatron-Core 0.19.2 (gloo, several real processes, no GPU).

Lets a tiny ``GPTModel`` (local layer spec, fp32) be built and trained on CPU, driven by
Megatron's own ``get_forward_backward_func()`` schedule and ``finalize_model_grads``.

Megatron hard-codes CUDA in a few places.  ``patch_megatron_for_cpu()`` patches exactly those,
and only inside Megatron modules (never ``torch.cuda`` itself and never package code), so code
under test that hard-codes CUDA still fails on CPU.  See ``patch_megatron_for_cpu`` for the list.

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
import functools
import types
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = [
    "patch_megatron_for_cpu",
    "init_megatron_parallel_state",
    "destroy_megatron_parallel_state",
    "cpu_model_parallel_manual_seed",
    "build_tiny_gpt",
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
]


# ---------------------------------------------------------------------------------------------
# CPU patches
# ---------------------------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch.cuda.current_device() style
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _NullStream:
    """Stands in for a CUDA stream / event: every synchronisation is a no-op on CPU."""

    def wait_event(self, *_a, **_k):
        pass

    def wait_stream(self, *_a, **_k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *_a, **_k):
        return self

    def query(self):
        return True


class _CpuCudaNamespace(types.SimpleNamespace):
    """What ``torch.cuda`` looks like to the patched Megatron modules."""

    def __getattr__(self, name):  # anything not overridden: the real torch.cuda
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"  # only ever used as a ``device=`` argument in the patched modules

    @staticmethod
    def current_stream(*_a, **_k):
        return _NullStream()

    @staticmethod
    def stream(*_a, **_k):
        return contextlib.nullcontext()

    @staticmethod
    def Stream(*_a, **_k):  # noqa: N802 (mirrors torch.cuda.Stream)
        return _NullStream()

    @staticmethod
    def synchronize(*_a, **_k):
        pass

    @staticmethod
    def empty_cache():
        pass


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorchModule(types.ModuleType):
    """Replaces the global name ``torch`` inside selected Megatron modules only.

    Factory functions called with ``device="cuda"`` (or ``torch.cuda.current_device()``)
    allocate on CPU, ``torch.cuda.current_stream()/stream()`` are no-ops; everything else is
    the real ``torch``.
    """

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCudaNamespace()
        for name in self._FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


# Generator that plays the role of the (absent) CUDA default generator for Megatron's
# CudaRNGStatesTracker.  Keeping it separate from the CPU default generator preserves the
# tracker's "CPU RNG state must not change inside fork()" invariant.
_FAKE_CUDA_GENERATOR = torch.Generator(device="cpu")


def _cpu_get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    return _FAKE_CUDA_GENERATOR.get_state()


def _cpu_set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    _FAKE_CUDA_GENERATOR.set_state(new_state)


def _cpu_tracker_add(self, name, seed):
    """CPU version of ``CudaRNGStatesTracker.add`` (random.py: uses torch.cuda.get_rng_state)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception("seed {} already exists".format(seed))
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception("cuda rng state {} already exists".format(name))
    self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()


def _cpu_global_memory_buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """``GlobalMemoryBuffer.get_tensor`` (utils.py) allocating on CPU instead of CUDA."""
    required_len = functools.reduce(lambda a, b: a * b, tensor_shape, 1)
    buf = self.buffer.get((name, dtype), None)
    if buf is None or buf.numel() < required_len:
        buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[0:required_len].view(*tensor_shape)


def _cpu_local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``utils.local_multi_tensor_l2_norm`` returning a CPU tensor (original: device="cuda")."""
    l2 = [[torch.norm(t) for t in tensor_list] for tensor_list in tensor_lists]
    l2_reduced = torch.norm(torch.tensor(l2))
    return torch.tensor([float(l2_reduced)], dtype=torch.float), None


def _make_cpu_clip_grad_by_total_norm_fp32(clip_grads_module):
    """``clip_grads.clip_grad_by_total_norm_fp32`` without its CUDA-only type assertion.

    The original asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``; the CPU copy asserts
    float32 instead and is otherwise identical (runs in clip_grads' namespace).
    """
    cg = clip_grads_module

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        grads = []
        for param in parameters:
            g = param.decoupled_grad if use_decoupled_grad else param.grad
            if g is None:
                continue
            assert g.dtype in (torch.float32, torch.bfloat16) if use_decoupled_grad else (
                g.dtype == torch.float32
            ), g.dtype
            grads.append(cg.to_local_if_dtensor(g).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        dummy_overflow_buf = torch.zeros(1, dtype=torch.int)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff.clamp_max_(1.0)
            assert cg.multi_tensor_scale_tensor_impl is not None
            cg.multi_tensor_applier(
                cg.multi_tensor_scale_tensor_impl, dummy_overflow_buf, [grads, grads], clip_coeff
            )
        elif clip_coeff < 1.0:
            cg.multi_tensor_applier(
                cg.multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff
            )

    return clip_grad_by_total_norm_fp32


class _Patcher:
    def __init__(self):
        self._undo: List[Callable[[], None]] = []

    def setattr(self, obj, name, value):
        missing = object()
        old = obj.__dict__.get(name, missing) if hasattr(obj, "__dict__") else getattr(obj, name)

        def undo():
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self._undo.append(undo)

    def undo(self):
        while self._undo:
            self._undo.pop()()


# Megatron modules whose global ``torch`` is replaced by ``_CpuTorchModule``, and why.
_MODULES_WITH_CPU_TORCH = {
    # forward_backward_no_pipelining: total_num_tokens = torch.zeros([], ..., device="cuda")
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens on cuda",
    # _ParamAndGradBuffer: grad_data/param_data on torch.cuda.current_device();
    # _ParamAndGradBucketGroup.start_grad_sync: torch.cuda.current_stream()
    "megatron.core.distributed.param_and_grad_buffer": "Megatron DDP buffers",
    # MixedPrecisionOptimizer/FP32Optimizer: found_inf, _dummy_overflow_buf, _scale on 'cuda'
    "megatron.core.optimizer.optimizer": "Megatron optimizer scalars",
    # get_grad_norm_fp32 / count_zeros_fp32: total_norm etc. on 'cuda'
    "megatron.core.optimizer.clip_grads": "grad-norm accumulators",
}


@contextlib.contextmanager
def patch_megatron_for_cpu():
    """Context manager applying the minimal CPU patches to Megatron-Core 0.19.2.

    Patches (all undone on exit):
      1. ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates on CPU
         (DotProductAttention's baddbmm buffer uses ``torch.cuda.current_device()``).
      2. ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``
         and ``CudaRNGStatesTracker.add`` use a dedicated CPU ``torch.Generator`` standing in
         for the CUDA default generator (``tracker.fork()`` is entered by attention and
         embeddings even with dropout 0; ``model_parallel_cuda_manual_seed`` calls ``add``).
      3. The global name ``torch`` inside ``pipeline_parallel.schedules`` (``total_num_tokens``),
         ``distributed.param_and_grad_buffer`` (Megatron DDP grad buffers, streams),
         ``optimizer.optimizer`` and ``optimizer.clip_grads`` (scalar tensors on 'cuda') becomes a
         shim mapping ``device="cuda"`` factories and
         ``torch.cuda.current_device()/current_stream()/stream()`` to CPU / no-ops.
      4. ``clip_grad_by_total_norm_fp32`` (asserts ``grad.type() == 'torch.cuda.FloatTensor'``)
         is replaced in ``clip_grads`` and ``optimizer.optimizer`` by a copy asserting float32;
         ``clip_grads.l2_norm_impl`` (the no-TE/no-apex fallback allocates on 'cuda') by a CPU copy.
      Building/running the model and the schedule needs 1, 2 and the ``schedules`` shim; the
      other shims and 4 are for Megatron DDP and Megatron optimizers (``FP32Optimizer``,
      ``ChainedOptimizer`` grad norm, clipping).  The shims live in Megatron module globals only,
      so package code imported from those modules' functions would see them too.
      Not covered: ``DistributedOptimizer`` on the non-FSDP path (``param.type()`` checks for
      ``torch.cuda.*Tensor`` in distrib_optimizer.py) and pipeline-parallel p2p.

    ``torch.cuda`` itself is never patched, so package code that hard-codes CUDA still fails.
    """
    import importlib

    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.utils as mutils

    p = _Patcher()
    try:
        p.setattr(mutils.GlobalMemoryBuffer, "get_tensor", _cpu_global_memory_buffer_get_tensor)
        p.setattr(mrandom, "_get_cuda_rng_state", _cpu_get_cuda_rng_state)
        p.setattr(mrandom, "_set_cuda_rng_state", _cpu_set_cuda_rng_state)
        p.setattr(mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add)
        shim = _CpuTorchModule()
        for modname in _MODULES_WITH_CPU_TORCH:
            mod = importlib.import_module(modname)
            p.setattr(mod, "torch", shim)
        # Optimizer grad clipping (optimizer.py imported the function by name).
        import megatron.core.optimizer.clip_grads as mclip
        import megatron.core.optimizer.optimizer as mopt

        cpu_clip = _make_cpu_clip_grad_by_total_norm_fp32(mclip)
        p.setattr(mclip, "clip_grad_by_total_norm_fp32", cpu_clip)
        p.setattr(mopt, "clip_grad_by_total_norm_fp32", cpu_clip)
        if mclip.l2_norm_impl is mutils.local_multi_tensor_l2_norm:  # no TE / apex installed
            p.setattr(mclip, "l2_norm_impl", _cpu_local_multi_tensor_l2_norm)
        yield
    finally:
        p.undo()


# ---------------------------------------------------------------------------------------------
# Parallel state
# ---------------------------------------------------------------------------------------------


def cpu_model_parallel_manual_seed(seed: int) -> None:
    """CPU replacement for ``tensor_parallel.model_parallel_cuda_manual_seed``.

    Seeds the CPU default generator with ``seed`` and registers Megatron's RNG-tracker states
    (``model_parallel_cuda_manual_seed`` itself works under ``patch_megatron_for_cpu`` too;
    its ``torch.cuda.manual_seed`` is lazily queued and never executed without a GPU).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_megatron_parallel_state(world_size: Optional[int] = None, seed: int = 1234, **kwargs):
    """Initialise Megatron's parallel_state on top of an existing gloo default group.

    ``initialize_model_parallel(1, 1)`` works unchanged on gloo (DP group = all ranks).
    Must be called inside ``patch_megatron_for_cpu()`` (the RNG seeding uses patch 2).
    Extra kwargs go to ``initialize_model_parallel``.
    """
    from megatron.core import parallel_state as ps

    assert dist.is_initialized(), "call torch.distributed.init_process_group('gloo') first"
    if world_size is not None:
        assert dist.get_world_size() == world_size
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    kwargs.setdefault("tensor_model_parallel_size", 1)
    kwargs.setdefault("pipeline_model_parallel_size", 1)
    ps.initialize_model_parallel(**kwargs)
    cpu_model_parallel_manual_seed(seed)


def destroy_megatron_parallel_state():
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


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
    **config_overrides,
):
    """Build a tiny fp32 ``GPTModel`` with the local (non-TE) layer spec on CPU.

    Initialisation depends only on ``seed`` (CPU RNG, ``use_cpu_initialization=True``), so it is
    identical on every rank.  Dropout is 0 so that training is deterministic.  Returns
    ``(model, config)``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg_kwargs = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    cfg_kwargs.update(config_overrides)
    config = TransformerConfig(**cfg_kwargs)

    cpu_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=vocab,
            max_sequence_length=seq,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
        )
    finally:
        torch.set_rng_state(cpu_state)
    return model, config


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


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM 0.19 ``pretrain_gpt.loss_func`` convention (3-tuple).

    Returns ``(sum of masked token losses, num_tokens, {"lm loss": [loss_sum, num_tokens]})``.
    The schedule (``forward_step_calc_loss``) then divides by ``num_tokens`` and by
    ``num_microbatches`` before backward, i.e. the optimised objective is the per-token mean.
    """
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step_func(data_iterator: Iterator[Dict[str, torch.Tensor]], model):
    """``forward_step_func`` for ``get_forward_backward_func()``: returns ``(output, loss_fn)``.

    ``model`` may be the bare GPTModel or any wrapper forwarding ``__call__`` to it.
    """
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )  # GPTModel returns per-token losses [b, s] when labels are given
    return output, functools.partial(loss_func, batch["loss_mask"])


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
    total = torch.zeros(2, dtype=torch.float64)
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
) -> TrainResult:
    """Train the replicated unwrapped ``model`` with plain data parallelism as the reference.

    Each iteration consumes ``num_microbatches`` of this rank's ``batches`` through
    ``get_forward_backward_func()`` with ``config.finalize_model_grads_func =
    finalize_model_grads`` and ``config.no_sync_func = wrapper.no_sync``, then steps the optimizer:
    ``"sgd"`` / ``"adamw"``: a torch optimizer on the parameters (weight decay 0, no clipping);
    ``"megatron_sgd"`` / ``"megatron_adam"``: ``get_megatron_optimizer`` with
    ``use_distributed_optimizer=False`` (-> ``FP32Optimizer``), weight decay 0, ``clip_grad``.

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
            weight_decay=0.0,
            clip_grad=clip_grad,
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
            sgd_momentum=0.0,  # OptimizerConfig default is 0.9
            use_distributed_optimizer=False,
        )
        opt = get_megatron_optimizer(opt_config, [wrapped])
    else:
        raise ValueError(optimizer)
    if clip_grad and not megatron_opt:
        raise ValueError("clip_grad needs a megatron_* optimizer")

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

    config.no_sync_func = None
    config.finalize_model_grads_func = None
    state = {
        k: v.detach().clone().cpu()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    return TrainResult(losses, state, local_losses, grad_norms)


def reference_worker(rank: int, world_size: int, spec: Optional[Dict[str, Any]] = None) -> Dict:
    """Ready-made ``run_distributed`` target: build the tiny GPT and ``train_reference`` it.

    ``spec`` keys (defaults): model_seed=1234, data_seed=100 (rank r uses ``data_seed + r``
    unless ``batches`` is given), iters=3, num_microbatches=2, micro_batch_size=2, seq=16,
    vocab=64, lr=0.5, ddp="megatron", optimizer="sgd", clip_grad=0.0, batches=None (explicit
    list of micro-batches for this rank; a list of lists is indexed by rank).
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
    )
    return {"result": result, "init_state": init_state}


def state_dicts_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], atol=0.0, rtol=0.0):
    """True when both dicts have the same keys and (close) tensors."""
    if a.keys() != b.keys():
        return False
    return all(torch.allclose(a[k], b[k], atol=atol, rtol=rtol) for k in a)


# ---------------------------------------------------------------------------------------------
# Multi-process launcher (reuses tests/unit/dist_utils.py)
# ---------------------------------------------------------------------------------------------


class _SerializedResult:
    """Picklable wrapper: runs ``fn`` and returns its result as ``torch.save`` bytes.

    dist_utils passes results back through a ``multiprocessing.Manager`` dict; serialising
    first keeps tensors / NamedTuples out of the manager process (no shared-memory handles, no
    need for the manager to import this module).
    """

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, rank, world_size, *args):
        import io

        result = self.fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        return buf.getvalue()


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 300.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo (CPU) ranks.

    Thin layer over ``tests/unit/dist_utils.run_distributed`` (spawned processes, default gloo
    group through a file rendezvous, ``torch.set_num_threads(1)``, a worker's exception re-raised
    in the parent as ``RuntimeError`` with its traceback).  Results may contain tensors.
    ``fn`` must be importable at module level (e.g. ``reference_worker``).
    """
    import io

    try:
        from .unit.dist_utils import run_distributed as _run
    except ImportError:  # imported as a top-level module with tests/ on sys.path
        from unit.dist_utils import run_distributed as _run

    raw = _run(_SerializedResult(fn), world_size, *args, timeout=timeout)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in raw]
