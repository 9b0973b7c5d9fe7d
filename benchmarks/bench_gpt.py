#!/usr/bin/env python3
"""Benchmark megatron_fsdp_v2 against an unwrapped floor, PyTorch FSDP2 and Megatron's own
data-parallel wrappers on a Megatron-Core ``GPTModel`` (local layer spec, bf16 compute).

Every system runs in ONE process, one after the other (build, warm up, time, free), so ratios
between systems are measured on the same GPU, allocator and library versions::

    python benchmarks/bench_gpt.py                          # ~940M-parameter GPT, 1 GPU, all systems
    python benchmarks/bench_gpt.py --fake-world-size 8      # same, each system as rank 0 of 8 (memory)
    python benchmarks/bench_gpt.py --small --systems ours   # quick smoke run
    python benchmarks/bench_gpt.py --nproc 8                # relaunch under torchrun, 8 GPUs, NCCL
    python benchmarks/bench_gpt.py --device cpu --small --systems ours,floor,fsdp2 --steps 2 --warmup 1

A step is forward + backward of one micro-batch, the optimizer step and ``zero_grad``. Reported
per system: median step time over ``--steps`` timed steps (after ``--warmup`` untimed ones),
tokens/s, peak ``torch.cuda.max_memory_allocated`` during training, and the memory a rank keeps
between steps (after ``optimizer.step()``, and after ``zero_grad``) next to the ZeRO formula.
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:          # megatron_fsdp_v2 from this checkout
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T_START = time.perf_counter()
GIB = float(1 << 30)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ALLOCATORS = ("storage_freeing", "trace_pool")
ALLOC_SHORT = {"storage_freeing": "sf", "trace_pool": "tp"}
ZERO_NAME = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}


# =============================================================================================
# Systems
# =============================================================================================


@dataclass(frozen=True)
class System:
    name: str
    kind: str                       # floor | ours | fsdp2 | megatron_ddp | megatron_fsdp
    strategy: Optional[str] = None  # ours / megatron_fsdp: Megatron's sharding-strategy name
    allocator: Optional[str] = None # ours
    reshard_after_forward: Optional[bool] = None  # fsdp2

    @property
    def cuda_only(self) -> bool:
        return self.kind in ("megatron_ddp", "megatron_fsdp")

    @property
    def description(self) -> str:
        if self.kind == "floor":
            return "unwrapped fp32 model, autocast(bf16), fused AdamW"
        if self.kind == "ours":
            return f"fully_shard({self.strategy}, allocator={self.allocator}) = {ZERO_NAME[self.strategy]}"
        if self.kind == "fsdp2":
            return (f"torch FSDP2 fully_shard, reshard_after_forward={self.reshard_after_forward} "
                    f"({'ZeRO-3' if self.reshard_after_forward else 'ZeRO-3, no reshard after fwd'})")
        if self.kind == "megatron_ddp":
            return "Megatron DDP + distributed optimizer (bf16 params, fp32 grads) = ZeRO-1"
        return f"Megatron-FSDP v1, {self.strategy} = {ZERO_NAME[self.strategy]}"


def all_systems() -> List[System]:
    systems = [System("floor", "floor")]
    for s in STRATEGIES:
        for a in ALLOCATORS:
            systems.append(System(f"ours-{s}-{ALLOC_SHORT[a]}", "ours", strategy=s, allocator=a))
    systems.append(System("fsdp2-zero3", "fsdp2", reshard_after_forward=True))
    systems.append(System("fsdp2-no_reshard", "fsdp2", reshard_after_forward=False))
    systems.append(System("megatron_ddp", "megatron_ddp", strategy="optim"))
    for s in ("optim", "optim_grads", "optim_grads_params"):
        systems.append(System(f"megatron_fsdp-{s}", "megatron_fsdp", strategy=s))
    return systems


def select_systems(spec: str) -> List[System]:
    """``all``, or a comma list of names, kinds/prefixes (``ours``, ``ours-optim``, ``fsdp2``,
    ``megatron``, ``megatron_fsdp``) and ``ours-<strategy>-<sf|tp>`` names."""
    everything = all_systems()
    if spec.strip() in ("", "all"):
        return everything
    chosen: List[System] = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        if token == "all":
            matches = everything
        elif token == "megatron":
            matches = [s for s in everything if s.kind in ("megatron_ddp", "megatron_fsdp")]
        else:
            matches = [s for s in everything
                       if s.name == token or s.kind == token or s.name.startswith(token + "-")]
        if not matches:
            names = ", ".join(s.name for s in everything)
            raise SystemExit(f"--systems: unknown system {token!r}; choose from all, ours, fsdp2, megatron, "
                             f"megatron_fsdp or: {names}")
        for s in matches:
            if s not in chosen:
                chosen.append(s)
    order = {s.name: i for i, s in enumerate(everything)}
    return sorted(chosen, key=lambda s: order[s.name])   # floor first, always the same order


# =============================================================================================
# ZeRO formula: bytes per parameter a rank keeps between steps
# =============================================================================================


def expected_state(system: System, n: int) -> Dict[str, Any]:
    """Model-state bytes/param right after ``optimizer.step()`` (weights, main weights, grads,
    Adam state), per docs/design.md: bf16 weights 2, fp32 main 4, fp32 grads 4, Adam 8."""
    if system.kind == "floor":
        # fp32 weights are the main weights; zero_grad(set_to_none) frees the grads.
        return dict(formula="4+4+8 (fp32 w+g, Adam)", after_step=16.0, after_zero_grad=12.0)
    if system.kind == "fsdp2":
        v = 16.0 / n
        return dict(formula="(4+4+8)/N", after_step=v, after_zero_grad=12.0 / n)
    strategy = system.strategy
    if strategy == "no_shard":
        return dict(formula="2+4+4+8", after_step=18.0, after_zero_grad=18.0)
    if strategy == "optim":
        v = 2 + 4 + 12.0 / n
        return dict(formula="2+4+(4+8)/N", after_step=v, after_zero_grad=v)
    if strategy == "optim_grads":
        v = 2 + 16.0 / n
        return dict(formula="2+(4+4+8)/N", after_step=v, after_zero_grad=v)
    v = 16.0 / n
    return dict(formula="(4+4+8)/N", after_step=v, after_zero_grad=v)


# =============================================================================================
# Distributed setup
# =============================================================================================


@dataclass
class Ctx:
    args: argparse.Namespace
    device: torch.device
    rank: int
    world: int          # data-parallel size the systems see (fake or real)
    real_world: int     # processes actually running
    fake: bool
    tokens: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    num_params: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, *a, **k) -> None:
        if self.rank == 0:
            print(*a, **k, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(args) -> Ctx:
    device_type = args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible (use --device cpu for a CPU dry run).")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    if args.fake_world_size and args.fake_world_size > 0:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise SystemExit("--fake-world-size cannot be combined with --nproc/torchrun.")
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
        return Ctx(args, device, 0, args.fake_world_size, 1, True)

    backend = "nccl" if device_type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:          # torchrun
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return Ctx(args, device, dist.get_rank(), dist.get_world_size(), dist.get_world_size(), False)


def init_megatron(ctx: Ctx, stack: contextlib.ExitStack) -> None:
    """``initialize_model_parallel(1, 1)`` (TP = PP = 1: the whole world is data parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ctx.is_cuda:
        # Megatron hard-codes CUDA in a few places a GPTModel forward runs through (RNG tracker,
        # attention's global buffer): the test harness patches exactly those, CPU runs only.
        from megatron_fsdp_v2.megatron.cpu_compat import patch_megatron_for_cpu

        stack.enter_context(patch_megatron_for_cpu())
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 create_gloo_process_groups=False)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def make_batch(ctx: Ctx) -> None:
    a = ctx.args
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    seq_tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g)
    ctx.tokens = seq_tokens[:, :-1].contiguous().to(ctx.device)
    ctx.labels = seq_tokens[:, 1:].contiguous().to(ctx.device)
    ctx.position_ids = torch.arange(a.seq, device=ctx.device).unsqueeze(0).expand(a.micro_batch, a.seq).contiguous()
    if ctx.is_cuda:
        ctx.attention_mask = None   # local spec, causal: Megatron builds the mask on CUDA itself
    else:
        # get_default_causal_mask() is CUDA-only; pass the same mask explicitly (True = masked).
        ctx.attention_mask = torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), diagonal=1).view(1, 1, a.seq, a.seq)


def prewarm_global_buffer(ctx: Ctx) -> None:
    """Local-spec attention writes its scores into Megatron's process-wide GlobalMemoryBuffer
    (b*heads x s x s, compute dtype), which lives until exit. Allocate it once up front so the
    first system is not charged for it; it is excluded from every memory number below."""
    from megatron.core import parallel_state as ps

    a = ctx.args
    ps.get_global_memory_buffer().get_tensor((a.micro_batch * a.heads, a.seq, a.seq), torch.bfloat16, "mpu")


def global_buffer_bytes() -> int:
    try:
        from megatron.core import parallel_state as ps

        buf = ps.get_global_memory_buffer()
    except Exception:
        return 0
    total = 0
    for t in buf.buffer.values():
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            total += t.numel() * t.element_size()
    return total


# =============================================================================================
# Model
# =============================================================================================


def build_gpt(ctx: Ctx, params_dtype: torch.dtype, bf16: bool = True):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = ctx.args
    config = TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        ffn_hidden_size=a.ffn or 4 * a.hidden,
        # Build straight on the GPU: CPU initialisation of ~1B parameters takes minutes.
        use_cpu_initialization=not ctx.is_cuda,
        perform_initialization=not a.skip_init,
        params_dtype=params_dtype,
        bf16=bf16,                      # same attention-softmax precision for every system
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # No TE/apex on the benchmark box: keep every kernel plain PyTorch, for every system alike.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    torch.manual_seed(1234)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=a.vocab,
        max_sequence_length=a.seq,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    # A few torch.nn modules (position embedding, norms) are created on CPU whatever the flag.
    model = model.to(ctx.device)
    return model, config


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# =============================================================================================
# One built system: what a step does and what to measure
# =============================================================================================


@dataclass
class Built:
    fwd_bwd: Callable[[], torch.Tensor]
    opt_step: Callable[[], None]
    zero_grad: Callable[[], None]
    keep: List[Any]                                   # everything to drop afterwards
    persistent_bytes: Optional[Callable[[], dict]] = None
    comm_stats: Optional[Callable[[], dict]] = None
    reset_comm_stats: Optional[Callable[[], None]] = None
    optimizer_state_bytes: Optional[Callable[[], int]] = None
    accounted_state_bytes: Optional[Callable[[], int]] = None   # from the tensors themselves
    notes: List[str] = field(default_factory=list)


def _tensor_bytes(t) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    local = getattr(t, "_local_tensor", None)   # DTensor
    if local is not None:
        t = local
    return t.numel() * t.element_size()


def torch_optimizer_state_bytes(optimizers) -> int:
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                total += _tensor_bytes(v)
    return total


def params_grads_optimizer_bytes(model: torch.nn.Module, optimizers) -> int:
    """Storage bytes of the parameters and gradients (local shards of DTensors, each storage
    counted once) plus the optimizer state: what an unwrapped model or FSDP2 keeps."""
    seen, total = set(), 0
    for p in model.parameters():
        for t in (p, p.grad):
            if t is None:
                continue
            t = getattr(t, "_local_tensor", t)
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total + torch_optimizer_state_bytes(optimizers)


def inner_torch_optimizers(opt) -> list:
    """The torch optimizers inside a Megatron optimizer (Chained / Distributed / Float16)."""
    if isinstance(opt, torch.optim.Optimizer):
        return [opt]
    out = []
    for child in getattr(opt, "chained_optimizers", None) or []:
        out.extend(inner_torch_optimizers(child))
    inner = getattr(opt, "optimizer", None)
    if inner is not None and not getattr(opt, "chained_optimizers", None):
        out.extend(inner_torch_optimizers(inner))
    return out


def release_autograd_hooks(*objects) -> None:
    """Break the reference cycles that run through autograd hooks held by C++, which the garbage
    collector cannot see: a post-accumulate-grad hook (ours, Megatron-FSDP) or an AccumulateGrad
    node hook (Megatron DDP) whose closure holds the wrapper keeps the whole model, and its GPU
    memory, alive after the last Python reference is gone. Called once a system is finished."""
    params, seen = [], set()

    def add(t):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            params.append(t)

    for obj in objects:
        if not isinstance(obj, torch.nn.Module):
            continue
        for module in obj.modules():
            for t in module._parameters.values():
                add(t)
            for name in ("raw_param",):               # Megatron-FSDP swaps params in and out
                for t in (getattr(module, name, None) or {}).values():
                    add(t)
            engine = module.__dict__.get("_fsdp")        # ours: hooks on the original params
            for group in getattr(engine, "groups", []) or []:
                for t in group.params:
                    add(t)
            for handle in (getattr(module, "grad_acc_hooks", None) or {}).values():
                with contextlib.suppress(Exception):
                    handle.remove()
            grad_accs = getattr(module, "grad_accs", None)   # Megatron DDP: AccumulateGrad nodes
            if isinstance(grad_accs, list):
                grad_accs.clear()
    for t in params:
        hooks = getattr(t, "_post_accumulate_grad_hooks", None)
        if isinstance(hooks, dict):
            hooks.clear()


def release_leftover_models() -> None:
    """After a failure mid-build the half-built model is no longer referenced from Python but may
    still be pinned by hook cycles: find such modules and release them too."""
    gc.collect()
    leftovers = [o for o in gc.get_objects()
                 if isinstance(o, torch.nn.Module)
                 and (type(o).__name__ == "GPTModel" or "_fsdp" in o.__dict__
                      or hasattr(o, "grad_accs") or hasattr(o, "grad_acc_hooks"))]
    release_autograd_hooks(*leftovers)
    del leftovers


def _fused_ok(ctx: Ctx) -> bool:
    return ctx.is_cuda or ctx.args.cpu_fused_adam


def _forward_loss(ctx: Ctx, model) -> torch.Tensor:
    out = model(ctx.tokens, ctx.position_ids, ctx.attention_mask, labels=ctx.labels)
    return out.mean()


def build_floor(ctx: Ctx, system: System) -> Built:
    model, _ = build_gpt(ctx, torch.float32, bf16=ctx.is_cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=_fused_ok(ctx))
    # On CPU the floor runs in plain fp32: Megatron's linear layers re-enter autocast in backward
    # through torch.amp.custom_bwd(device_type="cuda") only, so CPU autocast breaks their backward.
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if ctx.is_cuda else contextlib.nullcontext())

    def fwd_bwd():
        with autocast:
            loss = _forward_loss(ctx, model)
        loss.backward()
        return loss.detach()

    return Built(fwd_bwd, opt.step, lambda: opt.zero_grad(set_to_none=True), [model, opt],
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes([opt]),
                 accounted_state_bytes=lambda: params_grads_optimizer_bytes(model, [opt]))


def build_ours(ctx: Ctx, system: System) -> Built:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

    gpt, _ = build_gpt(ctx, torch.float32)
    model = fully_shard(gpt, sharding_strategy=system.strategy, unit_modules=[TransformerLayer],
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                        allocator=system.allocator)
    del gpt
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=_fused_ok(ctx))

    def fwd_bwd():
        loss = _forward_loss(ctx, model)
        loss.backward()
        return loss.detach()

    return Built(fwd_bwd, opt.step, lambda: opt.zero_grad(set_to_none=True), [model, opt],
                 persistent_bytes=model.persistent_bytes, comm_stats=model.comm_stats,
                 reset_comm_stats=model.reset_comm_stats,
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes([opt]),
                 accounted_state_bytes=lambda: model.persistent_bytes()["total"] + torch_optimizer_state_bytes([opt]))


def build_fsdp2(ctx: Ctx, system: System) -> Built:
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model, _ = build_gpt(ctx, torch.float32)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raf = bool(system.reshard_after_forward)
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            torch_fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    torch_fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=_fused_ok(ctx))

    def fwd_bwd():
        loss = _forward_loss(ctx, model)
        loss.backward()
        return loss.detach()

    return Built(fwd_bwd, opt.step, lambda: opt.zero_grad(set_to_none=True), [model, opt, mesh],
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes([opt]),
                 accounted_state_bytes=lambda: params_grads_optimizer_bytes(model, [opt]))


def _megatron_optimizer(ctx: Ctx, chunk, notes: List[str]):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=ctx.args.lr,
        weight_decay=0.01,                 # torch AdamW's default, as for the other systems
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=0.0,                     # the other systems do not clip either
    )
    opt = get_megatron_optimizer(config, [chunk], use_gloo_process_groups=False)
    inner = inner_torch_optimizers(opt)
    if ctx.args.megatron_adam == "fused":
        # Without TE/apex Megatron falls back to torch.optim.AdamW with its default (foreach)
        # kernel; switch the groups to the fused kernel every other system uses.
        switched = 0
        for o in inner:
            if isinstance(o, torch.optim.Adam) or isinstance(o, torch.optim.AdamW):
                for group in o.param_groups:
                    group["fused"] = True
                    group["foreach"] = False
                switched += 1
        notes.append(f"inner optimizer(s): {', '.join(type(o).__module__ + '.' + type(o).__name__ for o in inner)}"
                     f"{' -> fused' if switched else ''}")
    else:
        notes.append(f"inner optimizer(s): {', '.join(type(o).__name__ for o in inner)} (default kernel)")
    return opt, inner


def build_megatron_ddp(ctx: Ctx, system: System) -> Built:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    # As megatron.training.get_model does with --bf16: bf16 params, Float16Module, then DDP.
    gpt, config = build_gpt(ctx, torch.bfloat16)
    model = Float16Module(config, gpt)
    overlap = bool(ctx.args.megatron_overlap)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,          # Megatron-LM's default with --bf16
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    notes: List[str] = [f"overlap_grad_reduce=overlap_param_gather={overlap}"]
    opt, inner = _megatron_optimizer(ctx, ddp, notes)

    def fwd_bwd():
        loss = _forward_loss(ctx, ddp)
        loss.backward()
        ddp.finish_grad_sync()
        return loss.detach()

    def zero_grad():                        # megatron.training.train_step, start of each step
        ddp.zero_grad_buffer()
        opt.zero_grad()

    return Built(fwd_bwd, opt.step, zero_grad, [ddp, opt, inner, model, gpt],
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes(inner), notes=notes)


def _einops_rearrange_lite(tensor: torch.Tensor, pattern: str, **sizes) -> torch.Tensor:
    """``einops.rearrange`` for plain permute/merge/split patterns such as
    ``"(dp_cp ep tp) -> ep dp_cp tp"`` (no ellipsis, no anonymous axes)."""
    def groups(side: str) -> List[List[str]]:
        out, current = [], None
        for token in side.replace("(", " ( ").replace(")", " ) ").split():
            if token == "(":
                current = []
            elif token == ")":
                out.append(current)
                current = None
            elif current is not None:
                current.append(token)
            else:
                out.append([token])
        return out

    left, right = (groups(side) for side in pattern.split("->"))
    if len(left) != tensor.dim():
        raise ValueError(f"rearrange: pattern {pattern!r} does not match a {tensor.dim()}-d tensor")
    known = dict(sizes)
    for group, dim in zip(left, tensor.shape):
        unknown = [a for a in group if a not in known]
        product = math.prod(known[a] for a in group if a in known)
        if len(unknown) > 1:
            raise ValueError(f"rearrange: cannot infer sizes of {unknown} in {pattern!r}")
        if unknown:
            known[unknown[0]] = dim // product
    axes = [a for g in left for a in g]
    x = tensor.reshape([known[a] for a in axes])
    x = x.permute([axes.index(a) for g in right for a in g])
    return x.reshape([math.prod(known[a] for a in g) for g in right])


def ensure_einops_for_megatron_fsdp(notes: List[str]) -> None:
    """Megatron-FSDP's adapter needs einops only to lay out the rank mesh; megatron-core is
    installed without dependencies on the benchmark box, so stand in for it when it is missing."""
    try:
        import einops  # noqa: F401
        return
    except ImportError:
        pass
    import types

    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    import megatron.core.distributed.fsdp.src.megatron_fsdp.utils as fsdp_utils

    lite = types.SimpleNamespace(rearrange=_einops_rearrange_lite)
    for module in (adapter, fsdp_utils):
        module.einops = lite
        module.HAVE_EINOPS = True
    notes.append("einops not installed: its rank-mesh rearrange replaced by a stand-in (bench_gpt.py)")


def build_megatron_fsdp(ctx: Ctx, system: System) -> Built:
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.transformer.module import Float16Module

    notes: List[str] = []
    ensure_einops_for_megatron_fsdp(notes)
    gpt, config = build_gpt(ctx, torch.bfloat16)
    model = Float16Module(config, gpt)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        use_distributed_optimizer=True,
        data_parallel_sharding_strategy=system.strategy,
        # Megatron-FSDP forces both on for optim_grads(_params); Megatron-LM's recommended flags.
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        megatron_fsdp_main_params_dtype=torch.float32,
        megatron_fsdp_main_grads_dtype=torch.float32,   # fp32 grads, as every other system here
    )
    fsdp = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # With one micro-batch per step the schedule never enters no_sync(), so Megatron-FSDP's
    # `is_last_microbatch` stays unset and optim (ZeRO-1) would never reduce its gradients.
    fsdp.module.is_last_microbatch = True
    opt, inner = _megatron_optimizer(ctx, fsdp, notes)

    def fwd_bwd():
        loss = _forward_loss(ctx, fsdp)
        loss.backward()
        fsdp.finish_grad_sync()
        return loss.detach()

    def zero_grad():
        fsdp.zero_grad_buffer()
        opt.zero_grad()

    return Built(fwd_bwd, opt.step, zero_grad, [fsdp, opt, inner, model, gpt],
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes(inner), notes=notes)


BUILDERS = {
    "floor": build_floor,
    "ours": build_ours,
    "fsdp2": build_fsdp2,
    "megatron_ddp": build_megatron_ddp,
    "megatron_fsdp": build_megatron_fsdp,
}


# =============================================================================================
# Running one system
# =============================================================================================


def sync(ctx: Ctx) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def allocated(ctx: Ctx) -> Optional[int]:
    """Bytes allocated by tensors, without Megatron's process-wide attention buffer."""
    if not ctx.is_cuda:
        return None
    return torch.cuda.memory_allocated(ctx.device) - global_buffer_bytes()


def cleanup(ctx: Ctx) -> None:
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)


def _is_oom(exc: BaseException) -> bool:
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    return isinstance(exc, oom_types) or "out of memory" in str(exc).lower()


def run_system(ctx: Ctx, system: System) -> Dict[str, Any]:
    a = ctx.args
    res: Dict[str, Any] = dict(name=system.name, kind=system.kind, strategy=system.strategy,
                               allocator=system.allocator, description=system.description, status="ok",
                               error=None, notes=[])
    exp = expected_state(system, ctx.world)
    res.update(expected_formula=exp["formula"], expected_bytes_per_param=exp["after_step"],
               expected_bytes_per_param_after_zero_grad=exp["after_zero_grad"])
    if ctx.num_params:
        res["expected_state_gib"] = exp["after_step"] * ctx.num_params / GIB
        res["expected_state_after_zero_grad_gib"] = exp["after_zero_grad"] * ctx.num_params / GIB
    if system.cuda_only and not ctx.is_cuda:
        res.update(status="skipped", error="CUDA-only (Megatron DDP/FSDP); skipped on CPU")
        return res

    cleanup(ctx)
    baseline = allocated(ctx)
    built: Optional[Built] = None
    try:
        t0 = time.perf_counter()
        built = BUILDERS[system.kind](ctx, system)
        sync(ctx)
        res["build_s"] = time.perf_counter() - t0
        res["notes"].extend(built.notes)
        if ctx.is_cuda:
            res["build_peak_gib"] = (torch.cuda.max_memory_allocated(ctx.device) - baseline) / GIB
            torch.cuda.reset_peak_memory_stats(ctx.device)

        losses = []
        # Warm-up; the memory a rank keeps between steps is read on the last warm-up step.
        for i in range(a.warmup):
            loss = built.fwd_bwd()
            built.opt_step()
            if i == a.warmup - 1:
                sync(ctx)
                after_step = allocated(ctx)
                if built.accounted_state_bytes is not None:
                    res["accounted_state_gib"] = built.accounted_state_bytes() / GIB
            built.zero_grad()
            losses.append(loss)
        sync(ctx)
        after_zero = allocated(ctx)
        if ctx.is_cuda:
            res["state_gib"] = (after_step - baseline) / GIB
            res["state_after_zero_grad_gib"] = (after_zero - baseline) / GIB
            if ctx.num_params:
                res["state_bytes_per_param"] = (after_step - baseline) / ctx.num_params
                exp_bytes = exp["after_step"] * ctx.num_params
                res["deviation_pct"] = 100.0 * ((after_step - baseline) - exp_bytes) / exp_bytes
        if not ctx.is_cuda and ctx.num_params and res.get("accounted_state_gib") is not None:
            exp_bytes = exp["after_step"] * ctx.num_params
            res["deviation_pct"] = 100.0 * (res["accounted_state_gib"] * GIB - exp_bytes) / exp_bytes
            res["deviation_from"] = "accounted"
        if built.persistent_bytes is not None:
            res["persistent_bytes"] = built.persistent_bytes()
        if built.optimizer_state_bytes is not None:
            res["optimizer_state_gib"] = built.optimizer_state_bytes() / GIB
        if built.reset_comm_stats is not None:
            built.reset_comm_stats()

        times = []
        for _ in range(a.steps):
            sync(ctx)
            t = time.perf_counter()
            loss = built.fwd_bwd()
            built.opt_step()
            built.zero_grad()
            sync(ctx)
            times.append(time.perf_counter() - t)
            losses.append(loss)
        if ctx.is_cuda:
            res["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / GIB
            res["peak_over_baseline_gib"] = (torch.cuda.max_memory_allocated(ctx.device) - baseline) / GIB
        if built.comm_stats is not None and a.steps:
            stats = built.comm_stats()
            res["comm_bytes_per_step"] = stats["total_bytes"] / a.steps
            res["comm_calls_per_step"] = {k: v["count"] / a.steps for k, v in stats.items()
                                          if isinstance(v, dict)}
        res["step_s_all"] = times
        if times:
            med = statistics.median(times)
            res["step_ms"] = 1000.0 * med
            res["step_ms_mean"] = 1000.0 * statistics.fmean(times)
            res["tokens_per_s"] = a.micro_batch * a.seq * ctx.real_world / med
        res["losses"] = [float(x) for x in losses]
        res["loss_last"] = res["losses"][-1] if losses else None
    except Exception as exc:  # noqa: BLE001 -- one failing system must not end the run
        if _is_oom(exc):
            res.update(status="OOM", error=f"OOM: {str(exc).splitlines()[0][:300]}")
        else:
            res.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            res["traceback"] = traceback.format_exc()
            if ctx.rank == 0:
                traceback.print_exc()
    finally:
        if built is not None:
            release_autograd_hooks(*built.keep)
            built.keep.clear()
        built = None
        release_leftover_models()
        cleanup(ctx)
        if ctx.is_cuda:
            res["leaked_gib"] = (allocated(ctx) - baseline) / GIB
            if res["leaked_gib"] > 0.01:
                res["notes"].append(f"{res['leaked_gib']:.2f} GiB still allocated after the system was freed")
    return res


# =============================================================================================
# Reporting
# =============================================================================================


def _fmt(v, spec=".2f", none="-"):
    if v is None:
        return none
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return format(v, spec)


def formula_table(n: int, num_params: int) -> str:
    lines = [
        f"ZeRO model-state formula per rank (bytes/param; bf16 weights 2, fp32 main 4, fp32 grads 4, Adam 8; N = {n}, "
        f"P = {num_params / 1e6:.1f}M):",
        "",
        "| strategy | formula | bytes/param | GiB at P |",
        "|---|---|---:|---:|",
    ]
    for s in STRATEGIES:
        e = expected_state(System(s, "ours", strategy=s), n)
        lines.append(f"| {s} ({ZERO_NAME[s]}) | {e['formula']} | {e['after_step']:.2f} | "
                     f"{e['after_step'] * num_params / GIB:.3f} |")
    e = expected_state(System("floor", "floor"), n)
    lines.append(f"| floor (fp32 weights, autocast) | {e['formula']} | {e['after_step']:.2f} | "
                 f"{e['after_step'] * num_params / GIB:.3f} |")
    return "\n".join(lines)


def results_markdown(meta: Dict[str, Any], results: List[Dict[str, Any]]) -> str:
    floor = next((r for r in results if r["name"] == "floor" and r.get("step_ms")), None)
    mode = (f"fake process group, rank 0 of {meta['world']} (collectives are no-ops: times exclude communication)"
            if meta["fake"] else f"{meta['real_world']} process(es), {meta['backend']}")
    out = [
        f"### GPTModel {meta['num_params'] / 1e6:.1f}M params: {meta['layers']} layers, hidden {meta['hidden']}, "
        f"{meta['heads']} heads, seq {meta['seq']}, micro-batch {meta['micro_batch']}, vocab {meta['vocab']}",
        "",
        f"- mode: {mode}; device: {meta['device_name']}",
        f"- torch {meta['torch']}, megatron-core {meta['megatron_core']}, python {meta['python']}; {meta['date']}",
        f"- step = forward + backward (one micro-batch) + optimizer step + zero_grad; median of {meta['steps']} "
        f"steps after {meta['warmup']} warm-up steps; tokens/s = {meta['micro_batch']}x{meta['seq']}"
        f"{'x' + str(meta['real_world']) if meta['real_world'] > 1 else ''} / median step",
        "- peak = torch.cuda.max_memory_allocated over the warm-up and timed steps (absolute: includes the "
        "token batch and Megatron's shared attention-score buffer); state = memory_allocated after "
        "optimizer.step() minus the pre-build baseline "
        "(Megatron's shared attention buffer excluded), on the last warm-up step; "
        "'after zero_grad' = the same after zero_grad(set_to_none=True)",
        "",
        "- accounted = the same state added up from the tensors (ours: persistent_bytes() + optimizer "
        "state; floor/FSDP2: parameter and gradient storages + optimizer state); dev % = state vs the "
        "ZeRO formula (on CPU, where nothing is measured: accounted vs formula)",
        "",
        "| system | status | step ms | tokens/s | step / floor | peak GiB | state GiB | after zero_grad GiB | "
        "accounted GiB | ZeRO formula | expected GiB | dev % | ours persistent GiB | comm GB/step | build s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    g = ".2f" if meta["num_params"] >= 1e8 else ".4f"   # GiB digits
    for r in results:
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r.get('error') or ''}"
        status = status.replace("|", "/").replace("\n", " ")
        ratio = (f"{r['step_ms'] / floor['step_ms']:.2f}x" if floor and r.get("step_ms") else "-")
        pb = r.get("persistent_bytes")
        comm = r.get("comm_bytes_per_step")
        out.append(
            f"| {r['name']} | {status} | {_fmt(r.get('step_ms'), '.1f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{ratio} | {_fmt(r.get('peak_gib'), g)} | {_fmt(r.get('state_gib'), g)} | "
            f"{_fmt(r.get('state_after_zero_grad_gib'), g)} | {_fmt(r.get('accounted_state_gib'), g)} | "
            f"{r['expected_formula']} | "
            f"{_fmt(r.get('expected_state_gib'), g)} | {_fmt(r.get('deviation_pct'), '+.1f')} | "
            f"{_fmt(pb['total'] / GIB, g) if pb else '-'} | {_fmt(comm / 1e9, '.3f') if comm is not None else '-'} | "
            f"{_fmt(r.get('build_s'), '.1f')} |")
    out += ["", formula_table(meta["world"], meta["num_params"]), ""]
    notes = [f"- {r['name']}: {'; '.join(r['notes'])}" for r in results if r.get("notes")]
    notes += [f"- {n}" for n in meta.get("notes", [])]
    if notes:
        out += ["Notes:", ""] + notes + [""]
    return "\n".join(out)


# =============================================================================================
# Main
# =============================================================================================


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (defaults: the ~940M-parameter GPT)")
    g.add_argument("--layers", type=int, default=None, help="transformer layers (default 16; --small: 2)")
    g.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; --small: 256)")
    g.add_argument("--heads", type=int, default=None, help="attention heads (default 16; --small: 4)")
    g.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 x hidden)")
    g.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; --small: 256)")
    g.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default 4; --small: 2)")
    g.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 32000; --small: 4096)")
    g.add_argument("--small", action="store_true", help="smoke preset: 2 layers, hidden 256, 4 heads, seq 256, "
                   "micro-batch 2, vocab 4096 (explicit flags still win)")
    g.add_argument("--skip-init", action="store_true", help="perform_initialization=False (faster build, "
                   "uninitialised weights)")
    g = p.add_argument_group("run")
    g.add_argument("--systems", default="all", help="'all' (default) or a comma list of names / prefixes: floor, ours, "
                   "ours-<strategy>, ours-<strategy>-<sf|tp>, fsdp2, fsdp2-zero3, fsdp2-no_reshard, megatron, "
                   "megatron_ddp, megatron_fsdp, megatron_fsdp-<strategy>")
    g.add_argument("--list-systems", action="store_true", help="print the system names and exit")
    g.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    g.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps, >= 1 (default 3)")
    g.add_argument("--lr", type=float, default=1e-5, help="learning rate of every optimizer (default 1e-5)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="default cuda; cpu: dry run on gloo (Megatron DDP/FSDP skipped, floor without autocast)")
    g.add_argument("--fake-world-size", type=int, default=0, help="run each system as rank 0 of an N-way job on "
                   "torch's fake process group (collectives are no-ops) to measure per-rank memory (default 0 = off)")
    g.add_argument("--nproc", type=int, default=1, help="GPUs: relaunch under torchrun --nproc-per-node N, NCCL (default 1)")
    g.add_argument("--megatron-overlap", type=int, choices=(0, 1), default=1,
                   help="Megatron DDP: overlap_grad_reduce and overlap_param_gather (default 1)")
    g.add_argument("--megatron-adam", choices=("fused", "default"), default="fused",
                   help="kernel of Megatron's torch AdamW fallback (no TE/apex): fused like the other systems, "
                   "or torch's default (foreach) (default fused)")
    g.add_argument("--cpu-fused-adam", action="store_true", help="use fused AdamW on CPU too")
    g.add_argument("--time-budget", type=float, default=0.0, help="seconds since start after which the "
                   "remaining systems are skipped (reported as such), e.g. 540 under a 600 s limit (default 0 = none)")
    g.add_argument("--verbose", action="store_true", help="keep Megatron's log messages and warnings")
    g = p.add_argument_group("output (rank 0 only)")
    g.add_argument("--out", default=None, help="markdown table (default docs/benchmarks_results<SUFFIX>.md, SUFFIX = "
                   "'' / _fake<N> / _<N>gpu by mode; '' = do not write)")
    g.add_argument("--json", default=None, help="JSON results for plot.py (default docs/benchmarks_results<SUFFIX>.json; "
                   "'' = skip)")
    g.add_argument("--png", default=None, help="bar chart (default docs/benchmarks<SUFFIX>.png; needs matplotlib; "
                   "'' = skip)")
    args = p.parse_args(argv)

    small = dict(layers=2, hidden=256, heads=4, seq=256, micro_batch=2, vocab=4096, steps=20, warmup=3)
    full = dict(layers=16, hidden=2048, heads=16, seq=2048, micro_batch=4, vocab=32000, steps=20, warmup=3)
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (memory is read on the last warm-up step)")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.hidden % args.heads:
        p.error("--hidden must be divisible by --heads")
    suffix = (f"_fake{args.fake_world_size}" if args.fake_world_size
              else f"_{args.nproc}gpu" if args.nproc > 1 else "")
    if args.out is None:
        args.out = f"docs/benchmarks_results{suffix}.md"
    if args.json is None:
        args.json = f"docs/benchmarks_results{suffix}.json"
    if args.png is None:
        args.png = f"docs/benchmarks{suffix}.png"
    return args


def relaunch_under_torchrun(args) -> None:
    if args.nproc <= 1 or "WORLD_SIZE" in os.environ:
        return
    if args.fake_world_size:
        raise SystemExit("--nproc and --fake-world-size are exclusive.")
    forwarded, skip = [], False
    for arg in sys.argv[1:]:            # drop --nproc: torchrun would take it for its own option
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            forwarded.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve())] + forwarded
    print("relaunching:", " ".join(cmd), flush=True)
    os.execv(sys.executable, cmd)


def quiet_libraries(verbose: bool) -> None:
    if verbose:
        return
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def write_outputs(ctx: Ctx, meta, results, final: bool = True) -> None:
    """Markdown + JSON (rewritten after every system, so a run cut short still leaves its
    results), and at the end the PNG."""
    a = ctx.args
    meta = dict(meta, complete=final)
    md = results_markdown(meta, results)
    if not final:
        md = "<!-- partial: the run has not finished -->\n" + md
    if final:
        print("\n" + md, flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w") as f:
            f.write(md + "\n")
        if final:
            print(f"wrote {a.out}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        slim = [{k: v for k, v in r.items() if k != "traceback"} for r in results]
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": slim}, f, indent=1)
        if final:
            print(f"wrote {a.json}")
    if a.png and final:
        try:
            import importlib.util

            spec = importlib.util.spec_from_file_location("bench_plot", HERE / "plot.py")
            plot = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(plot)
            Path(a.png).parent.mkdir(parents=True, exist_ok=True)
            plot.make_png([{"meta": meta, "results": results}], a.png)
            print(f"wrote {a.png}")
        except ImportError as exc:
            print(f"no PNG ({exc}); make it elsewhere: python benchmarks/plot.py {a.json or '<results.json>'} "
                  f"--png {a.png}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_systems:
        for s in all_systems():
            print(f"{s.name:36s} {s.description}")
        return 0
    relaunch_under_torchrun(args)
    quiet_libraries(args.verbose)
    systems = select_systems(args.systems)

    ctx = init_distributed(args)
    with contextlib.ExitStack() as stack:
        init_megatron(ctx, stack)
        make_batch(ctx)
        if ctx.is_cuda:
            prewarm_global_buffer(ctx)
        # Parameter count from a throw-away build on the meta-free path (cheap: freed at once).
        probe, _ = build_gpt(ctx, torch.bfloat16 if ctx.is_cuda else torch.float32)
        ctx.num_params = count_params(probe)
        del probe
        cleanup(ctx)

        from importlib.metadata import PackageNotFoundError, version
        try:
            mcore_version = version("megatron-core")
        except PackageNotFoundError:
            import megatron.core as _mc
            mcore_version = getattr(_mc, "__version__", "?")
        meta = dict(
            layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn or 4 * args.hidden,
            seq=args.seq, micro_batch=args.micro_batch, vocab=args.vocab, steps=args.steps,
            warmup=args.warmup, num_params=ctx.num_params, world=ctx.world, real_world=ctx.real_world,
            fake=ctx.fake, backend=dist.get_backend(), device=str(ctx.device),
            device_name=(torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else platform.processor() or "cpu"),
            torch=torch.__version__, megatron_core=mcore_version, python=platform.python_version(),
            date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), systems=[s.name for s in systems],
            notes=[],
        )
        ctx.log(f"GPTModel {ctx.num_params / 1e6:.1f}M params; {len(systems)} systems; world {ctx.world}"
                f"{' (fake)' if ctx.fake else ''}; device {meta['device_name']}")
        results = []
        t_all = time.perf_counter()
        for system in systems:
            elapsed = time.perf_counter() - T_START
            if args.time_budget and elapsed > args.time_budget:
                r = dict(name=system.name, kind=system.kind, strategy=system.strategy, allocator=system.allocator,
                         description=system.description, status="skipped", notes=[],
                         error=f"--time-budget {args.time_budget:.0f} s used up ({elapsed:.0f} s)",
                         expected_formula=expected_state(system, ctx.world)["formula"])
            else:
                ctx.log(f"--> {system.name}: {system.description}")
                r = run_system(ctx, system)
            results.append(r)
            ctx.log(f"    {r['status']}"
                    + (f"  step {r['step_ms']:.1f} ms  peak {_fmt(r.get('peak_gib'))} GiB  "
                       f"state {_fmt(r.get('state_gib'))} GiB  loss {_fmt(r.get('loss_last'), '.3f')}  "
                       f"[{time.perf_counter() - T_START:.0f} s]"
                       if r.get("step_ms") else f"  {r.get('error')}"))
            if ctx.rank == 0:
                meta["total_s"] = time.perf_counter() - t_all
                write_outputs(ctx, meta, results, final=False)
        meta["total_s"] = time.perf_counter() - t_all
        meta["wall_s"] = time.perf_counter() - T_START
        if ctx.rank == 0:
            write_outputs(ctx, meta, results)
            print(f"systems {meta['total_s']:.0f} s, process {meta['wall_s']:.0f} s")

        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
