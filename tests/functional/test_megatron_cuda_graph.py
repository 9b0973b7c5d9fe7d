"""Megatron's full-iteration CUDA graph (``--cuda-graph-impl full_iteration``) with our wrapper, every
strategy, on the GPU: the loss model (4 layers, hidden 512, seq 512, vocab 4096, bf16) for 8
iterations of k=2 micro-batches, Megatron-LM's ``train_step`` with ``forward_backward_func`` in
Megatron's ``FullCudaGraphWrapper`` (2 eager warm-up iterations, capture at the 3rd, replays after)
and Megatron's ``DistributedOptimizer`` stepping eagerly, against the same run without the graph.

Claim: losses, grad norms and final weights (sha256 of the full fp32 main weights on every rank) are
bitwise equal to the run without the graph. Any world size (the data-parallel group is the world).
As Megatron-LM's ``get_model`` does, the wrapper is built on the capture stream, and the RNG tracker
is the graph-safe one Megatron-LM's ``initialize`` makes with a CUDA graph (for both runs).

Without CUDA it is skipped (conftest), in the CPU smoke mode too: there is no CUDA graph on the CPU;
tests/unit/test_megatron_cuda_graphs.py runs the eager warm-up there.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from . import harness
from .harness import STRATEGIES
from .training import _global_mean

WARMUP = 2
#: What Megatron-LM's get_megatron_ddp_config adds for --use-megatron-fsdp --cuda-graph-impl full_iteration
GRAPH_DDP = dict(megatron_fsdp_cuda_graph_mode=True, fsdp_all_gather_in_start_param_sync=False)


def _spec() -> harness.GPTSpec:
    return dataclasses.replace(harness.loss_spec(), iters=8, micro_batches=2)


@pytest.fixture(scope="module")
def graph_world(world):
    """The world, with Megatron's graph-safe RNG tracker while this module runs."""
    if harness.smoke_mode() or not world.is_cuda:
        pytest.skip("Megatron's full-iteration CUDA graph needs a GPU; the CPU suite runs its eager warm-up "
                    "(tests/unit/test_megatron_cuda_graphs.py)")
    if not harness.adapter_status()[0]:
        pytest.skip(harness.adapter_status()[1])
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    try:
        yield world
    finally:
        tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def _wrap(spec, world, strategy: str, graphed: bool):
    """Our wrapper of the GPT, built as Megatron-LM's ``get_model`` builds it (on the capture stream
    with the graph), and ``get_optimizer``'s optimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.full_cuda_graph import get_shared_capture_stream

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer

    module, config, _ = harness.build_gpt(spec, world)
    config.cuda_graph_impl = "full_iteration" if graphed else "none"
    ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=True, **(GRAPH_DDP if graphed else {}))
    stream = get_shared_capture_stream() if graphed else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wrapped = FullyShardedDataParallel(config, ddp_config, module)
    torch.cuda.current_stream().wait_stream(stream)
    return wrapped, config, get_optimizer(harness._optimizer_config(spec), [wrapped])


@contextlib.contextmanager
def _forward_backward(graphed: bool):
    """``get_forward_backward_func()``, in ``FullCudaGraphWrapper`` with the graph (its class-wide
    iteration count, graph and static inputs reset before and after)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not graphed:
        yield get_forward_backward_func()
        return
    wrapper = FullCudaGraphWrapper(get_forward_backward_func(), cuda_graph_warmup_steps=WARMUP)
    wrapper.reset_cuda_graph()
    StaticBufferLoader.static_buffers = {"training": [], "validation": []}
    try:
        yield wrapper
        assert FullCudaGraphWrapper.cuda_graph["training"] is not None, "the iteration was never captured"
    finally:
        wrapper.reset_cuda_graph()
        StaticBufferLoader.static_buffers = {"training": [], "validation": []}


def _train(world, strategy: str, graphed: bool) -> tuple:
    """(losses, grad norms, sha256 of the final full weights) of Megatron-LM's train_step."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from testing.megatron_gpt import megatron_train_step

    spec = _spec()
    wrapped, config, optimizer = _wrap(spec, world, strategy, graphed)
    config.no_sync_func, config.finalize_model_grads_func = wrapped.no_sync, finalize_model_grads
    data, k = harness.batches(spec, world.rank, world), spec.micro_batches
    losses, norms = [], []
    with _forward_backward(graphed) as forward_backward:
        for it in range(spec.iters):
            store, ok, norm = megatron_train_step(wrapped, optimizer, data[it * k:(it + 1) * k], spec.seq,
                                                  spec.micro_batch_size, forward_backward)
            assert ok, f"{strategy}: Megatron's optimizer skipped step {it}"
            total = sum(item["lm loss"].to(torch.float64) for item in store)
            losses.append(_global_mean(total, world, ps.get_data_parallel_group()))
            norms.append(float(norm))
    config.no_sync_func = config.finalize_model_grads_func = None
    digest = harness.state_digest(wrapped.state_dict())
    del wrapped, optimizer
    harness.release_memory(world)
    return losses, norms, digest


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_iteration_graph_trains_bitwise_like_eager(graph_world, strategy):
    eager = _train(graph_world, strategy, graphed=False)
    graphed = _train(graph_world, strategy, graphed=True)
    runs = harness.all_gather_object((eager, graphed))
    for rank, ((losses, norms, digest), (g_losses, g_norms, g_digest)) in enumerate(runs):
        gaps = [abs(a - b) / abs(b) for a, b in zip(g_losses, losses)]
        assert (g_losses, g_norms) == (losses, norms), (
            f"{strategy} rank {rank}: the graph's losses part from eager (warm-up {WARMUP}, capture at iteration "
            f"{WARMUP + 1}); largest relative gap {max(gaps):.3e}\n graph {g_losses}\n eager {losses}\n"
            f" graph norms {g_norms}\n eager norms {norms}")
        assert g_digest == digest, f"{strategy} rank {rank}: final weights differ bitwise (losses equal)"
    assert runs[0][0][0][-1] < runs[0][0][0][0], runs[0][0][0]
