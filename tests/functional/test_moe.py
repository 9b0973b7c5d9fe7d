"""Expert parallelism on the hardware: the tiny fp32 MoE GPT of tests/unit/test_megatron_moe.py
(4 experts, top-2 router with the auxiliary loss, alltoall dispatcher, local spec) at EP2, the rest
of the world data parallel, trained next to Megatron DDP + Megatron's optimizer for every strategy
(``benchmarks/validate_moe.py``'s comparison): losses and grad norms within 1e-4 relative, every
weight of this rank (its experts) within rtol = atol = 1e-4 (CUDA kernels and NCCL sums reorder
fp32 additions), and the expert parameters' collectives counted on their own group. The CPU suite
checks the same at EP2 x DP2 and EP2 x TP2 to 1e-5.

Megatron's parallel state is re-initialised at EP2 and put back to TP1 x PP1 afterwards.
"""

from __future__ import annotations

import contextlib

import pytest

from . import harness
from .harness import STRATEGIES
from .training import adapter_status

EP, RTOL = 2, 1e-4
_RESULTS: dict = {}


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
        import os
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
        from validate_moe import compare_with_megatron_ddp

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
