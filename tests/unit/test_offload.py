"""CPU offload by fraction (offload/host_link.py, [Note: offload by fraction]).

On CPU the "device" is the CPU too, so these tests check what does not depend on the hardware:
which groups go to the host, that their main weights, gradients and optimizer state live in
separate host buffers that the step, the gathers and checkpoints read and write, and that the
results are bitwise those of the run without offload, for every strategy at dp 2."""

from __future__ import annotations

import contextlib
import os
import typing

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from megatron_fsdp_v2 import (STRATEGY_NAMES, MixedPrecisionPolicy, OffloadPolicy, fully_shard, load_checkpoint,
                              save_checkpoint)
from megatron_fsdp_v2.offload.policy import choose_offloaded
from megatron_fsdp_v2.group.param_group import ParamGroup

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn

FRACTIONS = (0.0, 0.5, 1.0)


def _wrap(strategy, fraction, dtensor_params=True):
    torch.manual_seed(0)
    offload = None if fraction is None else OffloadPolicy(fraction=fraction)
    return fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], offload=offload,
                       dtensor_params=dtensor_params)


def _train(model, opt, rank, steps, k=2, first_step=0, dtype=torch.float32):
    for step in range(first_step, first_step + steps):
        for i, (x, y) in enumerate(make_batches(step, rank, k)):
            with (model.no_sync() if i < k - 1 else contextlib.nullcontext()):
                loss_fn(model(x.to(dtype)).float(), y).backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _placement(model) -> dict:
    groups = model._fsdp_engine.groups
    offloaded = [g for g in groups if g.offloaded is not None]
    distinct = all(g.main_shard.data_ptr() != (g.model_weights.data_ptr() if g.model_weights is not None else -1)
                   and (g.offloaded.compute_shard is None or g.offloaded.compute_shard.data_ptr() != g.main_shard.data_ptr())
                   for g in offloaded)
    declared = set(typing.get_type_hints(ParamGroup))
    return {"offloaded": [groups.index(g) for g in offloaded], "groups": len(groups),
            "bytes": model.persistent_bytes(), "main_and_compute_apart": distinct,
            "undeclared": sorted({name for g in groups for name in vars(g)} - declared)}


def parity_worker(rank, world_size):
    out = {}
    for strategy in STRATEGY_NAMES:
        for fraction in FRACTIONS:
            model = _wrap(strategy, fraction)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
            _train(model, opt, rank, steps=2)
            state = {n: s["exp_avg_sq"].full_tensor() if hasattr(s["exp_avg_sq"], "full_tensor") else s["exp_avg_sq"]
                     for n, s in ((n, opt.state[p]) for n, p in model.named_parameters())}
            out[(strategy, fraction)] = (model.full_state_dict(), state, _placement(model))
    return out


@pytest.fixture(scope="module")
def parity():
    return run_distributed(parity_worker, 2)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_offload_fraction_gives_bitwise_identical_training(parity, strategy):
    for rank_result in parity:
        weights0, state0, _ = rank_result[(strategy, 0.0)]
        for fraction in (0.5, 1.0):
            weights, state, _ = rank_result[(strategy, fraction)]
            assert list(weights) == list(weights0)
            for name in weights0:
                assert torch.equal(weights[name], weights0[name]), (strategy, fraction, name)
            for name in state0:
                assert torch.equal(state[name], state0[name]), (strategy, fraction, name)
    # the run trained: the weights moved away from their initial values
    torch.manual_seed(0)
    initial = UnevenNet().state_dict()
    assert not torch.equal(parity[0][(strategy, 0.0)][0]["head.weight"], initial["head.weight"])


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_offload_places_whole_groups_from_the_last(parity, strategy):
    none, half, every = (parity[0][(strategy, f)][2] for f in FRACTIONS)
    groups = every["groups"]
    assert none["offloaded"] == [] and "host_total" not in none["bytes"]
    assert every["offloaded"] == list(range(groups))
    assert every["bytes"]["main_weights"] == 0
    assert every["bytes"]["host_main_weights"] == none["bytes"]["main_weights"]
    assert half["offloaded"] == list(range(groups - len(half["offloaded"]), groups))
    assert 0 < len(half["offloaded"]) < groups
    host, device = half["bytes"]["host_main_weights"], half["bytes"]["main_weights"]
    assert host + device == none["bytes"]["main_weights"] and host >= device
    assert every["main_and_compute_apart"] and half["main_and_compute_apart"]


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_trained_group_holds_only_what_its_class_declares(parity, strategy):
    """ParamGroup lists everything a group holds at the top of the class (issue 50): a group on the
    device, or offloaded, after training holds nothing else."""
    for fraction in FRACTIONS:
        assert parity[0][(strategy, fraction)][2]["undeclared"] == [], (strategy, fraction)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12), st.floats(0, 1))
def test_choose_offloaded_takes_the_shortest_suffix_holding_the_fraction(sizes, fraction):
    chosen = choose_offloaded(sizes, fraction)
    n = len(sizes)
    assert chosen == frozenset(range(n - len(chosen), n))          # a suffix: the last groups
    held = sum(sizes[i] for i in chosen)
    if fraction == 1:
        assert len(chosen) == n
    elif fraction == 0:
        assert not chosen
    else:
        assert held >= fraction * sum(sizes)
        if chosen:                                                  # no shorter suffix would do
            assert held - sizes[min(chosen)] < fraction * sum(sizes)


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), True, "half"])
def test_bad_fraction_is_refused_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"OffloadPolicy\.fraction must be a number with 0 <= fraction <= 1, got"):
        OffloadPolicy(fraction=bad)


def test_offload_must_be_a_policy():
    with pytest.raises(TypeError, match="offload must be an OffloadPolicy or None, got float"):
        fully_shard(UnevenNet(), sharding_strategy="optim", offload=0.5)


def checkpoint_worker(rank, world_size, root):
    """Save at one fraction, load at another (and strategy), continue: bitwise the same as without."""
    out = {}
    for strategy, (save_f, load_f) in (("optim_grads_params", (1.0, 0.0)), ("optim_grads_params", (0.0, 1.0)),
                                       ("optim", (1.0, 0.5))):
        path = os.path.join(root, f"{strategy}-{save_f}-{load_f}")
        model = _wrap(strategy, save_f)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, rank, steps=2)
        save_checkpoint(path, model, opt)
        _train(model, opt, rank, steps=2, first_step=2)
        want = model.full_state_dict()
        dist.barrier()
        loaded = _wrap(strategy, load_f)
        opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
        load_checkpoint(path, loaded, opt2)
        offloaded = sum(g.offloaded is not None for g in loaded._fsdp_engine.groups)
        _train(loaded, opt2, rank, steps=2, first_step=2)
        got = loaded.full_state_dict()
        out[(strategy, save_f, load_f)] = (all(torch.equal(got[n], want[n]) for n in want), offloaded)
    return out


def test_checkpoints_reshard_into_and_out_of_offload(tmp_path):
    results = run_distributed(checkpoint_worker, 2, str(tmp_path))
    for result in results:
        for (strategy, save_f, load_f), (equal, offloaded) in result.items():
            assert equal, (strategy, save_f, load_f)
            assert (offloaded > 0) == (load_f > 0)


def mixed_precision_worker(rank, world_size):
    """bf16 compute weights (the upload casts on the device) and bf16 gradient reduces (the host
    gradient takes them in fp32), ZeRO-3 and ZeRO-1, with and without offload."""
    from megatron_fsdp_v2 import MixedPrecisionPolicy

    out = {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, grad_comm_dtype=torch.bfloat16)
    for strategy in ("optim_grads_params", "optim"):
        for fraction in (0.0, 1.0):
            torch.manual_seed(0)
            model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], mixed_precision=policy,
                                offload=OffloadPolicy(fraction=fraction))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _train(model, opt, rank, steps=2, dtype=torch.bfloat16)
            out[(strategy, fraction)] = model.full_state_dict()
    return out


def test_offload_with_bf16_compute_and_reduce_is_bitwise_identical():
    for result in run_distributed(mixed_precision_worker, 2):
        for strategy in ("optim_grads_params", "optim"):
            want, got = result[(strategy, 0.0)], result[(strategy, 1.0)]
            assert all(torch.equal(got[n], want[n]) for n in want), strategy


def staging_worker(rank, world_size):
    """Host bytes after one step of one micro-batch and one of two (ZeRO-3, f = 1)."""
    out = {}
    for k in (1, 2):
        model = _wrap("optim_grads_params", 1.0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, opt, rank, steps=2, k=k)
        out[k] = model.persistent_bytes()
    return out


def test_a_fresh_landing_writes_the_host_gradient_without_a_staging_copy():
    """The first landing after zero_grad overwrites the host gradient; only gradient accumulation
    (a second landing) needs the staging buffer, added on the host."""
    for result in run_distributed(staging_worker, 2):
        assert "host_grad_staging" not in result[1]
        assert result[2]["host_grad_staging"] == result[2]["host_grads"] == result[1]["host_grads"] > 0
        assert result[1]["host_total"] == result[1]["host_main_weights"] + result[1]["host_grads"]


def release_worker(rank, world_size):
    """ZeRO-3 with release_after_gather: the weights, and which compute shards are on the device
    after each training forward (groups in forward order: the root's first)."""
    out = {}
    for fraction in (0.0, 0.5, 1.0):
        model = _wrap("optim_grads_params", None if fraction == 0 else fraction)
        if fraction:
            torch.manual_seed(0)
            model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                                offload=OffloadPolicy(fraction=fraction, release_after_gather=True))
        offloaded = [g for g in model._fsdp_engine.groups if g.offloaded is not None]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        on_device, after_backward = [], []
        for step in range(3):
            for i, (x, y) in enumerate(make_batches(step, rank, 2)):
                with (model.no_sync() if i == 0 else contextlib.nullcontext()):
                    output = model(x)
                    on_device.append([g.offloaded.compute_shard is not None for g in offloaded])
                    loss_fn(output, y).backward()
                    after_backward.append([g.offloaded.compute_shard is not None for g in offloaded])
            opt.step()
            opt.zero_grad()
        out[fraction] = (model.full_state_dict(), on_device, after_backward)
    return out


def test_released_compute_shards_train_bitwise_alike_and_leave_the_device():
    for result in run_distributed(release_worker, 2):
        want = result[0.0][0]
        for fraction in (0.5, 1.0):
            got, on_device, after_backward = result[fraction]
            assert all(torch.equal(got[n], want[n]) for n in want), fraction
            # from the second forward on (the order known): only the root's shard and the last
            # unit's, copied again for the backward that follows at once
            expected = [True, False, False, True] if fraction == 1.0 else [False] * (len(on_device[0]) - 1) + [True]
            assert on_device[1:] == [expected] * 5, (fraction, on_device)
            # the first forward, the order still unknown: no unit is taken for the last, none
            # copied again ahead (every unit's was, 1.4 GiB live at the first backward's peak
            # on the 941M GPT: docs/benchmarks_history.md, "Offload, 2026-12-03 night")
            assert on_device[0] == expected[:-1] + [False], (fraction, on_device)
            # after every backward none: the root's goes after its gather at the start of backward
            assert after_backward == [[False] * len(expected)] * 6, (fraction, after_backward)


def _host_piece_copies(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from megatron_fsdp_v2.row_sharded import row_sharded
    mesh = DeviceMesh("meta", list(range(world)))     # stands in for an accelerator's mesh
    local = torch.randn(3, 4)
    moved = []
    original = torch.Tensor.to
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "to", lambda self, *a, **k: (moved.append(tuple(self.shape)),
                                                                  original(self, *a, **k))[1])
        tensor = row_sharded(local, mesh, (3 * world, 4), [3 * r for r in range(world + 1)])
    return moved, tensor.to_local().data_ptr() == local.data_ptr(), tuple(tensor.shape)


def test_a_host_piece_faces_the_optimizer_without_a_copy_to_the_device():
    # An offloaded group's main weights and gradients are host pieces of DTensors on the
    # accelerator's mesh; DTensor.from_local moved every such piece to the mesh's device (a full
    # synchronous copy per parameter each time .grad was attached: ~150 ms per step on the 941M
    # GPT at f = 1, found with a profiler: docs/benchmarks_history.md, "Offload, 2026-12-03 night").
    moved, shared, shape = run_distributed(_host_piece_copies, 1)[0]
    assert moved == [] and shared and shape == (3, 4)


def _head_reduced_early(rank, world, fraction):
    torch.manual_seed(0)
    offload = OffloadPolicy(fraction=fraction) if fraction else None
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                        reduce_root_per_child=True, offload=offload,
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    units = model._fsdp_engine.units
    head = next(g for g in units[0].groups if "/head/" in g.name)
    holds = []
    units[-1].groups[0].params[0].register_post_accumulate_grad_hook(
        lambda p: holds.append(head.holds_unreduced_grads))
    x, y = make_batches(0, rank, 1)[0]
    loss_fn(model(x.bfloat16()).float(), y).backward()
    return holds, head.offloaded is not None


def test_an_offloaded_root_group_reduces_as_soon_as_its_gradients_are_complete():
    # At one rank a bf16 root group's fp32 reduced shard is larger than the bf16 gradients it
    # holds, so it reduces at the end of backward; offloaded, its shard goes to the host, so it
    # reduces (and steps on the thread) at once: the head's gradients are gone by the time the
    # last block's first gradient arrives.
    (plain,) = run_distributed(_head_reduced_early, 1, 0.0)
    (offloaded,) = run_distributed(_head_reduced_early, 1, 1.0)
    assert plain == ([True], False)
    assert offloaded == ([False], True)


def _grads_each_step(rank, world):
    model = _wrap("optim_grads_params", 1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    seen = []
    for step in range(2):
        x, y = make_batches(step, rank, 1)[0]
        loss_fn(model(x), y).backward()
        seen.append([(p.grad, p.grad.to_local().clone()) if p.grad is not None else None for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return [a is not None and a[0] is b[0] and not torch.equal(a[1], b[1]) for a, b in zip(*seen)]


def test_an_offloaded_groups_grads_are_made_once_and_reattached_each_step():
    # Making a DTensor per parameter per step (~0.2 ms each) sat on the critical path of the thread
    # that steps offloaded groups during backward; the host gradient lives as long as the group,
    # so its .grad tensors are made once, and each step's values land in them.
    same_object_new_values = run_distributed(_grads_each_step, 2)[0]
    assert len(same_object_new_values) == 22 and all(same_object_new_values), same_object_new_values
