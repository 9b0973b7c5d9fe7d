"""``--optimizer muon`` through ``megatron_fsdp_v2.megatron.get_optimizer``: Megatron's own Muon (its
QKV split, spectral scale, fp32 Newton-Schulz) on a tiny Megatron GPT whose MLP has 37 rows (split
19/18 at dp 2), against Megatron DDP + ``get_megatron_optimizer`` with the same config (its Muon on
whole matrices on every rank): bitwise equal weights and losses.

Bitwise needs gradients reduced in the same order: at dp 2 a sum of two is the same either way, so
one micro-batch per step compares every strategy, and two micro-batches (the first in ``no_sync()``)
compare ``no_shard`` and ``optim``, which reduce once per step as Megatron DDP does. ZeRO-2/3 with
two micro-batches reduce each one ((a1 + b1) + (a2 + b2) against (a1 + a2) + (b1 + b2)): the rounding
differs, and Newton-Schulz's quintic (slope 3.4 at 0 per iteration) amplifies it in the small singular
directions to ~5e-3 after 3 steps, which no tolerance would tell from a bug. (So too at dp 3, where
the two collectives sum three values in different orders.) Rows split unevenly over 3 and 4 ranks
and ranks holding none: tests/unit/test_muon.py, through the same driver."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None or importlib.util.find_spec("emerging_optimizers") is None:
    pytest.skip("megatron-core and emerging-optimizers (the 'muon' extra) are needed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ITERS, MBS, SEQ, VOCAB, FFN = 3, 2, 16, 64, 37
LR, WD = 3e-3, 0.1


def _opt_config(**kwargs):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, bf16=False, fp16=False, params_dtype=torch.float32,
                           use_distributed_optimizer=False, adam_eps=1e-6, clip_grad=0.0, **kwargs)


def _build_ours(strategy, layer_wise=False):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from tests.megatron_cpu import build_tiny_gpt, constant_param_scheduler

    model, config = build_tiny_gpt(1234, vocab=VOCAB, seq=SEQ, ffn_hidden_size=FFN)
    wrapped = FullyShardedDataParallel(config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy),
                                       model)
    # what Megatron-LM's validation makes of --optimizer muon --use-distributed-optimizer
    optimizer = get_optimizer(_opt_config(use_layer_wise_distributed_optimizer=layer_wise), [wrapped])
    constant_param_scheduler(optimizer, LR, WD)
    return wrapped, config, optimizer


def _iterations(wrapped, config, optimizer, batches, nmb, iterations):
    """Megatron-LM's iteration (zero_grad_buffer, its schedule, optimizer.step()) over ``iterations``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.megatron_cpu import _reduce_lm_loss, forward_step_func

    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    losses, step_bytes = [], []
    for it in iterations:
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        store = get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=iter(batches[it * nmb:(it + 1) * nmb]), model=[wrapped],
            num_microbatches=nmb, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        losses.append(_reduce_lm_loss(store, ps.get_data_parallel_group())[0])
        wrapped.reset_comm_stats()
        ok, _, _ = optimizer.step()
        assert ok
        step_bytes.append(wrapped.comm_stats()["all_to_all"])
    config.no_sync_func = config.finalize_model_grads_func = None
    return losses, step_bytes


def _train_ours(strategy, batches, nmb):
    """(Two micro-batches: with use_layer_wise_distributed_optimizer, which the strategy honours.)"""
    from megatron_fsdp_v2.megatron.adapter import ORIGINAL_SHAPE_ATTR

    wrapped, config, optimizer = _build_ours(strategy, layer_wise=nmb > 1)
    losses, step_bytes = _iterations(wrapped, config, optimizer, batches, nmb, range(ITERS))
    muon = [leaf.optimizer for leaf in optimizer.chained_optimizers
            if type(leaf.optimizer).__name__.startswith("RowPieces")]
    matrices = [p for group in muon[0].param_groups for p in group["params"]] if muon else []
    qkv = sorted(bool(getattr(p, "is_qkv", False)) for p in matrices)
    numel = sum(torch.Size(getattr(p, ORIGINAL_SHAPE_ATTR, None) or p.shape).numel() for p in matrices)
    return dict(losses=losses, state=wrapped.state_dict(), step_bytes=step_bytes, qkv=qkv, numel=numel)


def checkpoint_worker(rank, world, path):
    """Megatron's dist_checkpointing (torch_dist) of the Muon optimizer: saved by ZeRO-1 after 2
    iterations, loaded into ZeRO-3; the third iteration of both must agree bitwise (momentum restored)."""
    from megatron_fsdp_v2.megatron import load_dist_checkpoint, save_dist_checkpoint
    from tests.megatron_cpu import (destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, synthetic_batches)

    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world)
        try:
            batches = synthetic_batches(100 + rank, ITERS, MBS, SEQ, VOCAB)
            saved, config, optimizer = _build_ours("optim")
            _iterations(saved, config, optimizer, batches, 1, range(ITERS - 1))
            save_dist_checkpoint(path, saved, optimizer)
            going_on = _iterations(saved, config, optimizer, batches, 1, [ITERS - 1])[0]
            loaded, config, other = _build_ours("optim_grads_params")
            load_dist_checkpoint(path, loaded, other)
            resumed = _iterations(loaded, config, other, batches, 1, [ITERS - 1])[0]
            want, got = saved.state_dict(), loaded.state_dict()
            from torch.distributed.checkpoint import FileSystemReader
            keys = FileSystemReader(path).read_metadata().state_dict_metadata
            momentum = sorted(k for k in keys if ".optimizer.state.momentum_buffer." in k)
            return going_on, resumed, [k for k in want if not torch.equal(want[k], got[k])], momentum
        finally:
            destroy_megatron_parallel_state()


def muon_worker(rank, world):
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, synthetic_batches, train_reference)

    out = {}
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world)
        try:
            for nmb, strategies in ((1, STRATEGIES), (2, ("no_shard", "optim"))):
                batches = synthetic_batches(100 + rank, ITERS * nmb, MBS, SEQ, VOCAB)
                model, config = build_tiny_gpt(1234, vocab=VOCAB, seq=SEQ, ffn_hidden_size=FFN)
                ref = train_reference(model, config, batches, nmb, ITERS, LR, optimizer="megatron_muon",
                                      weight_decay=WD, adam_eps=1e-6)
                for strategy in strategies:
                    out[(nmb, strategy)] = (ref._asdict(), _train_ours(strategy, batches, nmb))
            return out
        finally:
            destroy_megatron_parallel_state()


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(muon_worker, 2, timeout=600)


@pytest.mark.parametrize("nmb,strategy", [(1, s) for s in STRATEGIES] + [(2, "no_shard"), (2, "optim")])
def test_megatron_muon_equals_megatron_ddp(two_ranks, nmb, strategy):
    for out in two_ranks:
        ref, got = out[(nmb, strategy)]
        assert sorted(got["state"]) == sorted(ref["state_dict"])
        for key, want in ref["state_dict"].items():
            assert torch.equal(got["state"][key], want), (key, (got["state"][key] - want).abs().max().item())
        assert got["losses"] == ref["losses"] and got["losses"][-1] < got["losses"][0]
        assert got["qkv"].count(True) == 2            # each layer's QKV split, tagged on its whole shape
        theory = {"count": 2, "bytes": 2 * 4 * got["numel"]} if strategy != "no_shard" else {"count": 0, "bytes": 0}
        assert got["step_bytes"] == [theory] * ITERS   # fp32 rows: Megatron's Newton-Schulz takes fp32 only


@pytest.mark.parametrize("field,value,flag", [("muon_tp_mode", "duplicated", "--muon-tp-mode"),
                                              ("muon_scalar_optimizer", "lion", "--muon-scalar-optimizer")])
def test_megatron_muon_refuses_what_it_cannot_honour_naming_the_flag(field, value, flag):
    from megatron_fsdp_v2.megatron import check_optimizer_config

    with pytest.raises(ValueError, match=f"{field}={value!r} \\({flag.replace('(', '[(]').replace(')', '[)]')}\\)"):
        check_optimizer_config({"optimizer": "muon", field: value}, "optim")
    check_optimizer_config({"optimizer": "muon"}, "optim")      # Megatron's defaults: accepted
    check_optimizer_config({"optimizer": "muon", "use_layer_wise_distributed_optimizer": True}, "optim")


def test_megatron_muon_checkpoint_resumes_bitwise_in_another_strategy(tmp_path):
    for going_on, resumed, differ, momentum in run_distributed(checkpoint_worker, 2, str(tmp_path / "ckpt"),
                                                               timeout=600):
        assert resumed == going_on and differ == []
        # Megatron's fully_reshardable layout (the default), behind the ChainedOptimizer's prefix
        assert len(momentum) == 5 and all(k.startswith("chained_0.optimizer.state.momentum_buffer.") for k in momentum)
