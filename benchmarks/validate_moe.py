"""GPU check of expert parallelism: the tiny MoE GPT of ``tests/unit/test_megatron_moe.py`` (4 experts,
top-2 router with the auxiliary loss, alltoall dispatcher, local spec, fp32) at EP2 over NCCL,
trained next to Megatron DDP + Megatron's optimizer for every strategy: losses, grad norms and
every weight of each rank (its experts) must agree within ``--rtol`` (default 1e-4: CUDA kernels
and NCCL sums reorder fp32 additions, which the CPU suite's 1e-5 does not allow for).

    torchrun --nproc-per-node 2 benchmarks/validate_moe.py            # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/validate_moe.py --cpu      # dry run on gloo (CPU patches)

Rank 0 prints one line per strategy and PASSED / FAILED; the exit code is 1 on any failure.
Recorded results: docs/validation.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _to(batches, device):
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


def compare_with_megatron_ddp(device: torch.device, ep: int, rtol: float) -> dict:
    """Megatron DDP and ours (every strategy) on the tiny MoE GPT at the parallel state already
    initialised (expert-parallel size ``ep``), on ``device``. Returns ``{strategy: (worst relative
    loss / grad-norm difference, worst excess of |weight difference| over rtol * |weight|, bytes the
    expert group moved, ok on every rank)}`` and, under ``"megatron_ddp"``, the reference losses."""
    from tests.unit import test_megatron_moe as moe

    batches = _to(moe._batches(), device)
    build = moe._moe_model

    def on_device(tp, ep_size):
        model, config = build(tp, ep_size)
        return model.to(device), config

    moe._moe_model = on_device          # the test's builders, on this device
    out = {}
    try:
        want_losses, want_norms, _, want_weights = moe._reference(1, ep, batches)
        out["megatron_ddp"] = want_losses
        for strategy in STRATEGIES:
            losses, norms, _, weights, stats, _, _ = moe._train_ours(strategy, 1, ep, batches)
            worst = max(max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, want_losses)),
                        max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norms, want_norms)))
            # weights as torch.testing.assert_close with rtol = atol = rtol: the excess of
            # |got - want| over rtol * |want| must stay below atol
            weight_error = max(float(((weights[k].float().cpu() - v.float().cpu()).abs()
                                      - rtol * v.float().cpu().abs()).max()) for k, v in want_weights.items())
            experts = stats["experts"]["total_bytes"]
            ok = worst <= rtol and weight_error <= rtol and experts > 0
            flags = torch.tensor([0 if ok else 1], device=device)
            dist.all_reduce(flags)
            out[strategy] = (worst, max(weight_error, 0.0), experts, int(flags) == 0)
    finally:
        moe._moe_model = build
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU with the test suite's Megatron patches")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size (default 2)")
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not args.cpu:
        torch.cuda.set_device(device)
    if args.cpu:
        from tests.megatron_cpu import init_megatron_parallel_state, patch_megatron_for_cpu

        patches = patch_megatron_for_cpu("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers")
    else:
        patches = contextlib.nullcontext()
    with patches:
        if args.cpu:
            init_megatron_parallel_state(world, expert_model_parallel_size=args.ep)
        else:
            ps.initialize_model_parallel(expert_model_parallel_size=args.ep)
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
        results = compare_with_megatron_ddp(device, args.ep, args.rtol)
    failures = [s for s in STRATEGIES if not results[s][3]]
    if rank == 0:
        for strategy in STRATEGIES:
            worst, weight_error, experts, ok = results[strategy]
            print(f"{strategy:20s} loss/norm max rel diff {worst:.2e}, weights max excess over rtol*|w| "
                  f"{weight_error:.2e}, expert-group bytes {experts}: {'ok' if ok else 'FAILED'}", flush=True)
        print(f"losses (Megatron DDP): {[round(x, 5) for x in results['megatron_ddp']]}")
        print(f"EP{args.ep} x DP{world // args.ep} on {world} {'CPU ranks' if args.cpu else 'GPUs'}: "
              f"{'PASSED' if not failures else 'FAILED: ' + ', '.join(failures)}")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        import traceback
        traceback.print_exc()
        sys.stdout.flush()
        raise
