"""Where float8 losses part, on tests/functional/test_float8.py's 3-block MLP: one process, one rank,
issue 47's recipe (torchao float8 without the head, bf16 compute, the scale precompute after each
step), each system's 20 losses, then the largest gaps between pairs. It separates what the wrapper
does from two effects any system shows: AdamW's foreach path (DTensor parameters) against its
single-tensor path (torchao's weight subclass held whole, ``no_shard``), and Inductor against eager.

    python3 benchmarks/float8_small_parity.py --json $OUT/float8_small_parity.json   # GPU: nccl, real float8
    python benchmarks/float8_small_parity.py --steps 2                                # CPU: gloo, emulated

Results and why: benchmarks/results/2026-12-07/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: (system, compiled, AdamW's foreach)
RUNS = {"fsdp2": ("fsdp2", "", None), "fsdp2-noforeach": ("fsdp2", "", False),
        "no_shard": ("no_shard", "", None), "no_shard-noforeach": ("no_shard", "", False),
        "fsdp2-blocks": ("fsdp2", "blocks", None), "fsdp2-model": ("fsdp2", "model", None),
        "zero3-blocks": ("optim_grads_params", "blocks", None)}
PAIRS = [("no_shard", "fsdp2"), ("no_shard-noforeach", "fsdp2-noforeach"), ("fsdp2", "fsdp2-noforeach"),
         ("fsdp2-blocks", "fsdp2"), ("fsdp2-model", "fsdp2"), ("zero3-blocks", "fsdp2-blocks")]


def train(system: str, compiled: str, foreach, steps: int, device: torch.device) -> list:
    import torchao.float8 as f8
    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard
    from tests.unit.test_float8 import WIDTH, Block, Net, wrap
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net().to(device)
    config = f8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=device.type != "cuda")
    f8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "head")
    if compiled == "blocks":
        for block in model.blocks:
            block.compile()
    model = wrap(model, "fsdp2", bf16=True) if system == "fsdp2" else fully_shard(
        model, sharding_strategy=system, unit_modules=[Block],
        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    if compiled == "model":
        model.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, WIDTH, device=device, generator=g).bfloat16()
    y = torch.randn(64, 1, device=device, generator=g)
    losses = []
    for _ in range(steps):
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        f8.precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="write every run's losses and the gaps here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    losses = {}
    for name, run in RUNS.items():
        losses[name] = train(*run, args.steps, device)
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
