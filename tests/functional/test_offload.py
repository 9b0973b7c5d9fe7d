"""CPU offload on the GPU (ZeRO-3, f = 1, groups stepped on a host thread during backward): the
device's streams and caching allocator are what the CPU suite cannot see.

``release_after_gather`` only changes when a compute shard lives on the device and which copies
bring it back, never a value: with it, training is bitwise the training without it (losses and the
final weights). The stepping thread made a released shard in the compute stream's pool, where the
caching allocator could hand it a block backward was still using; on the H200 the 941M GPT's loss
then drifted or became NaN in some runs ([Note: a device buffer made on the stepping thread] in
offload/host_link.py). The model here (8 layers of hidden 2048, 8k tokens a step) gives each layer's
backward enough device time for the host to run ahead, so that backward frees blocks while the
thread uploads, as in the run that showed the race.
"""

from __future__ import annotations

import dataclasses

import torch

from testing.thread_steps import observe_thread_steps

from . import harness


def _train(world, spec, release: bool):
    from megatron_fsdp_v2 import OffloadPolicy

    harness.release_memory(world)
    policy = OffloadPolicy(fraction=1.0, step_in_backward=True, release_after_gather=release)
    model, optimizer, _ = harness.shard_gpt(spec, world, "optim_grads_params", offload=policy, fused=True)
    data = harness.batches(spec, world.rank, world, n=spec.iters)
    records = observe_thread_steps(model)
    losses = [harness.plain_step(model, optimizer, [batch], world)[0] for batch in data]
    weights = {name: tensor.detach().cpu().clone() for name, tensor in model.full_state_dict().items()}
    stepped = len(records)
    del model, optimizer
    harness.release_memory(world)
    return losses, weights, stepped


def test_release_after_gather_trains_bitwise_as_without_it(world):
    if harness.smoke_mode():
        spec = dataclasses.replace(harness.memory_spec(), micro_batches=1, iters=6)
    else:       # 50M parameters a layer at 8k tokens: ~8 ms of backward a layer on an H200, host ahead
        spec = harness.GPTSpec(layers=8, hidden=2048, heads=16, seq=1024, micro_batch_size=8, micro_batches=1, iters=6)
    kept_losses, kept_weights, kept_stepped = _train(world, spec, release=False)
    released_losses, released_weights, released_stepped = _train(world, spec, release=True)
    assert kept_stepped == released_stepped > 0          # the thread stepped groups in both
    assert all(torch.isfinite(torch.tensor(kept_losses)))
    assert released_losses == kept_losses
    assert released_weights.keys() == kept_weights.keys()
    different = [name for name in kept_weights if not torch.equal(kept_weights[name], released_weights[name])]
    assert not different, f"{len(different)} of {len(kept_weights)} weights differ, e.g. {different[:3]}"
