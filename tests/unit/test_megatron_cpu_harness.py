"""The Megatron CPU harness: a tiny GPTModel trained on 2 gloo ranks through Megatron's own
``get_forward_backward_func()`` schedule and ``finalize_model_grads`` (see tests/megatron_cpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.megatron_cpu import reference_worker, run_distributed, synthetic_batches  # noqa: E402

ITERS, NMB, MBS, SEQ, VOCAB = 3, 2, 2, 16, 64

# (ddp wrapper, optimizer, clip_grad, lr)
RUNS = {
    "megatron_ddp_sgd": dict(ddp="megatron", optimizer="sgd", clip_grad=0.0, lr=0.5),
    "torch_ddp_sgd": dict(ddp="torch", optimizer="sgd", clip_grad=0.0, lr=0.5),
    "megatron_ddp_megatron_sgd": dict(ddp="megatron", optimizer="megatron_sgd", clip_grad=0.0, lr=0.5),
    "megatron_ddp_megatron_adam_clip": dict(
        ddp="megatron", optimizer="megatron_adam", clip_grad=0.5, lr=1e-2
    ),
}


def _runs_worker(rank, world_size, runs, common):
    """Train every configuration in ``runs`` on this rank; also check the patches are undone."""
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as mutils

    out = {}
    for name, spec in runs.items():
        out[name] = reference_worker(rank, world_size, {**common, **spec})
    out["patches_undone"] = (
        schedules.torch is torch
        and mutils.GlobalMemoryBuffer.get_tensor.__module__ == "megatron.core.utils"
    )
    return out


@pytest.fixture(scope="module")
def two_rank_runs():
    common = dict(iters=ITERS, num_microbatches=NMB, micro_batch_size=MBS, seq=SEQ, vocab=VOCAB,
                  model_seed=1234, data_seed=100)
    return run_distributed(_runs_worker, 2, RUNS, common)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_rank_training_through_megatron_schedule(two_rank_runs):
    r0, r1 = two_rank_runs
    assert r0["patches_undone"] and r1["patches_undone"]
    for name in RUNS:
        a, b = r0[name]["result"], r1[name]["result"]
        assert len(a.losses) == ITERS
        assert all(math.isfinite(x) for x in a.losses + a.local_losses), name
        # Reported loss (Megatron style: token-mean over micro-batches and DP) is the same on
        # both ranks; the local losses differ because every rank gets different data.
        assert a.losses == b.losses, name
        assert a.local_losses != b.local_losses, name
        assert a.losses[-1] < a.losses[0], (name, a.losses)
        # Same initial weights everywhere, and after the DP all-reduce the weights stay equal.
        assert _max_diff(r0[name]["init_state"], r1[name]["init_state"]) == 0.0
        assert _max_diff(a.state_dict, b.state_dict) == 0.0, name
        assert _max_diff(a.state_dict, r0[name]["init_state"]) > 0.0, name


def test_megatron_ddp_matches_torch_ddp_and_megatron_optimizer(two_rank_runs):
    r0 = two_rank_runs[0]
    meg = r0["megatron_ddp_sgd"]["result"]
    tor = r0["torch_ddp_sgd"]["result"]
    msgd = r0["megatron_ddp_megatron_sgd"]["result"]
    assert _max_diff(meg.state_dict, tor.state_dict) < 1e-5
    assert _max_diff(meg.state_dict, msgd.state_dict) < 1e-5
    assert max(abs(x - y) for x, y in zip(meg.losses, tor.losses)) < 1e-5
    # The Megatron (Chained/FP32) optimizer computes a finite global grad norm every step.
    adam = r0["megatron_ddp_megatron_adam_clip"]["result"]
    assert all(g is not None and math.isfinite(g) and g > 0 for g in adam.grad_norms)
    assert adam.grad_norms == two_rank_runs[1]["megatron_ddp_megatron_adam_clip"]["result"].grad_norms


def test_dp2_equals_one_rank_with_all_microbatches(two_rank_runs):
    """Grad semantics: DP mean of micro-batch sums == one rank running all 4 micro-batches."""
    per_rank = [synthetic_batches(100 + r, ITERS * NMB, MBS, SEQ, VOCAB) for r in range(2)]
    merged = []
    for it in range(ITERS):
        for r in range(2):
            merged += per_rank[r][it * NMB : (it + 1) * NMB]
    spec = dict(iters=ITERS, num_microbatches=2 * NMB, seq=SEQ, vocab=VOCAB, model_seed=1234,
                batches=merged, **RUNS["megatron_ddp_sgd"])
    (single,) = run_distributed(reference_worker, 1, spec)
    dp2 = two_rank_runs[0]["megatron_ddp_sgd"]["result"]
    assert max(abs(x - y) for x, y in zip(single["result"].losses, dp2.losses)) < 1e-5
    assert _max_diff(single["result"].state_dict, dp2.state_dict) < 1e-5


def _boom(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def test_run_distributed_reraises_worker_traceback():
    with pytest.raises(RuntimeError, match="boom from rank 1"):
        run_distributed(_boom, 2)
