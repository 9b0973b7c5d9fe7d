#!/usr/bin/env python3
"""Hugging Face ``LlamaForCausalLM`` (built from a config, a model nobody here wrote) under torch
FSDP2 and megatron_fsdp_v2, in bf16 and with torchao float8 training, each decoder layer compiled:
issue 47, item 6. Every system runs in ONE process, one after the other (build, train, free)::

    python benchmarks/bench_llama.py                        # issue 47's shapes, N = 1 (GPU: NCCL)
    python benchmarks/bench_llama.py --fake-world-size 8    # each system as rank 0 of a fake 8-way group
    python benchmarks/bench_llama.py --strategies all       # ours also as ZeRO-1/2 and no_shard
    python benchmarks/bench_llama.py --reshard-after-forward none   # ours' root kept gathered, as FSDP2's
    python benchmarks/bench_llama.py --systems rowwise      # torchao's rowwise recipes, FSDP2 and ours
    python benchmarks/bench_llama.py --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 \\
        --vocab 128 --seq 32 --micro-batch 2 --steps 3 --warmup 1 --no-compile   # CPU smoke (gloo, 1 rank)

The recipe, the same for every system (torchtitan's order): build the model in fp32 from one seed;
for float8 ``torchao.float8.convert_to_float8_training(model, config=<recipe>, module_filter_fn=<all
but lm_head>)``; ``layer.compile()`` for each decoder layer (``--no-compile``: not); then shard each
decoder layer and the root. Four precisions, the suffix of each system's name:

- ``-bf16``: no conversion;
- ``-fp8``: tensorwise, ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` (issue 47): the
  converted weights are all-gathered in float8, their scales precomputed after each step;
- ``-fp8rw`` / ``-fp8rwhp``: torchao's ``Float8LinearConfig.from_recipe_name("rowwise")`` /
  ``("rowwise_with_gw_hp")``, the recipes torchtitan recommends on H100/H200 (issue 63): the weights
  stay plain and are all-gathered in bf16, each matmul casts to float8 with rowwise scales. Run
  only when asked (``--systems rowwise``, or by name), so ``--systems all`` keeps its run time;

then for each system:

- ``fsdp2-*``: ``torch.distributed.fsdp.fully_shard(layer)`` per layer, then ``fully_shard(model)``,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
- ``ours-*``: ``megatron_fsdp_v2.fully_shard(model, sharding_strategy=..., unit_modules=[LlamaDecoderLayer],
  mixed_precision=MixedPrecisionPolicy(param_dtype=bf16))`` (ZeRO-3 by default; ``--strategies``);

then AdamW over the parameters, and per step: forward + backward of one micro-batch (a fixed batch
of random token ids, the same every step and for every system, so losses fall and compare),
``optimizer.step()``, for tensorwise fp8 ``precompute_float8_dynamic_scale_for_fsdp(model)``,
``zero_grad``. Each system's loss is compared with FSDP2's of the same precision and recipe.

Reported per system: median step time after ``--warmup`` steps, peak allocated / reserved GiB
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the training steps), the loss
after the last of ``--steps`` steps, all-gather bytes per step (every c10d or functional
collective seen by a dispatch mode on the last warm-up step; ours also by its own
``comm_stats()``, whose ``"bytes_by_dtype"`` says which dtype travelled), and dynamo graph breaks
(``torch._dynamo.utils.counters["graph_break"]``, in total and per step). A system that raises is
recorded with its error and the run goes on; the script exits non-zero only on its own bugs.
Numbers and commands: docs/benchmarks.md; the method in detail: docs/benchmarks_history.md, "HF
Llama, float8 and compile".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
for _path in (REPO, HERE):              # megatron_fsdp_v2 and tests/ from this checkout; sibling modules
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.comm_counter import EveryCollectiveCounter  # noqa: E402

# bench_gpt's release of the autograd-hook cycles that keep a finished (or half-built) system alive
from bench_systems import release_autograd_hooks, release_leftover_models  # noqa: E402

T_START = time.perf_counter()
GIB = float(1 << 30)
STRATEGIES = ("optim_grads_params", "optim", "optim_grads", "no_shard")
ZERO_NAME = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}
DEFAULTS = dict(layers=8, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32768, seq=2048,
                micro_batch=8, steps=20, warmup=3)


# =============================================================================================
# Systems
# =============================================================================================


# precision suffix of a system's name -> torchao float8 recipe (None: bf16, no conversion)
RECIPES = {"bf16": None, "fp8": "tensorwise", "fp8rw": "rowwise", "fp8rwhp": "rowwise_with_gw_hp"}
ROWWISE = ("rowwise", "rowwise_with_gw_hp")
RECIPE_TEXT = {
    None: "bf16",
    "tensorwise": "torchao float8 tensorwise (Float8LinearConfig(enable_fsdp_float8_all_gather=True), all but "
                  "lm_head; gathered in float8)",
    "rowwise": "torchao float8 Float8LinearConfig.from_recipe_name('rowwise') (all but lm_head; gathered in bf16)",
    "rowwise_with_gw_hp": "torchao float8 Float8LinearConfig.from_recipe_name('rowwise_with_gw_hp') (all but "
                          "lm_head; gathered in bf16)",
}


@dataclass(frozen=True)
class System:
    name: str
    kind: str                         # fsdp2 | ours
    recipe: Optional[str]             # a RECIPES value: None (bf16), tensorwise, rowwise, rowwise_with_gw_hp
    strategy: Optional[str] = None    # ours

    @property
    def fp8(self) -> bool:
        return self.recipe is not None

    @property
    def description(self) -> str:
        prec = RECIPE_TEXT[self.recipe]
        if self.kind == "fsdp2":
            return f"torch FSDP2 fully_shard per decoder layer + root, ZeRO-3, {prec}"
        return f"megatron_fsdp_v2 fully_shard({self.strategy}) = {ZERO_NAME[self.strategy]}, {prec}"


def all_systems(strategies=("optim_grads_params",)) -> List[System]:
    """Every system: FSDP2's, then ours per strategy, each in RECIPES' order (bf16, fp8, fp8rw, fp8rwhp)."""
    out = [System(f"fsdp2-{suffix}", "fsdp2", recipe) for suffix, recipe in RECIPES.items()]
    for s in strategies:
        infix = "" if s == "optim_grads_params" else f"-{s}"
        out += [System(f"ours{infix}-{suffix}", "ours", recipe, s) for suffix, recipe in RECIPES.items()]
    return out


def select_systems(spec: str, strategies) -> List[System]:
    """``all`` or a comma list of names or tokens: ``fsdp2``, ``ours``, ``bf16``, ``fp8`` (tensorwise),
    ``rowwise`` (both rowwise recipes). ``all``, ``fsdp2`` and ``ours`` leave the rowwise systems out
    (``rowwise`` or their names add them)."""
    everything = all_systems(strategies)
    default = [s for s in everything if s.recipe not in ROWWISE]
    chosen: List[System] = []
    for token in (t.strip() for t in (spec or "all").split(",")):
        if not token:
            continue
        if token == "all":
            matches = default
        elif token in ("bf16", "fp8"):
            matches = [s for s in everything if s.recipe == RECIPES[token]]
        elif token == "rowwise":
            matches = [s for s in everything if s.recipe in ROWWISE]
        elif token in ("fsdp2", "ours"):
            matches = [s for s in default if s.kind == token]
        else:
            matches = [s for s in everything if s.name == token]
        if not matches:
            raise SystemExit(f"--systems: unknown system {token!r}; choose from all, fsdp2, ours, bf16, fp8, rowwise "
                             "or: " + ", ".join(s.name for s in everything) + " (others with --strategies)")
        chosen += [s for s in matches if s not in chosen]
    order = {s.name: i for i, s in enumerate(everything)}
    return sorted(chosen, key=lambda s: order[s.name])


# =============================================================================================
# Process, data, model
# =============================================================================================


@dataclass
class Ctx:
    args: argparse.Namespace
    device: torch.device
    world: int
    real_world: int
    fake: bool
    tokens: Optional[torch.Tensor] = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def init_process(args) -> Ctx:
    """torch's fake group (``--fake-world-size N``: rank 0 of N, collectives are no-ops), torchrun's
    group, or a 1-rank group of our own (NCCL on a GPU, gloo on CPU)."""
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if args.fake_world_size:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--fake-world-size cannot be combined with torchrun")
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
        return Ctx(args, device, args.fake_world_size, 1, True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        from tests.dist_pool import free_port

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return Ctx(args, device, dist.get_world_size(), dist.get_world_size(), False)


def make_batch(ctx: Ctx) -> None:
    """One fixed batch of random token ids (rank-dependent, seed-fixed), trained on every step."""
    a = ctx.args
    g = torch.Generator().manual_seed(1000 + (dist.get_rank() if not ctx.fake else 0))
    ctx.tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=g).to(ctx.device)


def llama_config(a):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.seq, tie_word_embeddings=False, use_cache=False,
        attention_dropout=0.0, attn_implementation="sdpa",
    )
    config._attn_implementation = "sdpa"
    return config


def build_llama(ctx: Ctx):
    """``LlamaForCausalLM`` in fp32, built on the device from seed 1234 (every system the same weights)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1234)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(llama_config(ctx.args))
    model = model.to(device=ctx.device, dtype=torch.float32)
    model.train()
    return model


def decoder_layers(model) -> list:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def sync(ctx: Ctx) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def cleanup(ctx: Ctx) -> None:
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)


# =============================================================================================
# Building a system
# =============================================================================================


def float8_config(ctx: Ctx, recipe: str):
    """tensorwise: issue 47's config (float8 all-gather); rowwise recipes: torchao's named config as
    torchtitan uses it; ``emulate`` set on either (a frozen dataclass: ``dataclasses.replace``)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=ctx.args.emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=ctx.args.emulate)


def convert_float8(ctx: Ctx, model, recipe: str) -> int:
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, config=float8_config(ctx, recipe),
                               module_filter_fn=lambda m, fqn: fqn != "lm_head")
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())


def precompute_coverage(model) -> str:
    """How many Float8Linear weights ``precompute_float8_dynamic_scale_for_fsdp`` sees (it takes
    only DTensor weights whose local tensor is torchao's ``WeightWithDynamicFloat8CastTensor``)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    seen = [m for m in linears if isinstance(m.weight, DTensor)
            and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)]
    kinds = sorted({type(m.weight).__name__ + ("/" + type(m.weight._local_tensor).__name__
                                               if isinstance(m.weight, DTensor) else "") for m in linears})
    return (f"precompute_float8_dynamic_scale_for_fsdp sees {len(seen)} of {len(linears)} Float8Linear weights "
            f"(weights: {', '.join(kinds)})")


def ours_mixed_precision_kwargs() -> dict:
    """``mixed_precision=`` (today's name), or ``mp_policy=`` should the package take FSDP2's name."""
    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    params = inspect.signature(fully_shard).parameters
    return {"mixed_precision" if "mixed_precision" in params else "mp_policy": policy}


def build_system(ctx: Ctx, system: System, notes: List[str]):
    """Model, optimizer and what a step calls after ``optimizer.step()``."""
    a = ctx.args
    model = build_llama(ctx)
    if system.fp8:
        n = convert_float8(ctx, model, system.recipe)
        notes.append(f"{n} nn.Linear -> Float8Linear ({system.recipe}){' (emulate=True)' if a.emulate else ''}")
    layers = decoder_layers(model)
    if a.compile:
        for layer in layers:
            layer.compile()
    if system.kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            torch_fully_shard(layer, mesh=mesh, mp_policy=mp)
        torch_fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from megatron_fsdp_v2 import fully_shard

        model = fully_shard(model, sharding_strategy=system.strategy, unit_modules=[LlamaDecoderLayer],
                            reshard_after_forward=a.reshard_after_forward, **ours_mixed_precision_kwargs())
        notes.append(f"reshard_after_forward={a.reshard_after_forward}")
    fused = a.adam == "fused" or (a.adam == "auto" and ctx.is_cuda)
    foreach = {"foreach": True, "single": False}.get(a.adam)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=fused or None, foreach=foreach)
    kernel = ", fused=True" if fused else ("" if foreach is None else f", foreach={foreach}")
    notes.append(f"AdamW(lr={a.lr:g}{kernel})")
    after_step = None
    if system.recipe == "tensorwise":       # rowwise recipes: plain weights, no scale to precompute
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        notes.append(precompute_coverage(model))

        def after_step():
            precompute_float8_dynamic_scale_for_fsdp(model)
    return model, opt, after_step


# =============================================================================================
# Running one system
# =============================================================================================


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def graph_break_reasons() -> Dict[str, int]:
    """dynamo's graph-break counter by reason: its first line and its "Explanation:" line."""
    from torch._dynamo.utils import counters

    out: Dict[str, int] = {}
    for key, n in counters["graph_break"].items():
        lines = [line.strip() for line in str(key).splitlines() if line.strip()]
        why = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
        reason = (lines[0] if lines else "?") + (f" ({why[len('Explanation:'):].strip()[:240]})" if why else "")
        reason = re.sub(r" at 0x[0-9a-f]+", "", reason)     # one reason per function, not per address
        out[reason] = out.get(reason, 0) + n
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip(": ")


def reserved_by_stream(device: torch.device) -> Dict[str, Dict[str, float]]:
    """The allocator's cached segments after training, per stream pool: reserved and allocated GiB.
    Each stream has a pool of its own whose free blocks the others cannot use (issue 63: where
    reserved-but-free memory sits). ``gradient pool``: ours' gradient buffers
    (group/grad_buffer.py); ``default``: the compute stream; others by their stream handle."""
    from megatron_fsdp_v2.group.grad_buffer import gradient_pool_stream

    names = {0: "default"}
    pool = gradient_pool_stream(device)
    if pool is not None:
        names[pool.cuda_stream] = "gradient pool"
    out: Dict[str, Dict[str, float]] = {}
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != device.index:
            continue
        name = names.get(segment["stream"], f"stream {segment['stream']:#x}")
        if segment.get("segment_pool_id", (0, 0)) != (0, 0):
            name += " (private pool)"
        entry = out.setdefault(name, {"reserved_gib": 0.0, "allocated_gib": 0.0})
        entry["reserved_gib"] += segment["total_size"] / GIB
        entry["allocated_gib"] += segment["allocated_size"] / GIB
    return out


def run_system(ctx: Ctx, system: System) -> Dict[str, Any]:
    from torch._dynamo.utils import counters

    a = ctx.args
    res: Dict[str, Any] = dict(name=system.name, kind=system.kind, fp8=system.fp8, recipe=system.recipe,
                               strategy=system.strategy,
                               zero=ZERO_NAME.get(system.strategy or "optim_grads_params"),
                               description=system.description, status="ok", error=None, notes=[])
    torch._dynamo.reset()
    counters.clear()
    cleanup(ctx)
    model = opt = after_step = None
    stage = "build"
    try:
        t0 = time.perf_counter()
        model, opt, after_step = build_system(ctx, system, res["notes"])
        sync(ctx)
        res["build_s"] = time.perf_counter() - t0
        if ctx.is_cuda:
            res["build_peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / GIB
            res["build_reserved_gib"] = torch.cuda.max_memory_reserved(ctx.device) / GIB
            torch.cuda.reset_peak_memory_stats(ctx.device)
        has_comm_stats = callable(getattr(model, "comm_stats", None))
        losses, times, breaks = [], [], []
        for i in range(a.steps):
            stage = f"step {i}"
            counted = i == a.warmup - 1            # the last warm-up step: compiled already (warm-up >= 2)
            counter = EveryCollectiveCounter() if counted else contextlib.nullcontext()
            if counted and has_comm_stats:
                model.reset_comm_stats()
            gb0 = _graph_breaks()
            sync(ctx)
            t = time.perf_counter()
            with counter:
                loss = train_step(ctx, model, opt, after_step)
            sync(ctx)
            times.append(time.perf_counter() - t)
            losses.append(float(loss.detach()))
            breaks.append(_graph_breaks() - gb0)
            if counted:
                summary = counter.summary()
                res["collectives_per_step"] = {k: dict(calls=c, bytes=b) for k, (c, b) in summary.items()}
                res["all_gather_bytes_per_step"] = summary.get("all_gather", (0, 0))[1]
                res["all_gather_bytes_by_dtype_per_step"] = dict(counter.gathered_by_dtype)
                unexpected = [k for k in summary if k.startswith("unexpected")]
                if unexpected:
                    res["notes"].append("collectives not counted: " + ", ".join(unexpected))
                if has_comm_stats:
                    stats = model.comm_stats()
                    res["ours_comm_stats_per_step"] = stats
                    res["ours_all_gather_bytes_per_step"] = stats.get("all_gather", {}).get("bytes")
        stage = "after training"
        if ctx.is_cuda:
            res["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / GIB
            res["reserved_gib"] = torch.cuda.max_memory_reserved(ctx.device) / GIB
            res["reserved_by_stream"] = reserved_by_stream(ctx.device)
        timed = times[a.warmup:]
        res["step_s_all"] = times
        res["step_s"] = statistics.median(timed)
        res["tokens_per_s"] = a.micro_batch * a.seq * ctx.real_world / res["step_s"]
        res["losses"] = losses
        res["loss_last"] = losses[-1]
        res["graph_breaks_per_step"] = breaks
        res["graph_breaks_total"] = sum(breaks)
        res["graph_breaks_after_first_step"] = sum(breaks[1:])
        res["graph_break_reasons"] = graph_break_reasons()
        res["unique_graphs"] = counters["stats"].get("unique_graphs", 0)
        bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
        if bad is not None:
            msg = f"loss not finite from step {bad} on"
            if ctx.fake:      # a fake group leaves gathered weights unwritten: values mean nothing
                res["notes"].append(msg + " (fake group: expected)")
            else:
                res.update(status="error", error=msg)
    except Exception as exc:  # noqa: BLE001 -- one failing system must not end the run
        oom = isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()
        res.update(status="OOM" if oom else "error", error=f"{stage}: {_first_line(exc)}")
        res["traceback"] = traceback.format_exc()
        traceback.print_exc()
        if ctx.is_cuda:
            res["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / GIB
            res["reserved_gib"] = torch.cuda.max_memory_reserved(ctx.device) / GIB
    finally:
        if res.get("graph_breaks_total") is None:
            res["graph_break_reasons"] = graph_break_reasons()
        release_autograd_hooks(model, opt)
        model = opt = after_step = None
        release_leftover_models()
        torch._dynamo.reset()              # compiled code and its guards hold the modules
        cleanup(ctx)
        if ctx.is_cuda:
            left = torch.cuda.memory_allocated(ctx.device) - ctx.tokens.numel() * ctx.tokens.element_size()
            if left > 0.01 * GIB:
                res["notes"].append(f"{left / GIB:.2f} GiB still allocated after the system was freed")
    return res


# =============================================================================================
# Reporting
# =============================================================================================


def _fmt(v, spec=".3f", none="-"):
    if v is None:
        return none
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def _reference(results, r) -> Optional[Dict[str, Any]]:
    """The FSDP2 run of the same precision and float8 recipe, the loss each system is compared with."""
    ref = next((x for x in results if x["kind"] == "fsdp2" and x.get("recipe") == r.get("recipe")
                and x["status"] == "ok"), None)
    return None if ref is None or ref is r else ref


def train_step(ctx, model, opt, after_step) -> torch.Tensor:
    """One step of the recipe: forward, backward, ``optimizer.step()``, the float8 precompute
    (``after_step``), ``zero_grad``; the loss."""
    loss = model(input_ids=ctx.tokens, labels=ctx.tokens).loss
    loss.backward()
    opt.step()
    if after_step is not None:
        after_step()
    opt.zero_grad(set_to_none=True)
    return loss


def goals(meta, results) -> List[str]:
    """Issue 47's checks where this run has the numbers: each loss against FSDP2's of the same
    precision (within 1e-3), and the goals (stated for micro-batch 8 on one H200: read them there;
    step and peak are compared on a GPU only)."""
    by = {r["name"]: r for r in results if r["status"] == "ok"}
    out = []
    o8, f8, ob, fb = (by.get(n) for n in ("ours-fp8", "fsdp2-fp8", "ours-bf16", "fsdp2-bf16"))
    if not meta["fake"]:
        for r in results:
            ref = _reference(results, r)
            if r["status"] == "ok" and ref is not None:
                diff = r["loss_last"] - ref["loss_last"]
                out.append(f"loss of {r['name']} after {meta['steps']} steps against {ref['name']}'s: {diff:+.4f} -> "
                           f"{'within' if abs(diff) <= 1e-3 else 'NOT within'} 1e-3")
    if o8 and f8 and not meta["fake"] and meta["device"].startswith("cuda"):
        ratio = o8["step_s"] / f8["step_s"]
        out.append(f"goal ours-fp8 step <= 0.95x fsdp2-fp8: {ratio:.3f}x -> {'met' if ratio <= 0.95 else 'missed'}")
        if o8.get("peak_gib") is not None and f8.get("peak_gib") is not None:
            ok = o8["peak_gib"] <= f8["peak_gib"]
            out.append(f"goal ours-fp8 peak <= fsdp2-fp8: {o8['peak_gib']:.2f} vs {f8['peak_gib']:.2f} GiB -> "
                       f"{'met' if ok else 'missed'}")
    if ob and fb and meta["compile"] and meta["device"].startswith("cuda") and ob.get("reserved_gib") is not None and fb.get("reserved_gib") is not None:
        ok = ob["reserved_gib"] <= fb["reserved_gib"]
        out.append(f"goal ours-bf16 reserved <= fsdp2-bf16 (compiled): {ob['reserved_gib']:.2f} vs "
                   f"{fb['reserved_gib']:.2f} GiB -> {'met' if ok else 'missed'}")
    if o8 and ob and meta["fake"] and ob.get("all_gather_bytes_per_step"):
        ratio = o8["all_gather_bytes_per_step"] / ob["all_gather_bytes_per_step"]
        out.append(f"goal ours-fp8 all-gather bytes = 1/2 of ours-bf16's (fake {meta['world']}): {ratio:.3f}x -> "
                   f"{'met' if ratio <= 0.5 + 1e-3 else 'missed'}")
        split = _float8_weights_ratio(o8, ob)
        if split is not None:
            out.append(split)
    return out + rowwise_goals(meta, by)


ROWWISE_GOAL = "rowwise float8, compiled: ours step <= 1.0x FSDP2's with the same recipe, peak <= FSDP2's"


def rowwise_goals(meta, by: Dict[str, Dict[str, Any]]) -> List[str]:
    """Issue 63's goal per rowwise recipe (ours ZeRO-3 against FSDP2, both compiled, on a GPU, a
    real group), and what ours' all-gathers carried under each rowwise system (``comm_stats()``'s
    ``"bytes_by_dtype"``: the recipe gathers plain bf16 weights, so no float8 may appear)."""
    out = []
    measurable = meta["compile"] and not meta["fake"] and meta["device"].startswith("cuda")
    for suffix in ("fp8rw", "fp8rwhp"):
        ours, fsdp2 = by.get(f"ours-{suffix}"), by.get(f"fsdp2-{suffix}")
        if not (ours and fsdp2):
            continue
        if not measurable or ours.get("peak_gib") is None or fsdp2.get("peak_gib") is None:
            out.append(f"goal {ROWWISE_GOAL} ({RECIPES[suffix]}): not checked here (compiled layers on a GPU, "
                       "a real group)")
            continue
        ratio = ours["step_s"] / fsdp2["step_s"]
        ok = ratio <= 1.0 and ours["peak_gib"] <= fsdp2["peak_gib"]
        out.append(f"goal {ROWWISE_GOAL} ({RECIPES[suffix]}): step {ratio:.3f}x, peak {ours['peak_gib']:.2f} vs "
                   f"{fsdp2['peak_gib']:.2f} GiB (reserved {_fmt(ours.get('reserved_gib'), '.2f')} vs "
                   f"{_fmt(fsdp2.get('reserved_gib'), '.2f')}) -> {'met' if ok else 'missed'}")
    for r in by.values():
        gathered = (r.get("ours_comm_stats_per_step") or {}).get("bytes_by_dtype", {}).get("all_gather")
        if r.get("recipe") not in ROWWISE or gathered is None:
            continue
        float8 = sorted(name for name in gathered if "float8" in name)
        out.append(f"{r['name']} all-gathers carried {', '.join(sorted(gathered)) or 'nothing'} (comm_stats) -> "
                   + ("nothing in float8, as the recipe asks" if not float8 else f"float8 gathered: {float8}"))
    return out


def _float8_weights_ratio(o8: Dict[str, Any], ob: Dict[str, Any]) -> Optional[str]:
    """The bytes of the weights the recipe converts, fp8 against bf16: in the fp8 run the 1-byte
    dtypes are theirs and the bf16 bytes are the weights left in bf16 (embedding, lm_head, norms),
    which move the same in the bf16 run; so there the converted weights move its total less those."""
    fp8_run, bf16_run = o8.get("all_gather_bytes_by_dtype_per_step"), ob.get("all_gather_bytes_per_step")
    if not fp8_run or not bf16_run:
        return None
    one_byte = sum(b for name, b in fp8_run.items() if name in ("uint8", "float8_e4m3fn", "float8_e5m2"))
    kept_bf16 = fp8_run.get("bfloat16", 0)
    if sum(fp8_run.values()) != one_byte + kept_bf16 or bf16_run <= kept_bf16:
        return None
    converted_in_bf16 = bf16_run - kept_bf16
    return (f"float8-converted weights alone: {one_byte / 1e6:.1f} MB in fp8 vs {converted_in_bf16 / 1e6:.1f} MB in bf16 "
            f"= {one_byte / converted_in_bf16:.4f}x; the weights the recipe keeps in bf16 move {kept_bf16 / 1e6:.1f} MB "
            "in both runs")


def results_markdown(meta: Dict[str, Any], results: List[Dict[str, Any]]) -> str:
    mode = (f"fake process group, rank 0 of {meta['world']} (collectives are no-ops: times exclude communication, "
            f"losses mean nothing)" if meta["fake"] else f"{meta['real_world']} process(es), {meta['backend']}")
    out = [
        f"### HF LlamaForCausalLM {meta['num_params'] / 1e6:.1f}M params: {meta['layers']} layers, hidden "
        f"{meta['hidden']}, intermediate {meta['intermediate']}, {meta['heads']} heads / {meta['kv_heads']} KV heads, "
        f"vocab {meta['vocab']}, seq {meta['seq']}, micro-batch {meta['micro_batch']}",
        "",
        f"- mode: {mode}; device: {meta['device_name']}",
        f"- torch {meta['torch']}, torchao {meta['torchao']}, transformers {meta['transformers']}, python "
        f"{meta['python']}; {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- fp32 weights, bf16 compute, AdamW(lr={meta['lr']:g}); "
        f"{'each decoder layer compiled (layer.compile())' if meta['compile'] else 'eager (--no-compile)'}; "
        f"torchao float8{' (emulate=True)' if meta['emulate'] else ''}: fp8 = tensorwise, all-gathered in fp8, "
        f"scales precomputed after each optimizer step; fp8rw / fp8rwhp = the rowwise / rowwise_with_gw_hp "
        f"recipes, all-gathered in bf16",
        f"- step = forward + backward + optimizer.step (+ fp8 scale precompute) + zero_grad; {meta['steps']} steps "
        f"on one fixed batch; step s = median of the last {meta['steps'] - meta['warmup']} (after {meta['warmup']} "
        f"warm-up); peak / reserved = max_memory_allocated / max_memory_reserved over the training steps; loss = "
        f"after the last step; Δ loss = against FSDP2 of the same precision and recipe; all-gather = bytes of the "
        f"all-gather outputs per step (every collective counted on the last warm-up step; ours: also its "
        f"comm_stats()); "
        f"graph breaks = dynamo's counter, all steps / after the first step",
        "",
        "| system | status | step s | tokens/s | peak GiB | reserved GiB | loss | Δ loss | all-gather MB/step | "
        "ours comm_stats all-gather MB/step | graph breaks | graphs | build s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r.get('error') or ''}"
        status = status.replace("|", "/").replace("\n", " ")
        ref = _reference(results, r)
        dloss = (r["loss_last"] - ref["loss_last"]
                 if ref and r.get("loss_last") is not None and ref.get("loss_last") is not None else None)
        ag = r.get("all_gather_bytes_per_step")
        og = r.get("ours_all_gather_bytes_per_step")
        gb = (f"{r['graph_breaks_total']} / {r['graph_breaks_after_first_step']}"
              if meta["compile"] and r.get("graph_breaks_total") is not None else "-")
        out.append(
            f"| {r['name']} | {status} | {_fmt(r.get('step_s'), '.4f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{_fmt(r.get('peak_gib'), '.2f')} | {_fmt(r.get('reserved_gib'), '.2f')} | "
            f"{_fmt(r.get('loss_last'), '.4f')} | {_fmt(dloss, '+.4f')} | "
            f"{_fmt(ag / 1e6 if ag is not None else None, '.3f')} | {_fmt(og / 1e6 if og is not None else None, '.3f')} | "
            f"{gb} | {r.get('unique_graphs', '-') if meta['compile'] else '-'} | {_fmt(r.get('build_s'), '.1f')} |")
    notes = [f"- {r['name']}: {'; '.join(r['notes'])}" for r in results if r.get("notes")]
    for r in results:
        if r.get("graph_break_reasons"):
            reasons = "; ".join(f"{v}x {k}" for k, v in sorted(r["graph_break_reasons"].items(), key=lambda kv: -kv[1]))
            notes.append(f"- {r['name']} graph breaks: {reasons}")
    for r in results:
        if r.get("reserved_by_stream"):
            pools = "; ".join(f"{name} {v['reserved_gib']:.2f} reserved / {v['allocated_gib']:.2f} allocated"
                              for name, v in sorted(r["reserved_by_stream"].items()))
            notes.append(f"- {r['name']} cached segments after training, by stream pool (GiB): {pools}")
    notes += [f"- {n}" for n in meta.get("notes", [])]
    if notes:
        out += ["", "Notes:", ""] + notes
    return "\n".join(out)


def write_outputs(meta, results, final: bool) -> None:
    a = meta["args"]
    meta_out = {k: v for k, v in meta.items() if k != "args"}
    meta_out["complete"] = final
    md = results_markdown(meta_out, results)
    if not final:
        md = "<!-- partial: the run has not finished -->\n" + md
    else:
        print("\n" + md, flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(md + "\n")
        if final:
            print(f"wrote {a.out}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        slim = [{k: v for k, v in r.items() if k != "traceback"} for r in results]
        Path(a.json).write_text(json.dumps({"meta": meta_out, "results": slim}, indent=1, default=str))
        if final:
            print(f"wrote {a.json}")


# =============================================================================================
# Main
# =============================================================================================


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (defaults: issue 47's shapes, an 8B model's layers, 8 of them)")
    for flag, key, what in (("--layers", "layers", "decoder layers"), ("--hidden", "hidden", "hidden size"),
                            ("--intermediate", "intermediate", "MLP intermediate size"),
                            ("--heads", "heads", "attention heads"), ("--kv-heads", "kv_heads", "key/value heads"),
                            ("--vocab", "vocab", "vocabulary size"), ("--seq", "seq", "sequence length"),
                            ("--micro-batch", "micro_batch", "micro-batch size")):
        g.add_argument(flag, type=int, default=DEFAULTS[key], help=f"{what} (default {DEFAULTS[key]})")
    g = p.add_argument_group("run")
    g.add_argument("--systems", default="all", help="'all' (default: bf16 and tensorwise fp8) or a comma list of "
                   "names or tokens (fsdp2, ours, bf16, fp8, rowwise: both rowwise recipes, run only when asked): "
                   "fsdp2-bf16, fsdp2-fp8, fsdp2-fp8rw, fsdp2-fp8rwhp, ours-bf16, ours-fp8, ours-fp8rw, "
                   "ours-fp8rwhp, ours-<strategy>-<precision>")
    g.add_argument("--strategies", default="optim_grads_params",
                   help="ours' sharding strategies, comma list or 'all' (default optim_grads_params = ZeRO-3, "
                   "named ours-bf16/ours-fp8/...; the others are named ours-<strategy>-bf16/-fp8/...): "
                   + ", ".join(STRATEGIES))
    g.add_argument("--reshard-after-forward", choices=("true", "none", "false"), default="true",
                   help="ours' fully_shard(reshard_after_forward=...) (default true, ours' default: every unit "
                   "gathered twice per step; none: FSDP2's default, the root kept from forward to backward)")
    g.add_argument("--list-systems", action="store_true", help="print the system names and exit")
    g.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                   help=f"optimizer steps in all, warm-up included (default {DEFAULTS['steps']}); the loss is the last's")
    g.add_argument("--warmup", type=int, default=DEFAULTS["warmup"],
                   help=f"untimed first steps, >= 1; collectives are counted on the last of them "
                   f"(default {DEFAULTS['warmup']})")
    g.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    g.add_argument("--adam", choices=("auto", "fused", "foreach", "single"), default="auto",
                   help="AdamW kernel (default auto: fused on CUDA, foreach on CPU; single: foreach=False)")
    g.add_argument("--no-compile", dest="compile", action="store_false",
                   help="do not layer.compile() the decoder layers")
    g.add_argument("--emulate", action=argparse.BooleanOptionalAction, default=None,
                   help="Float8LinearConfig(emulate=True): fp8 matmuls emulated in high precision (default: on "
                   "when no GPU is used)")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="default auto: cuda when a GPU is visible (NCCL), else cpu (gloo)")
    g.add_argument("--fake-world-size", type=int, default=0,
                   help="each system as rank 0 of an N-way job on torch's fake process group (collectives are "
                   "no-ops; per-rank memory and bytes of N ranks; default 0 = a real group)")
    g.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds since start after which the remaining systems are skipped (e.g. 540 under a "
                   "600 s limit; default 0 = none)")
    g.add_argument("--verbose", action="store_true", help="keep library warnings")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="markdown (default benchmarks/results/<today>/llama<SUFFIX>.md, "
                   "SUFFIX '' or _fake<N>; '' = do not write)")
    g.add_argument("--json", default=None, help="JSON (default benchmarks/results/<today>/llama<SUFFIX>.json; "
                   "'' = do not write)")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.emulate is None:
        a.emulate = a.device != "cuda"
    a.reshard_after_forward = {"true": True, "none": None, "false": False}[a.reshard_after_forward]
    if a.strategies.strip() == "all":
        a.strategies = STRATEGIES
    else:
        a.strategies = tuple(s.strip() for s in a.strategies.split(",") if s.strip())
        bad = [s for s in a.strategies if s not in STRATEGIES]
        if bad or not a.strategies:
            p.error(f"--strategies: unknown {bad}; choose from {', '.join(STRATEGIES)} or all")
    if a.warmup < 1 or a.steps <= a.warmup:
        p.error("need 1 <= --warmup < --steps (collectives are counted on the last warm-up step; "
                "at least one step is timed)")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error("--hidden must be divisible by --heads, and --heads by --kv-heads")
    suffix = f"_fake{a.fake_world_size}" if a.fake_world_size else ""
    day = RESULTS / datetime.date.today().isoformat()
    if a.out is None:
        a.out = str(day / f"llama{suffix}.md")
    if a.json is None:
        a.json = str(day / f"llama{suffix}.json")
    return a


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"


def main(argv=None) -> int:
    args = parse_args(argv)
    systems = select_systems(args.systems, args.strategies)
    if args.list_systems:
        for s in all_systems(args.strategies):
            print(f"{s.name:28s} {s.description}")
        return 0
    if not args.verbose:
        warnings.filterwarnings("ignore")
        import logging

        logging.getLogger("torch.distributed").setLevel(logging.ERROR)
        logging.getLogger("transformers").setLevel(logging.ERROR)
    ctx = init_process(args)
    try:
        make_batch(ctx)
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            num_params = count_params(LlamaForCausalLM(llama_config(args)))
        meta = dict(
            args=args, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
            kv_heads=args.kv_heads, vocab=args.vocab, seq=args.seq, micro_batch=args.micro_batch, steps=args.steps,
            warmup=args.warmup, lr=args.lr, compile=args.compile, emulate=args.emulate, num_params=num_params,
            world=ctx.world, real_world=ctx.real_world, fake=ctx.fake, backend=dist.get_backend(),
            device=str(ctx.device),
            device_name=torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else (platform.processor() or "cpu"),
            torch=torch.__version__, torchao=_version("torchao"), transformers=_version("transformers"),
            python=platform.python_version(), date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            systems=[s.name for s in systems], strategies=list(args.strategies),
            command=" ".join(["python", *map(shlex.quote, sys.argv)]), notes=[],
        )
        if ctx.fake:
            meta["notes"].append("fake group: all-gathers and reduce-scatters leave their outputs unwritten, so the "
                                 "weights trained on are garbage; losses are not comparable")
        print(f"LlamaForCausalLM {num_params / 1e6:.1f}M params; {len(systems)} systems; world {ctx.world}"
              f"{' (fake)' if ctx.fake else ''}; device {meta['device_name']}; "
              f"{'compiled layers' if args.compile else 'eager'}", flush=True)
        results: List[Dict[str, Any]] = []
        for system in systems:
            elapsed = time.perf_counter() - T_START
            if args.time_budget and elapsed > args.time_budget:
                r = dict(name=system.name, kind=system.kind, fp8=system.fp8, recipe=system.recipe,
                         strategy=system.strategy,
                         description=system.description, status="skipped", notes=[],
                         error=f"--time-budget {args.time_budget:.0f} s used up ({elapsed:.0f} s)")
            else:
                print(f"--> {system.name}: {system.description}", flush=True)
                r = run_system(ctx, system)
            results.append(r)
            print(f"    {r['status']}" + (f"  step {r['step_s']:.4f} s  peak {_fmt(r.get('peak_gib'), '.2f')} GiB  "
                                         f"loss {r['loss_last']:.4f}  [{time.perf_counter() - T_START:.0f} s]"
                                         if r.get("step_s") is not None else f"  {r.get('error')}"), flush=True)
            write_outputs(meta, results, final=False)
        meta["wall_s"] = time.perf_counter() - T_START
        meta["notes"].extend(goals(meta, results))
        write_outputs(meta, results, final=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
