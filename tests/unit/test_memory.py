"""Persistent bytes per rank follow the formula in docs/design.md; ZeRO-3 keeps only shards; the
gradient buffers live only as long as the optimizer's ``.grad`` views (``zero_grad(set_to_none=True)``
frees them, as FSDP2 does) unless ``persistent_grads=True``."""

import math

import pytest
import torch

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from tests.design_sizes import design_persistent_bytes

from .dist_utils import run_distributed
from .models import Block, UnevenNet
from .scenarios import sharded_run


def memory_worker(rank, world_size):
    out = {}
    for strategy in STRATEGY_NAMES:
        # zero_grad(set_to_none=False): the .grad views (hence the buffers) stay
        model, _ = sharded_run(rank, strategy, steps=2, k=2, opt_name="adamw", zero_grad_to_none=False)
        groups = model._fsdp_engine.groups
        unit_numels = [g.layout.total_numel for g in groups]      # padded by the layout
        zero3_model_params_empty = all(p.numel() == 0 for g in groups for p in g.params)
        out[strategy] = (model.persistent_bytes(), unit_numels, model._fsdp_engine.allocator.live_bytes,
                         zero3_model_params_empty)
        model.zero_grad(set_to_none=True)
        out[strategy] += (model.persistent_bytes()["grads"],)
    return out


def formula(strategy, unit_numels, dp, compute=4, main=4, grad=4):
    """docs/design.md: bytes a rank keeps between steps (P = a group's buffer, padded by the layout)."""
    padded = unit_numels
    return design_persistent_bytes(strategy, padded, dp, compute, main, grad, aliased=compute == main)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_persistent_bytes_follow_the_formula(dp_size):
    results = run_distributed(memory_worker, dp_size)
    for strategy, (persistent, unit_numels, live_temporaries, params_empty, grads_after_set_to_none) in (
            (s, r[s]) for r in results for s in STRATEGY_NAMES):
        assert grads_after_set_to_none == 0, strategy     # freed with the optimizer's .grad views
        want = formula(strategy, unit_numels, dp_size)
        assert {k: persistent[k] for k in want} == want
        assert persistent["total"] == sum(want.values())
        assert live_temporaries == 0           # nothing temporary survives a step
        if strategy == "optim_grads_params":
            assert params_empty                 # ZeRO-3 keeps only shards between steps


def persistent_grads_worker(rank, world_size):
    from .scenarios import loss_fn, make_batches

    out = {}
    for persistent in (False, True):
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                            persistent_grads=persistent)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = make_batches(0, rank, 1)[0]
        loss_fn(model(x), y).backward()
        after_backward = model.persistent_bytes()["grads"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[persistent] = (after_backward, model.persistent_bytes()["grads"])
    return out


def test_zero_grad_set_to_none_frees_the_grad_shard_unless_persistent_grads():
    for result in run_distributed(persistent_grads_worker, 2):
        held, freed = result[False]
        assert held > 0 and freed == 0
        assert result[True] == (held, held)


def root_split_worker(rank, world_size):
    from .scenarios import loss_fn, make_batches

    out = {}
    for split in (False, True):
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                            reduce_root_per_child=split)
        engine = model._fsdp_engine
        alloc = engine.allocator
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        root_groups = [g.name for g in engine.units[0].groups]
        # what the engine holds for gradients at each gradient's arrival (after the engine took
        # it): the allocator's temporaries plus the gradients held per parameter until a reduce
        samples = []
        for param in (p for g in engine.groups for p in g.params):      # the compute parameters
            param.register_post_accumulate_grad_hook(lambda p: samples.append(
                alloc.live_bytes + sum(g.unreduced_grads.nbytes() for g in engine.groups)))
        # the root groups still gathered when the last block's first gradient arrives (mid-backward)
        gathered_mid_backward = []
        engine.units[-1].groups[0].params[0].register_post_accumulate_grad_hook(lambda p: gathered_mid_backward.append(
            sorted(g.name for g in engine.units[0].groups if g.is_unsharded)))
        peaks = []
        for step in range(2):
            x, y = make_batches(step, rank, 1)[0]
            out_ = model(x)
            samples.clear()
            loss_fn(out_, y).backward()
            peaks.append(max(samples))
            opt.step()
            opt.zero_grad()
        out[split] = (root_groups, peaks, model.full_state_dict(), gathered_mid_backward)
    return out


def test_reduce_root_per_child_splits_the_root_groups_and_lowers_the_backward_peak():
    """UnevenNet's root holds proj (used first in forward, its grads last in backward), head (grads
    first) and the 0-d offset: one group each, reduced as each completes, so the root never holds
    the gradients of proj and head together, and head's weights are let go once its gradients are
    complete, as are offset's (the blocks' backward finds only proj gathered); training is unchanged."""
    for result in run_distributed(root_split_worker, 2):
        (one, peaks_one, state_one, gathered_one), (split, peaks_split, state_split, gathered_split) = (
            result[False], result[True])
        assert one == ["<root>/float32/grad"]
        assert sorted(split) == ["<root>/float32/grad", "<root>/head/float32/grad", "<root>/proj/float32/grad"]
        assert gathered_one == [["<root>/float32/grad"]] * 2
        assert gathered_split == [["<root>/proj/float32/grad"]] * 2
        assert all(b < a for a, b in zip(peaks_one, peaks_split)), (peaks_one, peaks_split)
        for name, value in state_one.items():
            torch.testing.assert_close(state_split[name], value, rtol=1e-6, atol=1e-7)


def kept_grad_worker(rank, world_size):
    from .scenarios import loss_fn, make_batches

    out = {}
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = make_batches(0, rank, 1)[0]
        loss_fn(model(x), y).backward()
        kept = [p.grad for p in model.parameters() if p.grad is not None]
        values = [g.detach().clone() for g in kept]
        opt.step()
        opt.zero_grad(set_to_none=True)
        x, y = make_batches(1, rank, 1)[0]
        loss_fn(model(x), y).backward()            # the next step's gradients
        out[strategy] = (all(torch.equal(a, b) for a, b in zip(kept, values)), len(kept),
                         any(not torch.equal(p.grad, v) for p, v in zip(model.parameters(), values)
                             if p.grad is not None))
    return out


def test_a_grad_kept_across_zero_grad_set_to_none_keeps_its_values():
    """As with torch: ``g = p.grad; optimizer.zero_grad(set_to_none=True); backward()`` leaves ``g``
    as it was (the next gradients land in a new buffer, not in the one ``g`` views)."""
    for result in run_distributed(kept_grad_worker, 2):
        for strategy, (unchanged, count, new_grads_differ) in result.items():
            assert count > 0 and unchanged, strategy
            assert new_grads_differ, strategy


def one_rank_schedule_worker(rank, world_size):
    """ZeRO-3, reduce_root_per_child: which units are gathered while
    each block's forward runs, and what head's group (the root's, its gradients first in backward)
    holds when the last block's first gradient arrives."""
    from .scenarios import loss_fn, make_batches

    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                        reduce_root_per_child=True)
    engine = model._fsdp_engine
    units = engine.units
    gathered_in_forward = []
    for unit in units[1:]:
        unit.module.register_forward_pre_hook(lambda *_: gathered_in_forward.append(
            [u.fqn or "<root>" for u in units if u.is_unsharded and not u.is_root]))
    head = next(g for g in units[0].groups if "/head/" in g.name)
    mid_backward = []
    units[-1].groups[0].params[0].register_post_accumulate_grad_hook(lambda p: mid_backward.append(
        (head.holds_unreduced_grads, head.is_unsharded, head.grad_shard is not None)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(2):             # the second backward starts with the grad shards freed
        gathered_in_forward.clear()
        mid_backward.clear()
        x, y = make_batches(step, rank, 1)[0]
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return gathered_in_forward, mid_backward, head.reduce_frees_memory


def test_one_rank_neither_prefetches_nor_reduces_the_root_early():
    """At one rank a gather is a local cast: nothing to hide, so no unit is prefetched (each block's
    forward finds only itself gathered). A root group's reduced gradient would be as large as the
    gradients it holds, so head's gradients wait for the end of backward there, while its weights
    are let go at once; at two ranks the next block is prefetched and head reduces early (its shard
    is smaller than its gradients)."""
    (one,) = run_distributed(one_rank_schedule_worker, 1)
    gathered, mid_backward, frees = one
    assert gathered == [["blocks.0"], ["blocks.1"], ["blocks.2"]]
    assert mid_backward == [(True, False, False)] and frees is False
    for gathered, mid_backward, frees in run_distributed(one_rank_schedule_worker, 2):
        assert gathered == [["blocks.0", "blocks.1"], ["blocks.1", "blocks.2"], ["blocks.2"]]
        assert mid_backward == [(False, False, True)] and frees is True
