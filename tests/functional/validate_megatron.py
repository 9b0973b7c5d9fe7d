"""GPU validation of the Megatron integration (issue: drop-in wrapper + Megatron's optimizer + loop).

1. ``get_megatron_optimizer`` path + our ``FullyShardedDataParallel``: a bf16 GPT of a few hundred
   million parameters, 20 iterations per strategy, against Megatron's own DDP + distributed
   optimizer; every iteration's loss must be within 1%.
2. Megatron's own training loop: the launcher ``examples/pretrain_gpt.py`` end to end (under
   ``torchrun``) for each ``--data-parallel-sharding-strategy`` value.

Run on a GPU node (one process here; ``torchrun --nproc-per-node N`` for N GPUs)::

    python -m tests.functional.validate_megatron [--skip-launcher]

The model, data and training loop come from ``tests/functional/harness.py`` so the validation and
the functional suite train the same way. What it checks and recorded results: docs/validation.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # harness turns deterministic algorithms on

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
LAUNCHER = os.path.join(REPO, "examples", "pretrain_gpt.py")
# the launcher runs as a script (sys.path[0] = examples/): give it this checkout's megatron_fsdp_v2
LAUNCHER_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))

from tests.functional import harness  # noqa: E402

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def train_megatron_distributed_optimizer(spec, world):
    """Megatron's DDP with ``use_distributed_optimizer=True`` + ``get_megatron_optimizer``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    module, config, _ = harness.build_gpt(spec, world)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True)
    wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    opt_config = dataclasses.replace(harness._optimizer_config(spec), use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt_config, [wrapped])
    losses, _ = harness._megatron_schedule_loop(wrapped, config, optimizer, spec, world)
    del wrapped, optimizer, module
    harness.release_memory(world)
    return losses


def compare_losses(world, spec) -> bool:
    params = None
    t0 = time.perf_counter()
    reference = train_megatron_distributed_optimizer(spec, world)
    curves = {"megatron DDP + distributed optimizer": (reference, time.perf_counter() - t0)}
    for strategy in STRATEGIES:
        t0 = time.perf_counter()
        losses, _, _ = harness._train_with_adapter(spec, world, strategy)
        harness.release_memory(world)
        curves[strategy] = (losses, time.perf_counter() - t0)
    if params is None:
        module, _, _ = harness.build_gpt(spec, world)
        params = sum(p.numel() for p in module.parameters())
        del module
        harness.release_memory(world)
    ok = True
    if world.rank == 0:
        print(f"GPT {params / 1e6:.1f}M parameters: {spec.layers} layers, hidden {spec.hidden}, seq {spec.seq}, "
              f"vocab {spec.vocab}, bf16, k={spec.micro_batches} micro-batches of {spec.micro_batch_size}, "
              f"{spec.iters} iterations, world size {world.size}, {world.gpu_name}")
        header = "iter | " + " | ".join(curves)
        print(header)
        for it in range(spec.iters):
            print(f"{it:4d} | " + " | ".join(f"{curves[name][0][it]:.5f}" for name in curves))
        for strategy in STRATEGIES:
            gap = max(abs(a - b) / abs(b) for a, b in zip(curves[strategy][0], reference))
            status = "ok" if gap < 0.01 else "FAIL"
            ok &= gap < 0.01
            print(f"{strategy:20s} max relative gap to Megatron DDP + distributed optimizer: {gap * 100:.4f}% "
                  f"[{status}] ({curves[strategy][1]:.1f} s)")
    return ok


LAUNCHER_ARGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
                 "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 8 --train-iters 5 "
                 "--lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --bf16 --vocab-size 4096 --mock-data "
                 "--log-interval 1 --eval-iters 0 --eval-interval 1000 --transformer-impl local "
                 "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion --split 100,0,0")


def run_launcher(nproc: int) -> bool:
    ok = True
    for strategy in STRATEGIES:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port=29577",
               LAUNCHER, "--data-parallel-sharding-strategy", strategy,
               *LAUNCHER_ARGS.split()]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=LAUNCHER_ENV)
        lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "lm loss" in l or "iteration" in l]
        print(f"pretrain_gpt --data-parallel-sharding-strategy {strategy}: exit {proc.returncode} "
              f"({time.perf_counter() - t0:.1f} s)")
        for line in lines[-5:]:
            print("   ", line.strip()[:200])
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-3000:])
            ok = False
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip-launcher", action="store_true")
    parser.add_argument("--skip-losses", action="store_true")
    args = parser.parse_args()
    ok = True
    if not args.skip_losses:
        world = harness.setup_world()
        spec = harness.GPTSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                               vocab=args.vocab, micro_batch_size=2, micro_batches=2, iters=args.iters, lr=1e-4)
        ok &= compare_losses(world, spec)
        nproc = world.size
        harness.teardown_world()
    else:
        nproc = torch.cuda.device_count()
    if not args.skip_launcher and int(os.environ.get("RANK", "0")) == 0 and "LOCAL_RANK" not in os.environ:
        ok &= run_launcher(max(nproc, 1))
    print("VALIDATION", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
