"""The systems bench_gpt.py compares: the table of systems (floor, ours per strategy and
allocator, PyTorch FSDP2, Megatron DDP and Megatron-FSDP v1), the ZeRO formula each should meet,
one builder per kind that returns what a step does and what to measure, the memory accounting
from the tensors themselves, and the release of the autograd-hook cycles that would keep a
finished system's memory alive.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bench_setup import Ctx, build_gpt

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
    reduce_root_per_child: bool = False             # ours: fully_shard(reduce_root_per_child=True)
    offload: Optional[float] = None   # ours: OffloadPolicy(fraction); fsdp2: CPUOffloadPolicy (1.0);
                                      # megatron_ddp: --optimizer-cpu-offload --optimizer-offload-fraction
    step_in_backward: bool = False    # ours with offload: OffloadPolicy(step_in_backward=True)
    release_after_gather: bool = False  # ours with offload: OffloadPolicy(release_after_gather=True)

    @property
    def cuda_only(self) -> bool:     # (FSDP2's CPUOffloadPolicy pins memory: needs a GPU)
        return self.kind in ("megatron_ddp", "megatron_fsdp") or (self.kind == "fsdp2" and bool(self.offload))

    @property
    def description(self) -> str:
        if self.kind == "floor":
            return "unwrapped fp32 model, autocast(bf16), fused AdamW"
        if self.kind == "ours":
            split = ", reduce_root_per_child=True" if self.reduce_root_per_child else ""
            sib = ", step_in_backward=True" if self.step_in_backward else ""
            sib += ", release_after_gather=True" if self.release_after_gather else ""
            off = f", offload=OffloadPolicy(fraction={self.offload:g}{sib})" if self.offload is not None else ""
            return f"fully_shard({self.strategy}, allocator={self.allocator}{split}{off}) = {ZERO_NAME[self.strategy]}"
        if self.kind == "ours_search":
            return ("ours ZeRO-3 with offload at the smallest fraction on the --offload-search grid that trains "
                    "(a binary search; every run a row)")
        if self.kind == "fsdp2" and self.offload:
            return "torch FSDP2 fully_shard, offload_policy=CPUOffloadPolicy(pin_memory=True) (ZeRO-3, step on CPU)"
        if self.kind == "megatron_ddp" and self.offload is not None:
            return (f"Megatron DDP + distributed optimizer, --optimizer-cpu-offload --optimizer-offload-fraction "
                    f"{self.offload:g} --overlap-cpu-optimizer-d2h-h2d (HybridDeviceOptimizer)")
        if self.kind == "fsdp2":
            return (f"torch FSDP2 fully_shard, reshard_after_forward={self.reshard_after_forward} "
                    f"({'ZeRO-3' if self.reshard_after_forward else 'ZeRO-3, no reshard after fwd'})")
        if self.kind == "megatron_ddp":
            return "Megatron DDP + distributed optimizer (bf16 params, fp32 grads) = ZeRO-1"
        return f"Megatron-FSDP v1, {self.strategy} = {ZERO_NAME[self.strategy]}"


def ours_offload(fraction: float, step_in_backward: bool = True, release_after_gather: bool = False) -> System:
    """``ours-offload<f>``, or ``ours-offload<f>-release`` with the compute shards released after
    their gathers."""
    suffix = "-release" if release_after_gather else ""
    return System(f"ours-offload{fraction:g}{suffix}", "ours", strategy="optim_grads_params",
                  allocator="storage_freeing", offload=fraction, step_in_backward=step_in_backward,
                  release_after_gather=release_after_gather, reduce_root_per_child=OFFLOAD_OPTIONS["root_per_child"])


def release_variants() -> Tuple[bool, ...]:
    """``--offload-release-after-gather``: 0 keeps the compute shards, 1 releases them, ``both``
    runs each fraction both ways, side by side."""
    return {"0": (False,), "1": (True,), "both": (False, True)}[OFFLOAD_OPTIONS["release_after_gather"]]


# bench_gpt's --offload-step-in-backward and --offload-search (set before the systems are listed)
OFFLOAD_OPTIONS: Dict[str, Any] = dict(step_in_backward=True, search_step=0.0, step_threads=None,
                                       release_after_gather="0", root_per_child=False)


def offload_systems(fractions=(1.0,)) -> List[System]:
    """CPU offload, side by side (``--systems offload``): ours ZeRO-3 at each fraction, FSDP2 with
    ``CPUOffloadPolicy``, Megatron DDP with ``--optimizer-cpu-offload`` (fraction 1), then the search
    for ours' smallest fraction that fits (``ours-offload-min``, run by bench_offload.py)."""
    out = [ours_offload(f, OFFLOAD_OPTIONS["step_in_backward"], release)
           for f in fractions for release in release_variants()]
    out.append(System("fsdp2-cpu_offload", "fsdp2", reshard_after_forward=True, offload=1.0))
    out.append(System("megatron_ddp-cpu_offload", "megatron_ddp", strategy="optim", offload=1.0))
    if OFFLOAD_OPTIONS["search_step"]:
        out.append(System("ours-offload-min", "ours_search", strategy="optim_grads_params", offload=-1.0,
                          step_in_backward=OFFLOAD_OPTIONS["step_in_backward"],
                          release_after_gather=release_variants()[-1]))
    return out


def all_systems(offload_fractions=()) -> List[System]:
    """Every system; the offload ones only for ``offload_fractions`` (bench_gpt ``--offload-fractions``)."""
    systems = [System("floor", "floor")]
    for s in STRATEGIES:
        for a in ALLOCATORS:
            systems.append(System(f"ours-{s}-{ALLOC_SHORT[a]}", "ours", strategy=s, allocator=a))
    systems.append(System("ours-optim_grads_params-sf-rootsplit", "ours", strategy="optim_grads_params",
                          allocator="storage_freeing", reduce_root_per_child=True))
    systems.append(System("fsdp2-zero3", "fsdp2", reshard_after_forward=True))
    systems.append(System("fsdp2-no_reshard", "fsdp2", reshard_after_forward=False))
    systems.append(System("megatron_ddp", "megatron_ddp", strategy="optim"))
    for s in ("optim", "optim_grads", "optim_grads_params"):
        systems.append(System(f"megatron_fsdp-{s}", "megatron_fsdp", strategy=s))
    wanted = offload_fractions or OFFLOAD_OPTIONS["search_step"]
    return systems + (offload_systems(offload_fractions) if wanted else [])


def select_systems(spec: str, offload_fractions=()) -> List[System]:
    """``all``, or a comma list of names, kinds/prefixes (``ours``, ``ours-optim``, ``fsdp2``,
    ``megatron``, ``megatron_fsdp``) and ``ours-<strategy>-<sf|tp>`` names."""
    everything = all_systems(offload_fractions)
    offloading = [s for s in everything if s.offload is not None]
    if spec.strip() in ("", "all"):
        return [s for s in everything if s.offload is None]
    chosen: List[System] = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        if token == "all":
            matches = [s for s in everything if s.offload is None]
        elif token == "offload":
            matches = offloading
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
    if system.offload is not None:       # device bytes only: what stays on the GPU
        f = max(system.offload, 0.0)
        if system.kind == "fsdp2":
            return dict(formula="0 (all on CPU)", after_step=0.0, after_zero_grad=0.0)
        if system.kind == "megatron_ddp":
            v = 2 + 4 + (1 - f) * 12.0 / n
            return dict(formula="2+4+(1-f)(4+8)/N", after_step=v, after_zero_grad=v)
        v = (1 - f) * 16.0 / n + f * 2.0 / n
        return dict(formula="(1-f)(4+4+8)/N + f*2/N", after_step=v, after_zero_grad=(1 - f) * 12.0 / n + f * 2.0 / n)
    if system.kind == "fsdp2":
        v = 16.0 / n
        return dict(formula="(4+4+8)/N", after_step=v, after_zero_grad=12.0 / n)
    # ours: zero_grad(set_to_none=True) frees the gradient buffers (they live as long as .grad)
    strategy = system.strategy
    if strategy == "no_shard":
        return dict(formula="2+4+4+8", after_step=18.0, after_zero_grad=14.0)
    if strategy == "optim":
        v = 2 + 4 + 12.0 / n
        return dict(formula="2+4+(4+8)/N", after_step=v, after_zero_grad=2 + 12.0 / n)
    if strategy == "optim_grads":
        v = 2 + 16.0 / n
        return dict(formula="2+(4+4+8)/N", after_step=v, after_zero_grad=2 + 12.0 / n)
    v = 16.0 / n
    return dict(formula="(4+4+8)/N", after_step=v, after_zero_grad=12.0 / n)



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


def device_bytes(tensors) -> int:
    """Bytes of the tensors (DTensors: local pieces) that live on an accelerator, not on the host."""
    return sum(_tensor_bytes(t) for t in tensors
               if isinstance(t, torch.Tensor) and getattr(t, "_local_tensor", t).device.type != "cpu")


def device_optimizer_state_bytes(optimizers) -> int:
    return device_bytes(v for opt in optimizers for state in opt.state.values() for v in state.values())


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
            engine = module.__dict__.get("_fsdp_engine")        # ours: hooks on the original params
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
                 and (type(o).__name__ == "GPTModel" or "_fsdp_engine" in o.__dict__
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

    from megatron_fsdp_v2 import OffloadPolicy

    gpt, _ = build_gpt(ctx, torch.float32)
    offload = (OffloadPolicy(fraction=system.offload, pin_memory=True, step_in_backward=system.step_in_backward,
                             step_threads=OFFLOAD_OPTIONS["step_threads"] if system.step_in_backward else None,
                             release_after_gather=system.release_after_gather)
               if system.offload is not None else None)
    model = fully_shard(gpt, sharding_strategy=system.strategy, unit_modules=[TransformerLayer],
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                        allocator=system.allocator, reduce_root_per_child=system.reduce_root_per_child,
                        offload=offload)
    del gpt
    # fused: torch's fused AdamW per device, the CPU kernel for offloaded (host) main weights
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=_fused_ok(ctx) or offload is not None)

    def fwd_bwd():
        loss = _forward_loss(ctx, model)
        loss.backward()
        return loss.detach()

    return Built(fwd_bwd, opt.step, lambda: opt.zero_grad(set_to_none=True), [model, opt],
                 persistent_bytes=model.persistent_bytes, comm_stats=model.comm_stats,
                 reset_comm_stats=model.reset_comm_stats,
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes([opt]),
                 accounted_state_bytes=lambda: model.persistent_bytes()["total"] + device_optimizer_state_bytes([opt]))


def build_fsdp2(ctx: Ctx, system: System) -> Built:
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model, _ = build_gpt(ctx, torch.float32)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raf = bool(system.reshard_after_forward)
    off = CPUOffloadPolicy(pin_memory=True) if system.offload else OffloadPolicy()
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            torch_fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=raf, offload_policy=off)
    torch_fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf, offload_policy=off)
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=_fused_ok(ctx) or bool(system.offload))

    def fwd_bwd():
        loss = _forward_loss(ctx, model)
        loss.backward()
        return loss.detach()

    return Built(fwd_bwd, opt.step, lambda: opt.zero_grad(set_to_none=True), [model, opt, mesh],
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes([opt]),
                 accounted_state_bytes=lambda: params_grads_optimizer_bytes(model, [opt]))


def _megatron_optimizer(ctx: Ctx, chunk, notes: List[str], offload: Optional[float] = None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # --optimizer-cpu-offload: Megatron's HybridDeviceOptimizer (its validation demands
    # --use-precision-aware-optimizer with it)
    offload_fields = (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=offload,
                           overlap_cpu_optimizer_d2h_h2d=True, use_precision_aware_optimizer=True)
                      if offload is not None else {})
    config = OptimizerConfig(
        **offload_fields,
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
    if offload is not None:
        notes.append(f"HybridDeviceOptimizer, offload fraction {offload:g}: {type(opt).__name__}")
    elif ctx.args.megatron_adam == "fused":
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
    return _built_megatron_wrapper(ctx, ddp, model, gpt, notes, offload=system.offload)


def _built_megatron_wrapper(ctx, wrapper, model, gpt, notes: List[str], offload: Optional[float] = None) -> "Built":
    """A step of Megatron's loop on a DDP-like wrapper (Megatron DDP or Megatron-FSDP): zero the
    grad buffer and the optimizer, forward + backward, ``finish_grad_sync``, ``optimizer.step``."""
    opt, inner = _megatron_optimizer(ctx, wrapper, notes, offload)

    def fwd_bwd():
        loss = _forward_loss(ctx, wrapper)
        loss.backward()
        wrapper.finish_grad_sync()
        return loss.detach()

    def zero_grad():                        # megatron.training.train_step, start of each step
        wrapper.zero_grad_buffer()
        opt.zero_grad()

    return Built(fwd_bwd, opt.step, zero_grad, [wrapper, opt, inner, model, gpt],
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
    return _built_megatron_wrapper(ctx, fsdp, model, gpt, notes)


BUILDERS = {
    "floor": build_floor,
    "ours": build_ours,
    "fsdp2": build_fsdp2,
    "megatron_ddp": build_megatron_ddp,
    "megatron_fsdp": build_megatron_fsdp,
}
