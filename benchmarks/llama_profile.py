#!/usr/bin/env python3
"""Where one system's step of bench_llama.py spends its time, beside another's (issue 47's step goal)::

    python benchmarks/llama_profile.py --systems fsdp2-fp8,ours-fp8 [bench_llama.py's flags] [--trace-dir D]

Per system, after ``--warmup`` steps: each phase alone (forward, backward, ``optimizer.step()``, the
float8 scale precompute, ``zero_grad``; a device synchronize after each, median of 3), then three
steps under ``torch.profiler``: kernel time per step, the device's idle time inside the step (the
step's span less the union of its kernels), and the kernels by total time. ``--trace-dir``: one
profiled step as a chrome trace (gzipped), per system. The systems run one after the other in
one process, as bench_llama.py runs them.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_llama as B  # noqa: E402


def _phases(ctx, model, opt, after_step, repeats: int = 3) -> dict:
    """Milliseconds of each phase of a step, synchronized after each (overlap across phases is lost)."""
    rows: dict = {"forward": [], "backward": [], "optimizer.step": [], "precompute": [], "zero_grad": []}
    for _ in range(repeats):
        marks = [time.perf_counter()]
        loss = model(input_ids=ctx.tokens, labels=ctx.tokens).loss
        B.sync(ctx); marks.append(time.perf_counter())
        loss.backward()
        B.sync(ctx); marks.append(time.perf_counter())
        opt.step()
        B.sync(ctx); marks.append(time.perf_counter())
        if after_step is not None:
            after_step()
        B.sync(ctx); marks.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        B.sync(ctx); marks.append(time.perf_counter())
        for name, t0, t1 in zip(rows, marks, marks[1:]):
            rows[name].append((t1 - t0) * 1e3)
    return {k: statistics.median(v) for k, v in rows.items()}


def _busy_us(events, start_us: float, end_us: float) -> float:
    """The union of the kernels' intervals inside ``[start_us, end_us]``."""
    spans = sorted((max(e.time_range.start, start_us), min(e.time_range.end, end_us)) for e in events
                   if e.time_range.end > start_us and e.time_range.start < end_us)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


def _profiled(ctx, step, steps: int, trace: Path | None) -> str:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.is_cuda else [])
    lines = []
    with profile(activities=activities) as prof:
        walls = []
        for _ in range(steps):
            B.sync(ctx)
            t0 = time.perf_counter()
            step()
            B.sync(ctx)
            walls.append((time.perf_counter() - t0) * 1e3)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    steps_cpu = sorted((e for e in prof.events()
                        if e.name == "llama_profile.step" and e.device_type.name == "CPU"),
                       key=lambda e: e.time_range.start)[:steps]
    if kernels and steps_cpu:
        starts = [e.time_range.start for e in steps_cpu] + [float("inf")]
        for i, (s, nxt) in enumerate(zip(starts, starts[1:])):
            in_step = [k for k in kernels if s <= k.time_range.start < nxt]
            if not in_step:
                continue
            first, last = min(k.time_range.start for k in in_step), max(k.time_range.end for k in in_step)
            busy = _busy_us(in_step, first, last)
            lines.append(f"step {i}: wall {walls[i]:.1f} ms; kernels {len(in_step)}, first to last "
                         f"{(last - first) / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle inside "
                         f"{(last - first - busy) / 1e3:.1f} ms, host start to first kernel {(first - s) / 1e3:.1f} ms")
    else:
        lines.append("wall ms per step: " + ", ".join(f"{w:.1f}" for w in walls))
    sort = "self_device_time_total" if ctx.is_cuda else "self_cpu_time_total"
    lines.append(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90))
    if trace is not None:
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    return "\n".join(lines)


def profile_system(ctx, system, trace_dir: Path | None) -> str:
    notes: list = []
    model, opt, after_step = B.build_system(ctx, system, notes)

    def step() -> None:
        with torch.profiler.record_function("llama_profile.step"):
            B.train_step(ctx, model, opt, after_step)
    try:
        for _ in range(ctx.args.warmup):
            step()
        B.sync(ctx)
        phases = _phases(ctx, model, opt, after_step)
        trace = trace_dir / f"{system.name}.json.gz" if trace_dir is not None else None
        out = [f"=== {system.name}: {'; '.join(notes)}",
               "phases (ms, synchronized after each, median of 3): "
               + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) + f"; sum {sum(phases.values()):.1f}",
               _profiled(ctx, step, 3, trace)]
        if ctx.is_cuda:
            out.append(f"peak {torch.cuda.max_memory_allocated() / B.GIB:.2f} GiB")
        return "\n".join(out)
    finally:
        B.release_autograd_hooks(model, opt)
        model = opt = after_step = None
        B.release_leftover_models()
        torch._dynamo.reset()
        B.cleanup(ctx)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--trace-dir", default=None)
    own, rest = p.parse_known_args(argv)
    args = B.parse_args(rest + ["--out", "", "--json", ""])
    if not args.verbose:
        import warnings
        warnings.filterwarnings("ignore")
    trace_dir = Path(own.trace_dir) if own.trace_dir else None
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
    ctx = B.init_process(args)
    try:
        B.make_batch(ctx)
        for system in B.select_systems(args.systems, args.strategies):
            print(profile_system(ctx, system, trace_dir), flush=True)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
