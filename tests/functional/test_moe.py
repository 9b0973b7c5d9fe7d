"""Expert parallelism on the hardware: the tiny fp32 MoE GPT of tests/unit/test_megatron_moe.py
(4 experts, top-2 router with the auxiliary loss, alltoall dispatcher, local spec) at EP2, the rest
of the world data parallel, trained next to Megatron DDP + Megatron's optimizer for every strategy
(``compare_with_megatron_ddp``): losses and grad norms within 1e-4 relative, every
weight of this rank (its experts) within rtol = atol = 1e-4 (CUDA kernels and NCCL sums reorder
fp32 additions), and the expert parameters' collectives counted on their own group. The CPU suite
checks the same at EP2 x DP2 and EP2 x TP2 to 1e-5.

Megatron's parallel state is re-initialised at EP2 and put back to TP1 x PP1 afterwards. On two GPUs:
``torchrun --nproc-per-node 2 -m pytest tests/functional/test_moe.py``; a dry run on gloo:
``FUNCTIONAL_CPU_SMOKE=1`` in front of the same command.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from . import harness
from .harness import STRATEGIES
from .training import adapter_status

EP, RTOL = 2, 1e-4
_RESULTS: dict = {}


def compare_with_megatron_ddp(device: torch.device, ep: int, rtol: float) -> dict:
    """Megatron DDP and ours (every strategy) on the tiny MoE GPT at the parallel state already
    initialised (expert-parallel size ``ep``), on ``device``. Returns ``{strategy: (worst relative
    loss / grad-norm difference, worst excess of |weight difference| over rtol * |weight|, bytes the
    expert group moved, ok on every rank)}`` and, under ``"megatron_ddp"``, the reference losses."""
    from tests.unit import test_megatron_moe as moe

    batches = [{k: v.to(device) for k, v in b.items()} for b in moe._batches()]
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


@contextlib.contextmanager
def _expert_parallel_state(ep: int):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    def initialize(**sizes):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(**sizes)
        if harness.smoke_mode():
            from testing.cpu_compat import cpu_model_parallel_manual_seed

            cpu_model_parallel_manual_seed(1234)
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)

    initialize(expert_model_parallel_size=ep)
    try:
        yield
    finally:
        initialize()


def _results(world) -> dict:
    """Megatron DDP's and every strategy's comparison at EP2, computed once per session."""
    if not _RESULTS:
        patches = contextlib.ExitStack()
        if harness.smoke_mode():
            from testing.cpu_compat import patch_megatron_for_cpu

            patches.enter_context(patch_megatron_for_cpu("megatron.core.tensor_parallel.mappings",
                                                         "megatron.core.tensor_parallel.layers"))
        with patches, _expert_parallel_state(EP):
            _RESULTS.update(compare_with_megatron_ddp(world.device, EP, RTOL))
        harness.release_memory(world)
    return _RESULTS


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_expert_parallel_matches_megatron_ddp(world, strategy):
    if world.size % EP:
        pytest.skip(f"EP{EP} needs a world size divisible by {EP}, got {world.size}")
    usable, text = adapter_status()
    if not usable:
        pytest.skip(f"expert parallelism goes through the Megatron adapter: {text}")
    worst, weight_error, expert_bytes, ok = _results(world)[strategy]
    assert ok, (f"{strategy} at EP{EP}: loss/norm max rel diff {worst:.2e}, weights max excess over "
                f"rtol*|w| {weight_error:.2e}, expert-group bytes {expert_bytes} (limit {RTOL})")
    assert expert_bytes > 0
