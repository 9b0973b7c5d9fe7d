"""Where float8 losses part, on tests/functional/test_float8.py's 3-block MLP through that test's own
loop (``_train``; float8 emulated off CUDA): one process, one rank, issue 47's recipe (torchao float8
without the head, bf16 compute, the scale precompute after each step), each system's 20 losses,
then the largest gaps between pairs. It separates what the wrapper
does from two effects any system shows: AdamW's foreach path (DTensor parameters) against its
single-tensor path (torchao's weight subclass held whole, ``no_shard``), and Inductor against eager.

    python3 benchmarks/float8_small_parity.py --json $OUT/float8_small_parity.json   # GPU: nccl, real float8
    python benchmarks/float8_small_parity.py --steps 2                                # CPU: gloo, emulated

Results and why: benchmarks/results/2026-12-07b/README.md (GPU), benchmarks/results/2026-12-07/README.md (why it exists).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: (system, compiled, AdamW's foreach); ours with its fused cast on CUDA, FSDP2 with torchao's
RUNS = {"fsdp2": ("fsdp2", "", None), "fsdp2-noforeach": ("fsdp2", "", False),
        "no_shard": ("no_shard", "", None), "no_shard-noforeach": ("no_shard", "", False),
        "fsdp2-blocks": ("fsdp2", "blocks", None), "fsdp2-model": ("fsdp2", "model", None),
        "zero3-blocks": ("optim_grads_params", "blocks", None)}
PAIRS = [("no_shard", "fsdp2"), ("no_shard-noforeach", "fsdp2-noforeach"), ("fsdp2", "fsdp2-noforeach"),
         ("fsdp2-blocks", "fsdp2"), ("fsdp2-model", "fsdp2"), ("zero3-blocks", "fsdp2-blocks")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="write every run's losses and the gaps here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from tests.functional.test_float8 import _train    # the functional test's loop, model and data
    world = types.SimpleNamespace(device=torch.device("cuda", 0) if cuda else torch.device("cpu"), rank=0, size=1)
    losses = {}
    for name, (system, compiled, foreach) in RUNS.items():
        losses[name] = _train(world, system, compiled, fused=system != "fsdp2", steps=args.steps, foreach=foreach)
        print(name, [round(v, 5) for v in losses[name]], flush=True)
    gaps = {f"{a} vs {b}": max(abs(p - q) for p, q in zip(losses[a], losses[b])) for a, b in PAIRS}
    for pair, gap in gaps.items():
        print(f"max gap {pair}: {gap:.6f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(torch.cuda.get_device_name(0) if cuda else "cpu"), "steps": args.steps,
                       "losses": losses, "gaps": gaps}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
