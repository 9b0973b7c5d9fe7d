"""Exactly the collectives of the strategy table, per micro-batch and per step, and little padding."""

import contextlib

import pytest
import torch

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard
from megatron_fsdp_v2.comm import COLLECTIVES, CommStats

from tests.comm_counter import CollectiveCounter
from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn, train

K = 3


def count_phases_worker(rank, world_size, strategy, k=K):
    """Per phase of step 2 (warm): collectives seen by the dispatch counter and by comm_stats."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(depth=3), sharding_strategy=strategy, unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    phases = {}
    counter = CollectiveCounter()
    for step in range(2):
        model.reset_comm_stats()
        for i, (x, y) in enumerate(make_batches(step, rank, k)):
            with (model.no_sync() if i < k - 1 else contextlib.nullcontext()):
                with counter:
                    out = model(x)
                phases[(step, i, "forward")] = counter.take()
                with counter:
                    loss_fn(out, y).backward()
                phases[(step, i, "backward")] = counter.take()
        with counter:
            opt.step()
        phases[(step, "step")] = counter.take()
        opt.zero_grad()
        stats = model.comm_stats()
    groups = model._fsdp_engine.groups
    padded = [g.layout.total_numel for g in groups]
    true_numel = sum(p.numel() for g in groups for p in g.params)
    return phases, stats, padded, true_numel


def _expected(strategy, i, phase, k, n_units, group_bytes):
    """The strategy table, for one phase of one micro-batch (i) of a step with k micro-batches."""
    last = i == k - 1
    total = sum(group_bytes)
    if phase == "step":
        return {"all_gather": (n_units, total)} if strategy in ("optim", "optim_grads") else {}
    if strategy == "no_shard":
        return {"all_reduce": (n_units, total)} if (phase == "backward" and last) else {}
    if strategy == "optim":
        return {"reduce_scatter": (n_units, total)} if (phase == "backward" and last) else {}
    if strategy == "optim_grads":
        return {"reduce_scatter": (n_units, total)} if phase == "backward" else {}
    # optim_grads_params: per unit an all-gather before forward and before backward, a
    # reduce-scatter after backward, every micro-batch
    if phase == "forward":
        return {"all_gather": (n_units, total)}
    return {"all_gather": (n_units, total), "reduce_scatter": (n_units, total)}


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_collectives_per_phase_match_the_strategy_table(strategy):
    phases, stats, padded, _ = run_distributed(count_phases_worker, 2, strategy)[0]
    group_bytes = [4 * n for n in padded]
    n_units = len(padded)
    assert n_units == 4   # root + 3 Blocks, one fp32 trainable group each
    for i in range(K):
        for phase in ("forward", "backward"):
            assert phases[(1, i, phase)] == _expected(strategy, i, phase, K, n_units, group_bytes), (i, phase)
    assert phases[(1, "step")] == _expected(strategy, 0, "step", K, n_units, group_bytes)
    # comm_stats agrees with the independent counter over the whole step
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        count = sum(phases[key].get(name, (0, 0))[0] for key in phases if key[0] == 1)
        nbytes = sum(phases[key].get(name, (0, 0))[1] for key in phases if key[0] == 1)
        # the step's all-gather is issued inside opt.step(), before the next reset: compare calls
        # made during micro-batches only
        mb_count = sum(phases[key].get(name, (0, 0))[0] for key in phases if key[0] == 1 and key[1] != "step")
        mb_bytes = sum(phases[key].get(name, (0, 0))[1] for key in phases if key[0] == 1 and key[1] != "step")
        step_count = phases[(1, "step")].get(name, (0, 0))[0]
        assert stats[name]["count"] == mb_count + step_count, name
        assert stats[name]["bytes"] == mb_bytes + phases[(1, "step")].get(name, (0, 0))[1], name
        assert count == stats[name]["count"] and nbytes == stats[name]["bytes"]
    # every byte of this fp32 model is fp32
    assert stats["bytes_by_dtype"] == {name: {"torch.float32": stats[name]["bytes"]}
                                       for name in COLLECTIVES if stats[name]["count"]}, stats


def test_optim_issues_nothing_before_the_last_microbatch():
    phases, *_ = run_distributed(count_phases_worker, 2, "optim", 4)[0]
    for i in range(3):
        assert phases[(1, i, "forward")] == {} and phases[(1, i, "backward")] == {}
    assert phases[(1, 3, "backward")]["reduce_scatter"][0] == 4


def reduce_outputs_worker(rank, world_size, strategy):
    """Where step 1's reduce-scatters write: (output's offset into the input's storage, or None
    for a separate buffer, in elements; the shard's size) per call, and the trained weights."""
    from megatron_fsdp_v2.comm import collectives

    seen = []
    original = collectives.reduce_scatter_single

    def recording(out, full, **kwargs):
        same = out.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        seen.append((out.storage_offset() - full.storage_offset() if same else None, out.numel()))
        return original(out, full, **kwargs)

    collectives.reduce_scatter_single = recording
    try:
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(depth=3), sharding_strategy=strategy, unit_modules=[Block])
        train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), rank, steps=2, k=1)
    finally:
        collectives.reduce_scatter_single = original
    return seen, model.full_state_dict()


def test_optim_reduces_in_place_into_its_own_region_of_the_gradient_buffer():
    """ZeRO-1 reduce-scatters its whole gradient buffer into this rank's region of it (no shard-size
    temporary and no copy after), and trains as ZeRO-2, which reduces into a separate shard."""
    optim = run_distributed(reduce_outputs_worker, 2, "optim")
    for rank, (seen, _) in enumerate(optim):
        assert len(seen) == 2 * 4, seen                     # 2 steps x 4 groups (3 units and the root)
        assert all(offset == rank * shard for offset, shard in seen), seen
    zero2 = run_distributed(reduce_outputs_worker, 2, "optim_grads")
    assert all(offset is None for offset, _ in zero2[0][0])
    for name, tensor in optim[0][1].items():
        assert torch.equal(tensor, zero2[0][1][name]), name


def test_bytes_moved_are_the_padded_buffers_at_dp4():
    """Each collective moves exactly the layout's padded buffers: every parameter cut into dp pieces
    of ``ceil(rows / dp)`` rows (torch.chunk's, as FSDP2 pads; < 0.3% on LLM shapes at dp <= 256:
    docs/benchmarks_history.md, "ZeRO-1/2 per-parameter shards"). This toy's parameters have few rows, so at dp 4 it pads 17%."""
    phases, stats, padded, true_numel = run_distributed(count_phases_worker, 4, "optim_grads")[0]
    moved_per_collective = stats["all_gather"]["bytes"]      # one all-gather of every group per step
    assert moved_per_collective == 4 * sum(padded)
    assert moved_per_collective == 15200      # bytes: 4 B x sum over parameters of 4 ceil(rows / 4) rows
    assert true_numel == 3248                 # elements: 15200 B pads 17% over 12992 B
    assert stats["reduce_scatter"]["bytes"] == K * moved_per_collective


# ---------------------------------------------------------------- bytes by dtype, and what a replay adds
def test_bytes_by_dtype_name_what_the_bytes_are():
    """A collective's bytes split by dtype; a byte buffer counts as what it carries (an extension
    group's float8 and bf16 outputs gathered as uint8), never as uint8; reset empties the split."""
    stats = CommStats()
    stats.record("all_gather", torch.empty(8, dtype=torch.bfloat16, device="meta"))
    stats.record("all_gather", torch.empty(40, dtype=torch.uint8, device="meta"),
                 carried={torch.float8_e4m3fn: 32, torch.bfloat16: 8})
    stats.record("reduce_scatter", torch.empty(4, dtype=torch.float32, device="meta"))
    out = stats.as_dict()
    assert out["all_gather"] == {"count": 2, "bytes": 56} and out["total_bytes"] == 72
    assert out["bytes_by_dtype"] == {"all_gather": {"torch.bfloat16": 24, "torch.float8_e4m3fn": 32},
                                     "reduce_scatter": {"torch.float32": 16}}
    stats.reset()
    assert stats.as_dict()["bytes_by_dtype"] == {} and stats.as_dict()["total_bytes"] == 0


def test_a_replayed_step_adds_what_its_capture_counted():
    """graphs/graphed_step.py's replay: ``since`` a snapshot, then ``add`` per replay (calls, bytes,
    bytes by dtype, float8 scales); the snapshot does not move with later counts."""
    stats = CommStats()
    stats.record("all_gather", torch.empty(2, dtype=torch.float32, device="meta"))
    before = stats.snapshot()
    stats.record("all_gather", torch.empty(4, dtype=torch.bfloat16, device="meta"))
    stats.record("all_reduce", torch.empty(3, dtype=torch.float32, device="meta"))
    stats.record_scales([torch.empty(1, device="meta")])
    delta = stats.since(before)
    assert before.as_dict()["bytes_by_dtype"] == {"all_gather": {"torch.float32": 8}}
    stats.add(delta)
    out = stats.as_dict()
    assert (out["all_gather"], out["all_reduce"]) == ({"count": 3, "bytes": 24}, {"count": 2, "bytes": 24})
    assert out["bytes_by_dtype"] == {"all_gather": {"torch.float32": 8, "torch.bfloat16": 16},
                                     "all_reduce": {"torch.float32": 24}}
    assert out["gather_scales"] == {"count": 2, "bytes": 8}
