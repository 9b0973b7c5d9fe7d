#!/usr/bin/env python3
"""Padding of the two flat-buffer layouts (group/layout.py) on LLM shapes, no GPU needed.

ZeRO-1/2/3 cut every parameter by ``torch.chunk``'s rows (per-parameter shards, [Note: per-parameter
shards]); HFSDP and the layout ZeRO-1/2 had before 2026-12-04 snap row boundaries instead ([Note:
row-snapped shards]). One unit (a transformer layer, or the embedding / output layer) is one group,
as ``fully_shard(unit_modules=[Layer])`` builds it; CUDA's alignment of 64 elements.

    python benchmarks/layout_padding.py                 # markdown table on stdout
    python benchmarks/layout_padding.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_fsdp_v2.group.layout import build_layout  # noqa: E402


def llama_layer(hidden: int, intermediate: int, heads: int, kv_heads: int) -> list[tuple]:
    head_dim = hidden // heads
    return [(hidden,), (heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
            (hidden, heads * head_dim), (hidden,), (intermediate, hidden), (intermediate, hidden),
            (hidden, intermediate)]


def gpt_layer(hidden: int) -> list[tuple]:
    """Megatron GPT's local-spec layer (fused QKV, biases, two layer norms)."""
    return [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
            (hidden,), (hidden,), (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]


MODELS = {
    "Llama-3 8B layer": llama_layer(4096, 14336, 32, 8),
    "Llama-3 70B layer": llama_layer(8192, 28672, 64, 8),
    "GPT 941M layer (hidden 2048)": gpt_layer(2048),
    "Mixtral 8x7B experts of a layer": [(14336, 4096)] * 16 + [(4096, 14336)] * 8,
    "vocab 128256 x 4096 embedding": [(128256, 4096)],
    "Qwen2 0.5B layer": llama_layer(896, 4864, 14, 2),
}


def padding(shapes: list, dp: int, per_parameter: bool) -> float:
    layout = build_layout(shapes, dp, alignment=64, per_parameter=per_parameter)
    return layout.padding_numel / sum(layout.numels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default="8,64,256")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    sizes = [int(d) for d in args.dp.split(",")]
    rows = []
    print("| group | dp | per-parameter (ZeRO-1/2/3) | row-snapped (HFSDP) |\n|---|---|---|---|")
    for name, shapes in MODELS.items():
        for dp in sizes:
            per, snapped = padding(shapes, dp, True), padding(shapes, dp, False)
            rows.append({"group": name, "dp": dp, "per_parameter": per, "row_snapped": snapped})
            print(f"| {name} | {dp} | {100 * per:.3f}% | {100 * snapped:.3f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
