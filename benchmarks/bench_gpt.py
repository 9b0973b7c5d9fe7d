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
tokens/s, peak ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` during training,
and the memory a rank keeps between steps (after ``optimizer.step()``, and after ``zero_grad``)
next to the ZeRO formula.
Results go to benchmarks/results/<today>/ by default (--out / --json); that directory's
README.md should give the command of each file. Numbers: docs/benchmarks.md; what each column
means: docs/benchmarks_history.md, "What is measured".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"              # run outputs, one directory per date (docs/ holds prose only)
for _path in (REPO, HERE):              # megatron_fsdp_v2 from this checkout; sibling modules
    if str(_path) not in sys.path:      # also when imported as a module, not run as a script
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T_START = time.perf_counter()

# The process (bench_setup), the systems (bench_systems) and CPU offload's side (bench_offload).
from bench_setup import (Ctx, allocated, build_gpt, cleanup, count_params, init_distributed,  # noqa: E402
                         finish_process, prepare_process, sync)
from bench_systems import (BUILDERS, GIB, OFFLOAD_OPTIONS, STRATEGIES, ZERO_NAME, Built, System,  # noqa: E402
                           all_systems, expected_state, release_autograd_hooks,
                           release_leftover_models, select_systems)
from bench_offload import check_host_memory, cpu_notes, offload_goals, search_smallest_fraction  # noqa: E402


# =============================================================================================
# Running one system
# =============================================================================================


def _is_oom(exc: BaseException) -> bool:
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    return isinstance(exc, oom_types) or "out of memory" in str(exc).lower()


def non_finite_loss(losses: List[float]) -> Optional[str]:
    """The error of a run whose loss became NaN or infinite, or None."""
    bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    return None if bad is None else f"loss not finite from step {bad} on (of {len(losses)}, warm-up included)"


def loss_agreement(results: List[Dict[str, Any]]) -> List[str]:
    """Every system trains from the same weights on the same batch, so their losses should agree
    up to their numerics (kernels, reduction order, dtypes): the largest difference from the first
    system that trained, per system. A system that trained wrong shows here even if it was fast
    (a race in one system's offload made its loss drift by 0.1-0.2, or NaN, where the others agree
    to ~0.01-0.05 over 10 steps)."""
    ok = [r for r in results if r.get("status") == "ok" and r.get("losses")]
    if len(ok) < 2:
        return []
    ref = ok[0]
    lines = []
    for r in ok[1:]:
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
        step = max(range(len(diffs)), key=diffs.__getitem__)
        lines.append(f"loss of {r['name']} against {ref['name']}'s: at most {diffs[step]:.4f} apart (step {step})")
    return lines


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
    reserved_baseline = torch.cuda.memory_reserved(ctx.device) if ctx.is_cuda else None
    built: Optional[Built] = None
    try:
        if system.offload is not None:
            check_host_memory(ctx, system)
        t0 = time.perf_counter()
        built = BUILDERS[system.kind](ctx, system)
        sync(ctx)
        res["build_s"] = time.perf_counter() - t0
        res["notes"].extend(built.notes)
        if ctx.is_cuda:
            res["build_peak_gib"] = (torch.cuda.max_memory_allocated(ctx.device) - baseline) / GIB
            res["build_reserved_gib"] = (torch.cuda.max_memory_reserved(ctx.device) - reserved_baseline) / GIB
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
                if exp_bytes:       # a formula of 0 (everything on the host) has no relative deviation
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
            res["reserved_gib"] = torch.cuda.max_memory_reserved(ctx.device) / GIB
        if built.comm_stats is not None and a.steps:
            stats = built.comm_stats()
            res["comm_bytes_per_step"] = stats["total_bytes"] / a.steps
            res["comm_calls_per_step"] = {k: v["count"] / a.steps for k, v in stats.items()
                                          if isinstance(v, dict) and "count" in v}
        res["step_s_all"] = times
        if times:
            med = statistics.median(times)
            res["step_ms"] = 1000.0 * med
            res["step_ms_mean"] = 1000.0 * statistics.fmean(times)
            res["tokens_per_s"] = a.micro_batch * a.seq * ctx.real_world / med
        res["losses"] = [float(x) for x in losses]
        res["loss_last"] = res["losses"][-1] if losses else None
        if (error := non_finite_loss(res["losses"])) is not None:
            res.update(status="error", error=error)   # a step time is worth nothing if the training it timed went wrong
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
        *([f"- command: `{meta['command']}`"] if meta.get("command") else []),
        f"- step = forward + backward (one micro-batch) + optimizer step + zero_grad; median of {meta['steps']} "
        f"steps after {meta['warmup']} warm-up steps; tokens/s = {meta['micro_batch']}x{meta['seq']}"
        f"{'x' + str(meta['real_world']) if meta['real_world'] > 1 else ''} / median step",
        "- peak allocated / reserved = torch.cuda.max_memory_allocated / max_memory_reserved over the warm-up "
        "and timed steps (absolute: includes the token batch and Megatron's shared attention-score buffer); "
        "state = memory_allocated after "
        "optimizer.step() minus the pre-build baseline "
        "(Megatron's shared attention buffer excluded), on the last warm-up step; "
        "'after zero_grad' = the same after zero_grad(set_to_none=True)",
        "",
        "- accounted = the same state added up from the tensors (ours: persistent_bytes() + optimizer "
        "state; floor/FSDP2: parameter and gradient storages + optimizer state); dev % = state vs the "
        "ZeRO formula (on CPU, where nothing is measured: accounted vs formula)",
        "",
        "| system | status | step ms | tokens/s | step / floor | peak allocated GiB | peak reserved GiB | state GiB | "
        "after zero_grad GiB | accounted GiB | ZeRO formula | expected GiB | dev % | ours persistent GiB | "
        "comm GB/step | build s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
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
            f"{ratio} | {_fmt(r.get('peak_gib'), g)} | {_fmt(r.get('reserved_gib'), g)} | "
            f"{_fmt(r.get('state_gib'), g)} | "
            f"{_fmt(r.get('state_after_zero_grad_gib'), g)} | {_fmt(r.get('accounted_state_gib'), g)} | "
            f"{r['expected_formula']} | "
            f"{_fmt(r.get('expected_state_gib'), g)} | {_fmt(r.get('deviation_pct'), '+.1f')} | "
            f"{_fmt(pb['total'] / GIB, g) if pb else '-'} | {_fmt(comm / 1e9, '.3f') if comm is not None else '-'} | "
            f"{_fmt(r.get('build_s'), '.1f')} |")
    out += ["", formula_table(meta["world"], meta["num_params"]), ""]
    out += notes_markdown(results, meta)
    return "\n".join(out)


def notes_markdown(rows: list, meta: dict) -> list:
    """The "Notes:" lines of a results page: each system's notes, then the run's."""
    notes = [f"- {r['name']}: {'; '.join(r['notes'])}" for r in rows if r.get("notes")]
    notes += [f"- {n}" for n in meta.get("notes", [])]
    return ["Notes:", ""] + notes + [""] if notes else []


def add_model_arguments(group, defaults: dict, small_help: str) -> None:
    """The GPT shape flags (``None`` means ``defaults[...]``; no ``layers`` key: no ``--layers``)."""
    if "layers" in defaults:
        group.add_argument("--layers", type=int, default=None,
                           help=f"transformer layers (default {defaults['layers']}; --small: 2)")
    group.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {defaults['hidden']}; --small: 256)")
    group.add_argument("--heads", type=int, default=None, help=f"attention heads (default {defaults['heads']}; --small: 4)")
    group.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 x hidden)")
    group.add_argument("--seq", type=int, default=None, help=f"sequence length (default {defaults['seq']}; --small: 256)")
    group.add_argument("--micro-batch", type=int, default=None,
                       help=f"micro-batch size (default {defaults['micro_batch']}; --small: 2)")
    group.add_argument("--vocab", type=int, default=None, help=f"vocabulary size (default {defaults['vocab']}; --small: 4096)")
    group.add_argument("--small", action="store_true", help=small_help)


# =============================================================================================
# Main
# =============================================================================================


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (defaults: the ~940M-parameter GPT)")
    add_model_arguments(g, dict(layers=16, hidden=2048, heads=16, seq=2048, micro_batch=4, vocab=32000),
                        "smoke preset: 2 layers, hidden 256, 4 heads, seq 256, micro-batch 2, vocab 4096 "
                        "(explicit flags still win)")
    g.add_argument("--skip-init", action="store_true", help="perform_initialization=False (faster build, "
                   "uninitialised weights)")
    g = p.add_argument_group("run")
    g.add_argument("--systems", default="all", help="'all' (default) or a comma list of names / prefixes: floor, ours, "
                   "ours-<strategy>, ours-<strategy>-<sf|tp>, fsdp2, fsdp2-zero3, fsdp2-no_reshard, megatron, "
                   "megatron_ddp, megatron_fsdp, megatron_fsdp-<strategy>")
    g.add_argument("--list-systems", action="store_true", help="print the system names and exit")
    g.add_argument("--offload-fractions", default="", help="CPU offload side by side: comma list of fractions f; "
                   "adds ours-offload<f> (ZeRO-3, OffloadPolicy(fraction=f)) per f, fsdp2-cpu_offload (FSDP2 "
                   "CPUOffloadPolicy(pin_memory=True)) and megatron_ddp-cpu_offload (--optimizer-cpu-offload, fraction "
                   "1), selected by the system token 'offload' (e.g. --systems ours-optim_grads_params-sf,fsdp2-zero3,"
                   "offload --offload-fractions 1,0.5); not part of 'all'")
    g.add_argument("--offload-search", type=float, default=0.0, metavar="STEP",
                   help="with the 'offload' systems: after the ours-offload<f> rows, binary-search the grid 0, STEP, "
                   "..., 1 for the smallest f that trains (ours-offload-min; every run a row; default 0 = off)")
    g.add_argument("--offload-step-in-backward", type=int, choices=(0, 1), default=1,
                   help="ours-offload<f>: OffloadPolicy(step_in_backward=...) (default 1: offloaded groups step "
                   "on a host thread during backward)")
    g.add_argument("--offload-release-after-gather", choices=("0", "1", "both"), default="0",
                   help="ours-offload<f>: OffloadPolicy(release_after_gather=...): compute shards only around their "
                   "gathers, FSDP2-offload's memory for one more upload per step; 'both' adds ours-offload<f>-release "
                   "next to ours-offload<f> (default 0)")
    g.add_argument("--offload-step-threads", type=int, default=0,
                   help="with step in backward: OffloadPolicy(step_threads=N), the CPU step's threads "
                   "(default 0 = torch's)")
    g.add_argument("--offload-root-per-child", type=int, choices=(0, 1), default=0,
                   help="ours-offload<f>: fully_shard(reduce_root_per_child=...): the output layer's group reduces "
                   "(and, stepping in backward, steps on the thread) at the start of backward (default 0)")
    g.add_argument("--offload-switch-interval", type=float, default=0.0,
                   help="with step in backward: the GIL switch interval (s) while groups step on the thread "
                   "(offload/backward_steps.py's STEP_SWITCH_INTERVAL_S; 0.005 = Python's, i.e. not lowered; "
                   "default 0 = the library's)")
    g.add_argument("--cpu-threads", type=int, default=0,
                   help="torch.set_num_threads(N) before any system (the CPU optimizer steps; default 0 = torch's)")
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
    g.add_argument("--out", default=None, help="markdown table (default benchmarks/results/<today>/"
                   "benchmarks_results<SUFFIX>.md, SUFFIX = '' / _fake<N> / _<N>gpu by mode; '' = do not write)")
    g.add_argument("--json", default=None, help="JSON results (default benchmarks/results/<today>/"
                   "benchmarks_results<SUFFIX>.json; '' = skip)")
    args = p.parse_args(argv)
    try:
        args.offload_fractions = tuple(float(t) for t in args.offload_fractions.split(",") if t.strip())
    except ValueError:
        p.error(f"--offload-fractions must be a comma list of numbers in [0, 1], got {args.offload_fractions!r}")
    if any(not 0 <= f <= 1 for f in args.offload_fractions):
        p.error(f"--offload-fractions must be numbers in [0, 1], got {args.offload_fractions}")
    if not 0 <= args.offload_search <= 1:
        p.error(f"--offload-search must be a grid step in (0, 1] (or 0: off), got {args.offload_search}")
    if args.offload_switch_interval < 0:
        p.error(f"--offload-switch-interval must be >= 0 seconds, got {args.offload_switch_interval}")
    if args.offload_switch_interval:
        from megatron_fsdp_v2.offload import backward_steps as offload_steps
        offload_steps.STEP_SWITCH_INTERVAL_S = args.offload_switch_interval
    OFFLOAD_OPTIONS.update(step_in_backward=bool(args.offload_step_in_backward), search_step=args.offload_search,
                           step_threads=args.offload_step_threads or None,
                           release_after_gather=args.offload_release_after_gather,
                           root_per_child=bool(args.offload_root_per_child))

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
    results_dir = RESULTS / datetime.date.today().isoformat()
    if args.out is None:
        args.out = str(results_dir / f"benchmarks_results{suffix}.md")
    if args.json is None:
        args.json = str(results_dir / f"benchmarks_results{suffix}.json")
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
    """Markdown + JSON, rewritten after every system, so a run cut short still leaves its results."""
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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_systems:
        for s in all_systems(args.offload_fractions):
            print(f"{s.name:36s} {s.description}")
        return 0
    relaunch_under_torchrun(args)
    quiet_libraries(args.verbose)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    systems = select_systems(args.systems, args.offload_fractions)

    ctx = init_distributed(args)
    with contextlib.ExitStack() as stack:
        prepare_process(ctx, stack)
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
            command=" ".join(["python", *map(shlex.quote, sys.argv)]),
            notes=cpu_notes(),
        )
        ctx.log(f"GPTModel {ctx.num_params / 1e6:.1f}M params; {len(systems)} systems; world {ctx.world}"
                f"{' (fake)' if ctx.fake else ''}; device {meta['device_name']}")
        results = []
        t_all = time.perf_counter()
        def run_one(system: System) -> Dict[str, Any]:
            """One system (skipped once the time budget is used up); the partial outputs rewritten."""
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
                    + (f"  step {r['step_ms']:.1f} ms  peak {_fmt(r.get('peak_gib'))} / reserved "
                       f"{_fmt(r.get('reserved_gib'))} GiB  "
                       f"state {_fmt(r.get('state_gib'))} GiB  loss {_fmt(r.get('loss_last'), '.3f')}  "
                       f"[{time.perf_counter() - T_START:.0f} s]"
                       if r.get("step_ms") else f"  {r.get('error')}"))
            if ctx.rank == 0:
                meta["total_s"] = time.perf_counter() - t_all
                write_outputs(ctx, meta, results, final=False)
            return r

        for system in systems:
            if system.kind == "ours_search":          # its runs are rows of their own (bench_offload.py)
                search_smallest_fraction(system, run_one, list(results), meta["notes"])
            else:
                run_one(system)
        meta["total_s"] = time.perf_counter() - t_all
        meta["wall_s"] = time.perf_counter() - T_START
        meta["notes"].extend(offload_goals(results))
        meta["notes"].extend(loss_agreement(results))
        if ctx.rank == 0:
            write_outputs(ctx, meta, results)
            print(f"systems {meta['total_s']:.0f} s, process {meta['wall_s']:.0f} s")

    finish_process()
    return 0


if __name__ == "__main__":
    sys.exit(main())
