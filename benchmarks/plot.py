#!/usr/bin/env python3
"""Bar charts of benchmarks/bench_gpt.py results (JSON written with ``--json``).

matplotlib is usually missing on the GPU box, so bench_gpt.py skips the PNG there; copy the JSON
back and run this anywhere matplotlib is installed::

    python benchmarks/plot.py benchmarks/results/DATE/benchmarks_results.json \
        [benchmarks/results/DATE/benchmarks_results_fake8.json] --png benchmarks/results/DATE/benchmarks.png

One row of panels per JSON file: median step time, peak memory, and the memory a rank keeps
between steps next to the ZeRO formula (outlined bars). Systems that failed (OOM / error /
skipped) are drawn as an empty slot labelled with their status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

COLORS = {
    "floor": "#7f7f7f",
    "ours": "#1f77b4",
    "fsdp2": "#ff7f0e",
    "megatron_ddp": "#2ca02c",
    "megatron_fsdp": "#d62728",
}


def _title(meta: Dict[str, Any]) -> str:
    mode = (f"fake PG, rank 0 of {meta['world']} (no comm)" if meta.get("fake")
            else f"{meta.get('real_world', 1)} GPU(s)")
    return (f"GPT {meta['num_params'] / 1e6:.0f}M ({meta['layers']}L, h{meta['hidden']}, s{meta['seq']}, "
            f"mb{meta['micro_batch']}) - {mode} - {meta.get('device_name', '')}")


def make_png(runs: List[Dict[str, Any]], path: str) -> None:
    """``runs``: list of ``{"meta": ..., "results": [...]}`` (bench_gpt.py's JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("step_ms", "median step time (ms)", None),
              ("peak_gib", "peak memory allocated (GiB)", None),
              ("state_gib", "kept between steps (GiB)", "expected_state_gib")]
    # Without a GPU nothing is measured: fall back to the state added up from the tensors.
    fallback = {"state_gib": "accounted_state_gib"}
    n_sys = max(len(run["results"]) for run in runs)
    fig, axes = plt.subplots(len(runs), len(panels), figsize=(6 + 0.55 * n_sys * len(panels) / 1.5, 4.2 * len(runs)),
                             squeeze=False)
    for row, run in enumerate(runs):
        results = run["results"]
        names = [r["name"] for r in results]
        colors = [COLORS.get(r["kind"], "#9467bd") for r in results]
        for col, (key, label, expected_key) in enumerate(panels):
            ax = axes[row][col]
            values = [(r.get(key) if r.get(key) is not None else r.get(fallback.get(key, "")))
                      if r.get("status") == "ok" else None for r in results]
            xs = range(len(results))
            ax.bar(xs, [v or 0.0 for v in values], color=colors)
            if expected_key:
                exp = [r.get(expected_key) for r in results]
                ax.bar(xs, [e or 0.0 for e in exp], fill=False, edgecolor="black", linewidth=1.0,
                       linestyle="--", label="ZeRO formula")
                ax.legend(fontsize=7, loc="upper right")
            top = max([v for v in values if v] + [1e-9])
            for x, (v, r) in enumerate(zip(values, results)):
                if v:
                    text = f"{v:.0f}" if key == "step_ms" else (f"{v:.1f}" if v >= 1 else f"{v:.3f}")
                else:
                    text = "n/a" if r.get("status") == "ok" else r.get("status", "?")
                ax.text(x, (v or 0.0) + 0.01 * top, text, ha="center", va="bottom", fontsize=6,
                        rotation=90 if not v else 0)
            ax.set_xticks(list(xs))
            ax.set_xticklabels(names, rotation=75, ha="right", fontsize=7)
            ax.set_ylabel(label, fontsize=8)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(axis="y", alpha=0.3)
        axes[row][0].set_title(_title(run["meta"]), fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot bench_gpt.py JSON results.")
    p.add_argument("json", nargs="+", help="results JSON file(s) from bench_gpt.py --json")
    p.add_argument("--png", default=None, help="output PNG (default: benchmarks.png next to the first JSON)")
    args = p.parse_args(argv)
    if args.png is None:
        args.png = os.path.join(os.path.dirname(args.json[0]), "benchmarks.png")
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    make_png(runs, args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
