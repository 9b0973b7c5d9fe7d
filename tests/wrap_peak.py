#!/usr/bin/env python3
"""Wrap-time peak, ours against torch FSDP2, from building the model to the end of the wrap (CPU, or GPU).

    python -m tests.wrap_peak                               # every case below, 8 blocks of width 512
    python -m tests.wrap_peak --world 8 --cases ours-zero3:bf16:device,fsdp2:bf16:device
    python -m tests.wrap_peak --width 1024 --json /tmp/wrap_peak.json
    python -m tests.wrap_peak --device cuda --width 4096     # on a GPU: max_memory_allocated

What a GPU run reads with ``torch.cuda.max_memory_allocated`` after resetting the peak before the
model is built (benchmarks/bench_llama.py's ``build_peak_gib``) is read here on CPU from the
allocator's events (tests/cpu_live_bytes.py, ``allocated_peak``): the running maximum of the bytes
allocated and not yet freed inside the region, exact here since everything measured comes into
being inside it. Each world size runs in turn in one child process: world 1 is a real 1-rank gloo
group, any other is rank 0 of torch's fake process group of that size (its collectives do nothing:
the bytes are a real rank's, the values are not). ``--device cuda`` runs the same cases on the GPU
(NCCL at world 1, float8 not emulated) and reads ``torch.cuda.max_memory_allocated`` above
``memory_allocated`` before the model is built.

The model (``WideStack``): an embedding of ``16 x width`` rows (the root's, as large as two
blocks: a wrap that builds the root first peaks above FSDP2, which shards the blocks first), then
``blocks`` wide two-Linear blocks and a LayerNorm, fp32, its parameters nearly all of its bytes. A case is ``system:precision:where``:

* system: ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` per block, then the root) or
  ``ours-<strategy>`` (``fully_shard(model, sharding_strategy=..., unit_modules=[WideBlock])``;
  ``zero3`` = ``optim_grads_params``, ``zero2``, ``zero1``, ``ddp``);
* precision: ``bf16`` (param dtype bf16, as both systems' MixedPrecisionPolicy) or ``float8``
  (torchao ``convert_to_float8_training(Float8LinearConfig(enable_fsdp_float8_all_gather=True,
  emulate=True))`` first, bf16 compute);
* where: ``device`` (built on the device: the CPU, or the GPU with ``--device cuda``) or ``meta``
  (built on meta; FSDP2: ``fully_shard`` then ``to_empty`` and every module's
  ``reset_parameters()``, as torchtitan does; ours: ``fully_shard`` initializes it,
  wrap/meta_init.py).

tests/unit/test_wrap_peak.py runs ZeRO-3's cases against FSDP2's through ``run_in_subprocess``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

VOCAB_PER_WIDTH = 16          # the root's embedding: 16 x width rows, as many elements as two blocks
STRATEGY_OF = {"zero3": "optim_grads_params", "zero2": "optim_grads", "zero1": "optim", "ddp": "no_shard"}
ALL_CASES = [f"{system}:{precision}:{where}" for where in ("device", "meta") for precision in ("bf16", "float8")
             for system in ("fsdp2", "ours-zero3", "ours-zero2", "ours-zero1", "ours-ddp")]


def _model_classes():
    import torch
    import torch.nn as nn

    class WideBlock(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class WideStack(nn.Module):
        def __init__(self, width: int, blocks: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB_PER_WIDTH * width, width)     # the root's, two blocks' worth
            self.blocks = nn.ModuleList(WideBlock(width) for _ in range(blocks))
            self.norm = nn.LayerNorm(width)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    return WideBlock, WideStack


def _float8(model, emulate: bool) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate))


def _reset_all(model) -> None:
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def build_and_wrap(case: str, width: int, blocks: int, mesh) -> object:
    """Build ``WideStack`` on ``mesh``'s device (or meta) and wrap it as ``case`` says; returns the
    wrapped model."""
    import torch

    system, precision, where = case.split(":")
    block_class, stack_class = _model_classes()
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else \
        torch.device("cpu")
    torch.manual_seed(0)
    with torch.device("meta" if where == "meta" else device):
        model = stack_class(width, blocks)
    if precision == "float8":
        _float8(model, emulate=device.type == "cpu")
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=policy)
        torch_fully_shard(model, mesh=mesh, mp_policy=policy)
        if where == "meta":
            model.to_empty(device=device)
            with torch.no_grad():
                _reset_all(model)
        return model
    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

    strategy = STRATEGY_OF[system.split("-", 1)[1]]
    return fully_shard(model, sharding_strategy=strategy, unit_modules=[block_class],
                       mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def _init_group(world: int, device_type: str):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        torch.cuda.set_device(0)
    if world == 1:
        from tests.dist_pool import free_port

        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore   # registers "fake"

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return init_device_mesh(device_type, (world,))


def _cuda_peak(fn) -> tuple:
    """``torch.cuda.max_memory_allocated`` during ``fn()`` above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, []


def run_cases(world: int, cases: List[str], width: int, blocks: int, top: int = 4,
              device_type: str = "cpu") -> Dict[str, dict]:
    """Each case's peak (bytes above what was live before the model was built), in this process."""
    import gc

    import torch
    import torch.distributed as dist

    from tests.cpu_live_bytes import allocated_peak

    torch.set_num_threads(1)
    mesh = _init_group(world, device_type)
    out: Dict[str, dict] = {}
    try:
        for case in cases:
            gc.collect()
            box: list = []
            run = lambda: box.append(build_and_wrap(case, width, blocks, mesh))   # noqa: E731
            peak, at_peak = _cuda_peak(run) if device_type == "cuda" else allocated_peak(run, top=top)
            model = box.pop()
            out[case] = {"peak": peak, "held_after": _held_by(model), "at_peak": at_peak}
            del model
    finally:
        dist.destroy_process_group()
    return out


def _held_by(model) -> int:
    """Bytes of the distinct storages of the model's parameters (its module attributes hold the
    main or sharded parameters between steps) and buffers."""
    storages = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        local = getattr(local, "_tensor", local)               # torchao's float8 weight wrapper
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_in_subprocess(worlds: List[int], cases: List[str], width: int, blocks: int, device_type: str = "cpu",
                      timeout: float = 300.0) -> Dict[int, Dict[str, dict]]:
    """``run_cases`` for each world size, one after the other in one fresh process (it holds one
    default process group at a time; imports and torchao's first conversion are paid once)."""
    cmd = [sys.executable, "-m", "tests.wrap_peak", "--child", "--world", ",".join(map(str, worlds)),
           "--cases", ",".join(cases), "--width", str(width), "--blocks", str(blocks), "--device", device_type]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise RuntimeError(f"wrap_peak child (worlds {worlds}) failed:\n{done.stderr[-4000:]}")
    return {int(w): r for w, r in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def _table(world: int, results: Dict[str, dict]) -> str:
    fsdp2 = {tuple(c.split(":")[1:]): r["peak"] for c, r in results.items() if c.startswith("fsdp2:")}
    lines = [f"world {world} ({'1-rank gloo' if world == 1 else 'rank 0 of a fake group'}), MiB above the start:",
             "| case | peak | / FSDP2 | parameters after | largest live at the peak |", "|---|---:|---:|---:|---|"]
    for case, r in results.items():
        ref = fsdp2.get(tuple(case.split(":")[1:]))
        ratio = f"{r['peak'] / ref:.3f}" if ref else "-"
        top = "; ".join(f"{b / 2**20:.2f} {who}" for b, who in r["at_peak"][:3])
        lines.append(f"| {case} | {r['peak'] / 2**20:.2f} | {ratio} | {r['held_after'] / 2**20:.2f} | {top} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="1,8", help="comma list of world sizes (1: gloo, else fake)")
    p.add_argument("--cases", default=",".join(ALL_CASES))
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the same cases on the GPU, read with torch.cuda.max_memory_allocated")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    worlds = [int(w) for w in args.world.split(",")]
    if args.child:
        print(json.dumps({w: run_cases(w, cases, args.width, args.blocks, device_type=args.device) for w in worlds}))
        return 0
    everything = run_in_subprocess(worlds, cases, args.width, args.blocks, args.device)
    for world, results in everything.items():
        print(_table(world, results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
