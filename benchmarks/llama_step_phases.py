#!/usr/bin/env python3
"""Where one bench_llama.py step peaks, phase by phase, for one system per process.

bench_llama.py reports one peak per system. When two systems differ, this says in which phase of
the step the difference is, and what was allocated there. It builds the system as bench_llama.py
does (same flags), trains ``--warmup`` steps, then:

- runs one step with ``torch.cuda.max_memory_allocated`` read and reset at each boundary (forward,
  backward, ``optimizer.step()``, the float8 precompute, ``zero_grad``): the peak inside each phase
  and what is left after it;
- runs one more step under the CUDA allocator's memory history and breaks down what is live at its
  peak with peak_breakdown.py's ``analyze_step`` (the history starts after the build, so what the
  build allocated shows as held, without a stack).

One system per process, so that nothing one system leaves behind counts in another's numbers:

    for s in fsdp2-bf16 ours-bf16; do
        python3 benchmarks/llama_step_phases.py --systems $s --micro-batch 2 --reshard-after-forward none \\
            --out $OUT/phases_$s.md --json $OUT/phases_$s.json
    done

Results: benchmarks/results/2026-12-07d/README.md. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench_llama  # noqa: E402
import peak_breakdown  # noqa: E402

GIB = 2 ** 30


def phase_peaks(ctx, model, opt, after_step) -> List[Tuple[str, float, float]]:
    """(phase, peak GiB inside it, GiB allocated after it) for one training step."""
    dev, rows = ctx.device, []

    def boundary(name: str) -> None:
        torch.cuda.synchronize(dev)
        rows.append((name, torch.cuda.max_memory_allocated(dev) / GIB, torch.cuda.memory_allocated(dev) / GIB))
        torch.cuda.reset_peak_memory_stats(dev)

    torch.cuda.reset_peak_memory_stats(dev)
    boundary("start")
    loss = model(input_ids=ctx.tokens, labels=ctx.tokens).loss
    boundary("forward")
    loss.backward()
    boundary("backward")
    opt.step()
    boundary("optimizer.step")
    if after_step is not None:
        after_step()
        boundary("float8 precompute")
    opt.zero_grad(set_to_none=True)
    boundary("zero_grad")
    return rows


def traced_step(ctx, model, opt, after_step) -> Dict:
    """One step under the memory history, analyzed as peak_breakdown.py analyzes bench_gpt.py's."""
    dev = ctx.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    hook = model.register_forward_hook(lambda *_: peak_breakdown._phase_marker("backward", dev))
    try:
        torch.cuda.reset_peak_memory_stats(dev)
        peak_breakdown._record_history("all", 400000, clear=True)
        start = torch.cuda.memory._snapshot()
        baseline = torch.cuda.memory_stats(dev).get("requested_bytes.all.current")
        peak_breakdown._phase_marker("forward", dev)
        model(input_ids=ctx.tokens, labels=ctx.tokens).loss.backward()
        peak_breakdown._phase_marker("optimizer.step", dev)
        opt.step()
        if after_step is not None:
            after_step()
        peak_breakdown._phase_marker("zero_grad", dev)
        opt.zero_grad(set_to_none=True)
        peak_breakdown._phase_marker("end", dev)
        torch.cuda.synchronize(dev)
        snapshot = torch.cuda.memory._snapshot()
        peak_breakdown._record_history(None, 0)
    finally:
        hook.remove()
    return dict(max_allocated_bytes=torch.cuda.max_memory_allocated(dev),
                requested_peak_bytes=torch.cuda.memory_stats(dev).get("requested_bytes.all.peak"),
                analysis=peak_breakdown.analyze_step(snapshot, device=index,
                                                     start_blocks=peak_breakdown.device_blocks(start, index),
                                                     baseline_bytes=baseline, top=30))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", required=True, help="markdown report")
    parser.add_argument("--json", default=None, help="JSON results")
    own, rest = parser.parse_known_args(argv)
    args = bench_llama.parse_args(rest)
    if args.device == "cpu" or not torch.cuda.is_available():
        raise SystemExit("llama_step_phases.py needs a GPU: it reads the CUDA allocator's statistics")
    warnings.filterwarnings("ignore")
    systems = bench_llama.select_systems(args.systems, args.strategies)
    if len(systems) != 1:
        raise SystemExit(f"--systems must name one system (one per process), got {[s.name for s in systems]}")
    ctx = bench_llama.init_process(args)
    bench_llama.make_batch(ctx)
    notes: List[str] = []
    model, opt, after_step = bench_llama.build_system(ctx, systems[0], notes)
    for _ in range(args.warmup):
        bench_llama.train_step(ctx, model, opt, after_step)
    rows = phase_peaks(ctx, model, opt, after_step)
    result = dict(name=systems[0].name, description=systems[0].description, status="ok", error=None,
                  phases=rows, notes=notes, command=" ".join(["python3", *sys.argv]))
    result.update(traced_step(ctx, model, opt, after_step))
    lines = [f"command: `{result['command']}`", "", "| phase | peak GiB | allocated after GiB |", "|---|---:|---:|"]
    lines += [f"| {name} | {peak:.3f} | {after:.3f} |" for name, peak, after in rows]
    text = "\n".join(lines) + "\n\n" + peak_breakdown.system_markdown(result, top=30)
    print(text)
    with open(own.out, "w") as f:
        f.write(text)
    if own.json:
        with open(own.json, "w") as f:
            json.dump(result, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
