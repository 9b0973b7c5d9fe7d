"""Checkpoints of the Megatron GPT under ``fully_shard`` on NCCL: save at world size N with strategy S,
load at M ranks with strategy T, save again there, load back at N with S. The round trip must be
bitwise: full weights at M, full weights and every rank's AdamW state at N, and one more training
step gives bitwise the same loss and weights as the model that never left.

Uses ``megatron_fsdp_v2.save_checkpoint`` / ``load_checkpoint`` (torch.distributed.checkpoint) when the
package has them, else ``full_state_dict`` / ``load_full_state_dict`` (weights only: the optimizer and
resume checks are then skipped).

* ``test_checkpoint_reshards_to_half_the_ranks_and_back``: M = N / 2 (needs >= 2 GPUs);
* ``test_checkpoint_changes_strategy_at_the_same_world_size``: M = N (runs at world size 1 too);
* ``test_megatron_dist_checkpoint_changes_strategy_and_resumes``: the Megatron adapter and
  ``get_optimizer`` through Megatron's ``dist_checkpointing`` (``--ckpt-format torch_dist``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from . import harness
from .checks import assert_no_failures
from .harness import STRATEGIES


def _api():
    """(save, load, includes_optimizer, description)."""
    import megatron_fsdp_v2 as package

    if hasattr(package, "save_checkpoint") and hasattr(package, "load_checkpoint"):
        return package.save_checkpoint, package.load_checkpoint, True, "save_checkpoint/load_checkpoint"

    def save(path, model, optimizer=None):
        full = model.full_state_dict()
        group = model._fsdp_engine.comm.group
        if dist.get_rank(group) == 0:
            torch.save({k: v.cpu() for k, v in full.items()}, path + ".pt")
        dist.barrier(group=group)

    def load(path, model, optimizer=None):
        model.load_full_state_dict(torch.load(path + ".pt", map_location="cpu", weights_only=True))

    return save, load, False, "full_state_dict/load_full_state_dict (weights only)"


def _snapshot(model, optimizer) -> tuple:
    weights = {n: t.detach().cpu().clone() for n, t in model.full_state_dict().items()}
    state = {name: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
             for name, p in model.named_parameters()}
    return weights, state


def _differences(got: dict, want: dict, what: str) -> list:
    bad = sorted(set(got) ^ set(want))
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if isinstance(a, dict):
            bad += _differences(a, b, f"{name}.")
        elif torch.is_tensor(a):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                bad.append(name)
        elif a != b:
            bad.append(name)
    return [f"{what}{n}" for n in bad]


def _summarise(bad: list, what: str) -> list:
    return [f"{what}: {len(bad)} entries differ, e.g. {bad[:5]}"] if bad else []


def _round_trip(world, saved_strategy: str, loaded_strategy: str, mid_size: int) -> list:
    save, load, with_optimizer, _ = _api()
    spec = harness.short_spec()
    other_init = dataclasses.replace(spec, model_seed=spec.model_seed + 1)   # loads must overwrite it
    k = spec.micro_batches
    data = harness.batches(spec, world.rank, world, n=3 * k)
    group = None if mid_size == world.size else world.subgroups[mid_size]
    failures = []

    source, source_opt, _ = harness.shard_gpt(spec, world, saved_strategy)
    for step in range(2):
        harness.plain_step(source, source_opt, data[step * k:(step + 1) * k], world)
    want = _snapshot(source, source_opt)
    with harness.shared_tmpdir(world) as root:
        save(os.path.join(root, "at_n"), source, source_opt)
        if world.rank < mid_size:
            mid, mid_opt, _ = harness.shard_gpt(other_init, world, loaded_strategy, process_group=group)
            load(os.path.join(root, "at_n"), mid, mid_opt if with_optimizer else None)
            mid_weights = {n: t.detach().cpu() for n, t in mid.full_state_dict().items()}
            failures += _summarise(_differences(mid_weights, want[0], ""),
                                   f"full weights after loading at {mid_size} ranks ({loaded_strategy})")
            save(os.path.join(root, "at_m"), mid, mid_opt if with_optimizer else None)
            del mid, mid_opt
        harness.barrier()
        back, back_opt, _ = harness.shard_gpt(other_init, world, saved_strategy)
        load(os.path.join(root, "at_m"), back, back_opt if with_optimizer else None)
    got = _snapshot(back, back_opt)
    failures += _summarise(_differences(got[0], want[0], ""), f"full weights back at {world.size} ranks")
    if with_optimizer:
        failures += _summarise(_differences(got[1], want[1], ""), f"AdamW state back at {world.size} ranks")
        # resume: one more step on the model that never left and on the round-tripped one
        loss_a, _ = harness.plain_step(source, source_opt, data[2 * k:3 * k], world)
        loss_b, _ = harness.plain_step(back, back_opt, data[2 * k:3 * k], world)
        if loss_a != loss_b:
            failures.append(f"loss of the step after the round trip {loss_b!r} != without it {loss_a!r}")
        after_a, after_b = _snapshot(source, source_opt), _snapshot(back, back_opt)
        failures += _summarise(_differences(after_b[0], after_a[0], ""), "full weights one step after resuming")
    del source, source_opt, back, back_opt
    harness.release_memory(world)
    return failures


def _next(strategy: str) -> str:
    return STRATEGIES[(STRATEGIES.index(strategy) + 1) % len(STRATEGIES)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_reshards_to_half_the_ranks_and_back(world, strategy):
    if world.size < 2:
        pytest.skip("checkpoint resharding saves at N ranks and loads at M < N: needs >= 2 GPUs "
                    "(this run has world size 1)")
    mid = world.size // 2
    target = _next(strategy)
    failures = _round_trip(world, strategy, target, mid)
    assert_no_failures(failures, f"{_api()[3]}: save at {world.size} ranks ({strategy}) -> load at {mid} "
                                 f"({target}) -> save -> load at {world.size} ({strategy})")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_changes_strategy_at_the_same_world_size(world, strategy):
    target = _next(strategy)
    failures = _round_trip(world, strategy, target, world.size)
    assert_no_failures(failures, f"{_api()[3]}: save at {world.size} ranks ({strategy}) -> load ({target}) -> "
                                 f"save -> load ({strategy})")


# ---------------------------------------------------------------- Megatron's dist_checkpointing
def _megatron_wrapper(spec, world, strategy: str):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from .training import _optimizer_config

    module, config, _ = harness.build_gpt(spec, world)
    ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, grad_reduce_in_fp32=True)
    wrapped = FullyShardedDataParallel(config, ddp_config, module)
    return wrapped, config, get_optimizer(_optimizer_config(spec), [wrapped])


def _megatron_snapshot(wrapped, optimizer) -> tuple:
    """Full weights and full Adam state (each rank's flat ranges assembled)."""
    from tests.state_gather import full_optimizer_state

    weights = {n: t.detach().cpu().clone() for n, t in wrapped.state_dict().items()}
    return weights, full_optimizer_state(wrapped, optimizer, wrapped.dp_group)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_dist_checkpoint_changes_strategy_and_resumes(world, strategy):
    """The adapter + get_optimizer through Megatron's dist_checkpointing (what ``--ckpt-format
    torch_dist`` writes): save with S, load with the next strategy (weights and Adam state bitwise),
    load with S again and take one more Megatron step next to the model that never left (bitwise)."""
    from megatron_fsdp_v2.megatron import load_dist_checkpoint, save_dist_checkpoint

    from .training import _megatron_schedule_loop

    spec = dataclasses.replace(harness.short_spec(), iters=2)
    failures = []
    source, config, source_opt = _megatron_wrapper(spec, world, strategy)
    _megatron_schedule_loop(source, config, source_opt, spec, world)
    want = _megatron_snapshot(source, source_opt)
    target = _next(strategy)
    with harness.shared_tmpdir(world) as root:
        path = os.path.join(root, "megatron")
        save_dist_checkpoint(path, source, source_opt)
        other, _, other_opt = _megatron_wrapper(dataclasses.replace(spec, model_seed=spec.model_seed + 1), world,
                                                target)
        load_dist_checkpoint(path, other, other_opt)
        got = _megatron_snapshot(other, other_opt)
        failures += _summarise(_differences(got[0], want[0], ""), f"weights loaded with {target}")
        failures += _summarise(_differences(got[1], want[1], ""), f"Adam state loaded with {target}")
        del other, other_opt
        back, back_config, back_opt = _megatron_wrapper(dataclasses.replace(spec, model_seed=spec.model_seed + 1),
                                                        world, strategy)
        load_dist_checkpoint(path, back, back_opt)
    one = dataclasses.replace(spec, iters=1)
    loss_a, _ = _megatron_schedule_loop(source, config, source_opt, one, world)
    loss_b, _ = _megatron_schedule_loop(back, back_config, back_opt, one, world)
    if loss_a != loss_b:
        failures.append(f"loss of the step after loading {loss_b} != without the checkpoint {loss_a}")
    failures += _summarise(_differences(_megatron_snapshot(back, back_opt)[0], _megatron_snapshot(source, source_opt)[0],
                                        ""), "weights one step after resuming")
    del source, source_opt, back, back_opt
    harness.release_memory(world)
    assert_no_failures(failures, f"dist_checkpointing: save ({strategy}) -> load ({target}); load ({strategy}) "
                                 f"-> resume, at {world.size} ranks")
