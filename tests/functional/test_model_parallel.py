"""Our wrapper composed with Megatron's tensor and pipeline parallelism on the hardware: the loss
model (bf16 on GPUs) at TP2 and at PP2 (1F1B, tied embeddings across the two stages), the rest of
the world data parallel, a few iterations of every strategy against Megatron DDP at the same layout,
losses and grad norms within the suite's 1%.

At 2 GPUs these layouts leave one data-parallel rank (what the shards then exercise is the
composition: the groups, the tied-embedding sum, the pipeline schedule on our hooks); from 4 GPUs on
the data-parallel group has 2 or more ranks. The CPU suite checks the same at TP2xDP2, PP2xDP2,
TP2xPP2xDP2 in fp32 and to 1e-5 (tests/unit/test_megatron_model_parallel.py).

Megatron's parallel state is re-initialised for each layout and put back to TP1 x PP1 afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from . import harness
from .harness import LOSS_RTOL, STRATEGIES
from .training import _global_mean, _optimizer_config, adapter_status

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


@contextlib.contextmanager
def _parallel_state(world, tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    def initialize(tp_size, pp_size):
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size)
        if harness.smoke_mode():
            from testing.cpu_compat import cpu_model_parallel_manual_seed

            cpu_model_parallel_manual_seed(1234)
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)

    initialize(tp, pp)
    try:
        yield
    finally:
        initialize(1, 1)


def _build(spec, world, tp: int, pp: int):
    """This rank's stage of the loss model at (tp, pp), on the device (bf16: inside Float16Module)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from testing.megatron_gpt import local_gpt

    config = dataclasses.replace(harness.transformer_config(spec), tensor_model_parallel_size=tp,
                                 pipeline_model_parallel_size=pp)
    harness.reseed(spec.model_seed)
    gpt = local_gpt(config, spec.vocab, spec.seq, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage()).to(world.device)
    return (Float16Module(config, gpt) if spec.bf16 else gpt), config


def _train(spec, world, tp: int, pp: int, strategy):
    """(losses on the last stage or None, grad norms) of Megatron DDP (``strategy`` None) or ours."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from testing.megatron_gpt import megatron_train_step

    module, config = _build(spec, world, tp, pp)
    if strategy is None:
        wrapped = DistributedDataParallel(config=config, module=module, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
        optimizer = get_megatron_optimizer(_optimizer_config(spec), [wrapped])
    else:
        wrapped = FullyShardedDataParallel(config, DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy, grad_reduce_in_fp32=True, overlap_grad_reduce=True), module)
        config.no_sync_func = wrapped.no_sync
        optimizer = get_optimizer(_optimizer_config(spec), [wrapped])
    config.finalize_model_grads_func = finalize_model_grads
    config.batch_p2p_comm = not harness.smoke_mode()      # gloo: one p2p op at a time
    data = harness.batches(spec, ps.get_data_parallel_rank(), world)
    k, losses, norms = spec.micro_batches, [], []
    for it in range(spec.iters):
        store, ok, norm = megatron_train_step(wrapped, optimizer, data[it * k:(it + 1) * k], spec.seq,
                                              spec.micro_batch_size)
        assert ok, f"optimizer step {it} was skipped"
        if store:
            total = torch.zeros(2, dtype=torch.float64, device=world.device)
            for item in store:
                total += item["lm loss"].to(device=world.device, dtype=torch.float64)
            losses.append(_global_mean(total, world, ps.get_data_parallel_group()))
        norms.append(float(norm))
    config.no_sync_func = config.finalize_model_grads_func = None
    del wrapped, optimizer, module
    harness.release_memory(world)
    return (losses or None), norms


_RESULTS: dict = {}


def _results(world, layout: str) -> dict:
    """Megatron DDP's and every strategy's curve at ``layout``, trained once per session."""
    if layout not in _RESULTS:
        tp, pp = LAYOUTS[layout]
        spec = harness.short_spec()
        patches = contextlib.ExitStack()
        if harness.smoke_mode():
            from testing.cpu_compat import patch_megatron_for_cpu

            patches.enter_context(patch_megatron_for_cpu("megatron.core.pipeline_parallel.p2p_communication"))
        with patches, _parallel_state(world, tp, pp):
            _RESULTS[layout] = {name: _train(spec, world, tp, pp, None if name == "megatron_ddp" else name)
                                for name in ("megatron_ddp",) + STRATEGIES}
    return _RESULTS[layout]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_model_parallel_matches_megatron_ddp(world, layout, strategy):
    tp, pp = LAYOUTS[layout]
    if world.size % (tp * pp):
        pytest.skip(f"{layout} needs a world size divisible by {tp * pp}, got {world.size}")
    usable, text = adapter_status()
    if not usable:
        pytest.skip(f"model parallelism goes through the Megatron adapter: {text}")
    results = _results(world, layout)
    (ref_losses, ref_norms), (losses, norms) = results["megatron_ddp"], results[strategy]
    everyone = harness.all_gather_object((ref_losses, ref_norms, losses, norms))
    for rank, (ref_losses, ref_norms, losses, norms) in enumerate(everyone):
        assert all(math.isfinite(x) for x in norms), (rank, norms)
        assert norms == pytest.approx(ref_norms, rel=LOSS_RTOL), (layout, strategy, rank, norms, ref_norms)
        if ref_losses is None:                  # not the last pipeline stage
            assert losses is None, (layout, strategy, rank)
            continue
        assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), (layout, strategy, rank, losses, ref_losses)
