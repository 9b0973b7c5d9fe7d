"""Shared machinery of the functional suite: the process group, a Megatron GPT, its data, and the
training loops (Megatron's own DDP as the reference, ours through the Megatron adapter or, when the
adapter is not importable, ``fully_shard`` with a plain loop).

Everything here is imported lazily by the tests (``torch.distributed`` and Megatron work only after
``setup_world()``), so collecting the suite on a machine without CUDA costs nothing and needs no
launcher. Every function that takes a ``World`` must be called on every rank in the same order: the
tests only compare numbers after they have been gathered to every rank, so an assertion fails on all
ranks at once instead of leaving the others waiting in a collective.

CPU smoke mode (``FUNCTIONAL_CPU_SMOKE=1``, for developing the suite without a GPU): gloo, fp32, a
tiny GPT, 3 iterations, Megatron's CUDA-only spots patched by ``megatron_fsdp_v2.megatron.cpu_compat``.
It checks the plumbing of the tests, not the GPU claims (the CUDA-memory and golden checks skip).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from megatron_fsdp_v2 import STRATEGY_NAMES

STRATEGIES = tuple(STRATEGY_NAMES)                 # no_shard, optim, optim_grads, optim_grads_params
REFERENCE = "megatron_ddp"
HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_PATH = os.path.join(HERE, "golden", "losses.json")
LOSS_RTOL = 0.01                                   # "within 1% at every iteration"
MEASURED_FILE = "losses_measured.json"             # written under FUNCTIONAL_RESULTS_DIR by rank 0


def smoke_mode() -> bool:
    return os.environ.get("FUNCTIONAL_CPU_SMOKE", "") == "1"


def _smoke_bf16() -> bool:
    """FUNCTIONAL_CPU_SMOKE_BF16=1: bf16 in smoke mode too (Megatron's bf16 optimizer, i.e. the
    reference, needs CUDA: run only the tests that do not train Megatron DDP)."""
    return os.environ.get("FUNCTIONAL_CPU_SMOKE_BF16", "") == "1"


def results_dir() -> str:
    return os.environ.get("FUNCTIONAL_RESULTS_DIR") or os.path.join(tempfile.gettempdir(),
                                                                   "megatron_fsdp_v2_functional")


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ---------------------------------------------------------------------------------------------
# What is trained
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTSpec:
    """A Megatron ``GPTModel`` (local layer spec) and how it is trained; stored with the goldens."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8
    seq: int = 512
    vocab: int = 4096
    micro_batch_size: int = 2
    micro_batches: int = 4           # k: gradient-accumulation micro-batches per iteration
    iters: int = 50
    lr: float = 3e-4
    adam_beta2: float = 0.95
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    bf16: bool = True
    noise: float = 0.25               # fraction of tokens replaced by random ones (keeps the loss well above 0)
    model_seed: int = 1234
    data_seed: int = 100

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def loss_spec() -> GPTSpec:
    """The loss-curve / determinism model: 4 layers, hidden 512, seq 512, vocab 4096, bf16, k=4, 50 iterations."""
    if smoke_mode():
        return GPTSpec(layers=2, hidden=32, heads=4, seq=16, vocab=64, iters=3, lr=1e-2, bf16=_smoke_bf16())
    return GPTSpec()


def memory_spec() -> GPTSpec:
    """8 layers: ZeRO-2's design bound (root + 2 units of full grads) is below the gradient bytes it
    saves over ZeRO-1 at 2 ranks, so ``ZeRO-2 peak <= ZeRO-1 peak`` is guaranteed from N = 2 on."""
    if smoke_mode():
        return GPTSpec(layers=4, hidden=32, heads=4, seq=16, vocab=64, iters=2, lr=1e-2, bf16=_smoke_bf16())
    return GPTSpec(layers=8, iters=2)


def short_spec() -> GPTSpec:
    """Communication counts and checkpoints: the loss model, a few iterations."""
    return dataclasses.replace(loss_spec(), iters=3)


# ---------------------------------------------------------------------------------------------
# The process group
# ---------------------------------------------------------------------------------------------


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    gpu_name: str
    subgroups: Dict[int, object] = field(default_factory=dict)   # size -> group of ranks [0, size)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


_WORLD: Optional[World] = None
_TEARDOWN = contextlib.ExitStack()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_world() -> World:
    """Join (or create) the process group and initialise Megatron's parallel state. Idempotent.

    Under ``torchrun`` the env:// variables are set; otherwise (plain ``pytest``) a world of one
    process is made from defaults. CUDA: NCCL on ``cuda:LOCAL_RANK``, deterministic algorithms on
    (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set by conftest before CUDA starts)."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    import torch.distributed as dist

    if "RANK" not in os.environ:       # not under torchrun: a world of one, env vars removed at teardown
        defaults = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(_free_port()))
        added = [key for key in defaults if key not in os.environ]
        os.environ.update({key: defaults[key] for key in added})
        _TEARDOWN.callback(lambda: [os.environ.pop(key, None) for key in added])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    smoke = smoke_mode()
    if smoke:
        device, backend, name = torch.device("cpu"), "gloo", "cpu"
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("the functional suite needs CUDA (or FUNCTIONAL_CPU_SMOKE=1)")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        name = torch.cuda.get_device_name(device)
    timeout = datetime.timedelta(seconds=float(os.environ.get("FUNCTIONAL_PG_TIMEOUT_S", "300")))
    created = False
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=timeout)
        if not smoke:
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        created = True
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    _TEARDOWN.callback(torch.use_deterministic_algorithms, previous_deterministic)
    if created:
        _TEARDOWN.callback(dist.destroy_process_group)

    if smoke:
        from megatron_fsdp_v2.megatron.cpu_compat import (destroy_megatron_parallel_state,
                                                          init_megatron_parallel_state,
                                                          patch_megatron_for_cpu)

        _TEARDOWN.enter_context(patch_megatron_for_cpu())
        init_megatron_parallel_state(dist.get_world_size())
        _TEARDOWN.callback(destroy_megatron_parallel_state)
    else:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        _TEARDOWN.callback(ps.destroy_model_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    _WORLD = World(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, name)
    # Subgroups for checkpoint resharding: created collectively, once, by every rank.
    size = _WORLD.size
    while size > 1:
        size //= 2
        _WORLD.subgroups[size] = dist.new_group(list(range(size)))
    return _WORLD


def teardown_world() -> None:
    global _WORLD
    _WORLD = None
    _TEARDOWN.close()


def all_gather_object(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


@contextlib.contextmanager
def shared_tmpdir(world: World):
    """A directory every rank sees (all ranks of a torchrun job share one host)."""
    path = broadcast_object(tempfile.mkdtemp(prefix="mfsdp_functional_") if world.rank == 0 else None)
    try:
        yield path
    finally:
        barrier()
        if world.rank == 0:
            import shutil

            shutil.rmtree(path, ignore_errors=True)


def release_memory(world: World) -> None:
    gc.collect()
    if world.is_cuda:
        torch.cuda.synchronize(world.device)
        torch.cuda.empty_cache()


def reseed(seed: int) -> None:
    """Same initial weights and RNG-tracker states for every run."""
    torch.manual_seed(seed)
    if smoke_mode():
        from megatron_fsdp_v2.megatron.cpu_compat import cpu_model_parallel_manual_seed

        cpu_model_parallel_manual_seed(seed)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------


def transformer_config(spec: GPTSpec):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    return TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        use_cpu_initialization=True,            # init from the CPU RNG: identical on every GPU type
        params_dtype=dtype, pipeline_dtype=dtype, bf16=spec.bf16, fp16=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
        deterministic_mode=True,                # Megatron's embedding lookup without F.embedding's backward
    )


def build_gpt(spec: GPTSpec, world: World):
    """``(module, config, transformer_layer_class)``: the GPT on ``world.device``; with bf16 inside
    ``Float16Module`` (bf16 weights, fp32 logits/loss) exactly as Megatron-LM wraps it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = transformer_config(spec)
    reseed(spec.model_seed)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=spec.vocab,
                   max_sequence_length=spec.seq, pre_process=True, post_process=True, parallel_output=True,
                   share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    gpt = gpt.to(world.device)
    module = Float16Module(config, gpt) if spec.bf16 else gpt
    return module, config, TransformerLayer


_BATCHES: dict = {}


def _token_chain(spec: GPTSpec) -> tuple:
    """The data's fixed Markov chain (same on every rank): Zipf-distributed first tokens and
    ``SUCCESSORS`` Zipf-drawn successors per token."""
    g = torch.Generator().manual_seed(spec.data_seed)
    zipf = 1.0 / torch.arange(1, spec.vocab + 1, dtype=torch.float64) ** 1.1
    zipf = zipf[torch.randperm(spec.vocab, generator=g)]
    successors = torch.multinomial(zipf.float(), spec.vocab * SUCCESSORS, replacement=True, generator=g)
    return zipf.float(), successors.view(spec.vocab, SUCCESSORS)


SUCCESSORS = 4


def batches(spec: GPTSpec, rank: int, world: World, n: Optional[int] = None) -> List[dict]:
    """``n`` (default iters * k) micro-batches of data-parallel rank ``rank``, on the device.

    Token sequences of a fixed Markov chain: a Zipf-distributed first token, then one of 4 fixed
    successors of the current token (the marginal is Zipf-like: learnt in a few steps; the successors
    over the run), with a fraction ``spec.noise`` of tokens replaced by uniform random ones. The loss
    falls from ln(vocab) but stays well above zero, so a 1% relative tolerance means something at
    every iteration."""
    n = spec.iters * spec.micro_batches if n is None else n
    key = (spec, rank, n, str(world.device))
    if key not in _BATCHES:
        first, successors = _token_chain(spec)
        g = torch.Generator().manual_seed(spec.data_seed + 1 + rank)
        b, s, v = spec.micro_batch_size, spec.seq, spec.vocab
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).to(world.device)
        pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous().to(world.device)
        out = []
        for _ in range(n):
            tokens = torch.empty(b, s + 1, dtype=torch.long)
            tokens[:, 0] = torch.multinomial(first, b, replacement=True, generator=g)
            choice = torch.randint(0, SUCCESSORS, (b, s), generator=g)
            noisy = torch.rand(b, s, generator=g) < spec.noise
            random_tokens = torch.randint(0, v, (b, s), generator=g)
            for i in range(s):
                nxt = successors[tokens[:, i], choice[:, i]]
                tokens[:, i + 1] = torch.where(noisy[:, i], random_tokens[:, i], nxt)
            out.append(dict(tokens=tokens[:, :-1].contiguous().to(world.device),
                            labels=tokens[:, 1:].contiguous().to(world.device),
                            loss_mask=torch.ones(b, s, dtype=torch.float32, device=world.device),
                            attention_mask=causal, position_ids=pos))
        _BATCHES[key] = out
    return _BATCHES[key]


def _loss_func(loss_mask, output_tensor):
    """Megatron-LM 0.19 ``pretrain_gpt.loss_func``: (sum of token losses, tokens, report)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _global_mean(loss_sum_and_tokens: torch.Tensor, world: World, group=None) -> float:
    import torch.distributed as dist

    total = loss_sum_and_tokens.to(device=world.device, dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return (total[0] / total[1]).item()


def state_digest(state: dict) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (bitwise identity of two runs)."""
    h = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        if not isinstance(value, torch.Tensor):
            continue
        t = value.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Training: Megatron DDP (reference) and ours
# ---------------------------------------------------------------------------------------------


@dataclass
class Curve:
    losses: List[float]
    grad_norms: List[float]
    digest: str                 # final weights (ours: full fp32 main weights), "" for the reference
    seconds: float
    path: str                   # how it was trained


def adapter_status() -> tuple:
    """(usable, text): is ``megatron_fsdp_v2.megatron.FullyShardedDataParallel`` importable?
    ``FUNCTIONAL_FORCE_FALLBACK=1`` trains ours with ``fully_shard`` + a plain loop regardless."""
    if os.environ.get("FUNCTIONAL_FORCE_FALLBACK", "") == "1":
        return False, "fallback fully_shard + plain loop (FUNCTIONAL_FORCE_FALLBACK=1)"
    try:
        from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import problem means: use the fallback
        return False, f"fallback fully_shard + plain loop (adapter not importable: {type(exc).__name__}: {exc})"
    return True, "megatron_fsdp_v2.megatron.FullyShardedDataParallel + get_optimizer + Megatron schedule"


def _optimizer_config(spec: GPTSpec):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=spec.lr, weight_decay=spec.weight_decay, clip_grad=spec.clip_grad,
                           adam_beta1=0.9, adam_beta2=spec.adam_beta2, adam_eps=1e-8, bf16=spec.bf16, fp16=False,
                           params_dtype=torch.bfloat16 if spec.bf16 else torch.float32,
                           use_distributed_optimizer=False)


def _megatron_schedule_loop(wrapped, config, optimizer, spec: GPTSpec, world: World) -> tuple:
    """Megatron-LM's ``train_step``: zero grad buffers, ``get_forward_backward_func()`` over k
    micro-batches (``finalize_model_grads`` reduces), ``optimizer.step()``; global token-mean loss."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = batches(spec, world.rank, world)
    k = spec.micro_batches
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    losses, norms = [], []
    for it in range(spec.iters):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        store = forward_backward(forward_step_func=_forward_step, data_iterator=iter(data[it * k:(it + 1) * k]),
                                 model=[wrapped], num_microbatches=k, seq_length=spec.seq,
                                 micro_batch_size=spec.micro_batch_size, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"Megatron optimizer step {it} was skipped (update_successful=False)")
        total = torch.zeros(2, dtype=torch.float64, device=world.device)
        for item in store:
            total += item["lm loss"].to(device=world.device, dtype=torch.float64)
        losses.append(_global_mean(total, world, ps.get_data_parallel_group()))
        norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
    config.no_sync_func = None
    config.finalize_model_grads_func = None
    return losses, norms


def train_megatron_ddp(spec: GPTSpec, world: World) -> Curve:
    """The reference: Megatron's own ``DistributedDataParallel`` + ``get_megatron_optimizer`` (bf16:
    ``Float16OptimizerWithFloat16Params``, fp32 master weights, fp32 grad all-reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    start = time.perf_counter()
    module, config, _ = build_gpt(spec, world)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    optimizer = get_megatron_optimizer(_optimizer_config(spec), [wrapped])
    losses, norms = _megatron_schedule_loop(wrapped, config, optimizer, spec, world)
    del wrapped, optimizer, module
    release_memory(world)
    return Curve(losses, norms, "", time.perf_counter() - start, "Megatron DistributedDataParallel")


def train_ours(spec: GPTSpec, world: World, strategy: str) -> Curve:
    usable, text = adapter_status()
    start = time.perf_counter()
    if usable:
        losses, norms, digest = _train_with_adapter(spec, world, strategy)
    else:
        losses, norms, digest = _train_with_fully_shard(spec, world, strategy)
    release_memory(world)
    return Curve(losses, norms, digest, time.perf_counter() - start, text)


def _train_with_adapter(spec: GPTSpec, world: World, strategy: str) -> tuple:
    """Megatron-LM style: ``FullyShardedDataParallel`` (strategy from the ddp config, overlapped grad
    reduce so the schedule runs micro-batches 1..k-1 inside ``no_sync``), ``get_optimizer`` (Adam:
    Megatron's DistributedOptimizer on its ``use_megatron_fsdp`` path), Megatron's schedule."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer

    module, config, _ = build_gpt(spec, world)
    ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=True)
    wrapped = FullyShardedDataParallel(config, ddp_config, module)
    config.no_sync_func = wrapped.no_sync
    optimizer = get_optimizer(_optimizer_config(spec), [wrapped])
    losses, norms = _megatron_schedule_loop(wrapped, config, optimizer, spec, world)
    digest = state_digest(wrapped.state_dict())
    del wrapped, optimizer, module
    return losses, norms, digest


def shard_gpt(spec: GPTSpec, world: World, strategy: str, process_group=None, allocator: str = "storage_freeing"):
    """``fully_shard`` of the GPT (units: every ``TransformerLayer``; bf16 compute, fp32 main weights
    and grads) and a torch AdamW with Megatron's weight-decay rule (no decay for biases and 1-D
    parameters, decided on the original shapes). Returns ``(model, optimizer, info)``."""
    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

    module, _, layer_cls = build_gpt(spec, world)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    info = dict(shapes=shapes, order=[n for n, _ in module.named_parameters(remove_duplicate=False)],
                unit_fqns=[n for n, m in module.named_modules() if isinstance(m, layer_cls)],
                numels={n: p.numel() for n, p in module.named_parameters()})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if spec.bf16 else None
    model = fully_shard(module, sharding_strategy=strategy, process_group=process_group, unit_modules=[layer_cls],
                        mixed_precision=policy, allocator=allocator)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if len(shapes[name]) == 1 or name.endswith(".bias") else decay).append(param)
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=spec.weight_decay),
                                   dict(params=no_decay, weight_decay=0.0)],
                                  lr=spec.lr, betas=(0.9, spec.adam_beta2), eps=1e-8)
    return model, optimizer, info


def plain_step(model, optimizer, micro_batches: List[dict], world: World, *, clip: float = 0.0, group=None,
               phase_hook: Optional[Callable] = None) -> tuple:
    """One iteration without Megatron's schedule: k micro-batches (``no_sync`` for all but the last),
    each loss divided by its token count and by k as the schedule does, optional clipping, step.

    ``phase_hook(i, phase, fn)`` wraps each phase (``forward``, ``backward``, ``step``); returns
    ``(global token-mean loss, grad norm or None)``."""
    k = len(micro_batches)
    run = phase_hook or (lambda i, phase, fn: fn())
    total = torch.zeros(2, dtype=torch.float64, device=world.device)
    for i, batch in enumerate(micro_batches):
        with (model.no_sync() if i < k - 1 else contextlib.nullcontext()):
            output = run(i, "forward", lambda: model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                                     labels=batch["labels"]))
            loss_sum, num_tokens, _ = _loss_func(batch["loss_mask"], output)
            loss = loss_sum / torch.clamp(num_tokens, min=1) / k
            run(i, "backward", loss.backward)
        total += torch.stack([loss_sum.detach().double(), num_tokens.double()])
    norm = model.clip_grad_norm_(clip) if clip else None
    run(k, "step", optimizer.step)
    optimizer.zero_grad(set_to_none=True)
    return _global_mean(total, world, group), (None if norm is None else float(norm))


def _train_with_fully_shard(spec: GPTSpec, world: World, strategy: str) -> tuple:
    model, optimizer, _ = shard_gpt(spec, world, strategy)
    data = batches(spec, world.rank, world)
    k = spec.micro_batches
    losses, norms = [], []
    for it in range(spec.iters):
        loss, norm = plain_step(model, optimizer, data[it * k:(it + 1) * k], world, clip=spec.clip_grad)
        losses.append(loss)
        norms.append(norm)
    digest = state_digest(model.full_state_dict())
    del model, optimizer
    return losses, norms, digest


# ---------------------------------------------------------------------------------------------
# Cached loss curves (shared by the loss, golden and determinism tests) and their record
# ---------------------------------------------------------------------------------------------

_CURVES: Dict[tuple, Curve] = {}


def curve(name: str, world: World, repeat: int = 0) -> Curve:
    """The loss curve of ``name`` (``megatron_ddp`` or a strategy), trained once per ``repeat``."""
    key = (name, repeat)
    if key not in _CURVES:
        spec = loss_spec()
        _CURVES[key] = train_megatron_ddp(spec, world) if name == REFERENCE else train_ours(spec, world, name)
    return _CURVES[key]


def measured_entry() -> dict:
    """This run's first curves in the golden file's format (empty if none were trained)."""
    out = {name: c.losses for (name, repeat), c in sorted(_CURVES.items()) if repeat == 0}
    return out


def golden_meta(world: World) -> dict:
    try:
        import megatron.core as mcore

        mversion = getattr(mcore, "__version__", "?")
    except Exception:  # noqa: BLE001
        mversion = "not importable"
    return dict(spec=loss_spec().as_dict(), torch=torch.__version__, megatron_core=mversion,
                cuda=torch.version.cuda, path=adapter_status()[1], world_size=world.size,
                recorded=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


def write_measured(world: World) -> Optional[str]:
    """Rank 0: ``{gpu: {world size: {name: losses}}}`` under ``results_dir()`` (for regenerate_golden --from)."""
    entry = measured_entry()
    if world.rank != 0 or not entry:
        return None
    os.makedirs(results_dir(), exist_ok=True)
    path = os.path.join(results_dir(), MEASURED_FILE)
    entry["_meta"] = golden_meta(world)
    with open(path, "w") as f:
        json.dump({world.gpu_name: {str(world.size): entry}}, f, indent=1)
    return path


def golden_path() -> str:
    """The golden file the tests read (``FUNCTIONAL_GOLDEN_PATH`` overrides, e.g. to try a new one)."""
    return os.environ.get("FUNCTIONAL_GOLDEN_PATH") or GOLDEN_PATH


def load_golden(path: str = GOLDEN_PATH) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def merge_golden(golden: dict, measured: dict, names=None) -> list:
    """Put every ``{gpu: {world: entry}}`` of ``measured`` into ``golden``; returns what changed."""
    changed = []
    for gpu, per_world in measured.items():
        if gpu.startswith("_"):
            continue
        for world_size, entry in per_world.items():
            keep = {n: v for n, v in entry.items() if names is None or n in names or n == "_meta"}
            old = golden.setdefault(gpu, {}).get(str(world_size), {})
            same_setup = old.get("_meta", {}).get("spec") == keep.get("_meta", {}).get("spec")
            # same model and training setup: update the curves given, keep the others; else replace
            golden[gpu][str(world_size)] = {**old, **keep} if same_setup else keep
            changed.append((gpu, str(world_size), sorted(n for n in keep if not n.startswith("_"))))
    return changed


def save_golden(golden: dict, path: str = GOLDEN_PATH) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def relative_gaps(got: List[float], want: List[float]) -> List[float]:
    return [abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want)]


# ---------------------------------------------------------------------------------------------
# Sizes from docs/design.md, computed independently of the engine
# ---------------------------------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def expected_group_numels(info: dict, dp: int, alignment: int) -> List[int]:
    """Padded element count P of each unit's (single) group, root first then the layers in module
    order: parameters in ``named_parameters`` order, each starting at a multiple of ``alignment``,
    the buffer padded to a multiple of ``dp`` (docs/design.md, "Flat layout and padding")."""
    units = [""] + list(info["unit_fqns"])
    owned: Dict[str, List[str]] = {u: [] for u in units}
    seen = set()
    for name in info["order"]:
        if name in seen or name not in info["numels"]:
            continue
        seen.add(name)
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        owned[owner].append(name)
    out = []
    for unit in units:
        cursor = 0
        for name in owned[unit]:
            cursor = _round_up(cursor, alignment) + info["numels"][name]
        out.append(_round_up(cursor, dp))
    return out


def design_persistent_bytes(strategy: str, padded: List[int], dp: int, c: int, m: int, g: int,
                            aliased: bool) -> dict:
    """docs/design.md "Buffers a rank keeps", summed over groups."""
    P = sum(padded)
    shard = sum(p // dp for p in padded)
    return {
        "no_shard": {"model_weights": 0 if aliased else c * P, "main_weights": m * P, "grads": g * P},
        "optim": {"model_weights": c * P, "main_weights": m * shard, "grads": g * P},
        "optim_grads": {"model_weights": c * P, "main_weights": m * shard, "grads": g * shard},
        "optim_grads_params": {"model_weights": 0, "main_weights": m * shard, "grads": g * shard},
    }[strategy]
