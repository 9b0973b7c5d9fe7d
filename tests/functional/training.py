"""Training for the functional suite: Megatron's own DDP (the reference) and ours, through the
Megatron adapter and Megatron's schedule or, when the adapter is not importable, ``fully_shard``
with a plain loop; the loss curves cached per session and the golden file they are checked
against. The process group, the model and the data come from ``harness.py`` (import this module
through ``harness``, which re-exports its names).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from testing.megatron_gpt import loss_func, megatron_train_step

from .harness import (GOLDEN_PATH, MEASURED_FILE, REFERENCE, GPTSpec, World, batches, build_gpt, loss_spec,
                      release_memory, results_dir)


# Loss and forward step as Megatron-LM's pretrain_gpt has them: testing/megatron_gpt.py.


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

    data = batches(spec, world.rank, world)
    k = spec.micro_batches
    config.finalize_model_grads_func = finalize_model_grads
    losses, norms = [], []
    for it in range(spec.iters):
        store, ok, grad_norm = megatron_train_step(wrapped, optimizer, data[it * k:(it + 1) * k], spec.seq,
                                                   spec.micro_batch_size)
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


def shard_gpt(spec: GPTSpec, world: World, strategy: str, process_group=None, allocator: str = "storage_freeing",
              offload=None, **adamw):
    """``fully_shard`` of the GPT (units: every ``TransformerLayer``; bf16 compute, fp32 main weights
    and grads; ``offload``: an ``OffloadPolicy``) and a torch AdamW with Megatron's weight-decay rule
    (no decay for biases and 1-D parameters, decided on the original shapes; ``adamw``: further
    keywords, e.g. ``fused=True``). Returns ``(model, optimizer, info)``."""
    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

    module, _, layer_cls = build_gpt(spec, world)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    info = dict(shapes=shapes, order=[n for n, _ in module.named_parameters(remove_duplicate=False)],
                unit_fqns=[n for n, m in module.named_modules() if isinstance(m, layer_cls)],
                numels={n: p.numel() for n, p in module.named_parameters()})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if spec.bf16 else None
    model = fully_shard(module, sharding_strategy=strategy, process_group=process_group, unit_modules=[layer_cls],
                        mixed_precision=policy, allocator=allocator, offload=offload)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if len(shapes[name]) == 1 or name.endswith(".bias") else decay).append(param)
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=spec.weight_decay),
                                   dict(params=no_decay, weight_decay=0.0)],
                                  lr=spec.lr, betas=(0.9, spec.adam_beta2), eps=1e-8, **adamw)
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
            loss_sum, num_tokens, _ = loss_func(batch["loss_mask"], output)
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

