"""Collectives per phase and per step on NCCL, as in the strategy table (docs/design.md "Schedule";
tests/unit/test_comm_counts.py checks the same on gloo).

Model: the Megatron GPT under ``fully_shard`` (units: every ``TransformerLayer``; bf16 compute
weights, fp32 grads): one group per unit, G = layers + 1 groups. Bytes of a collective are the full
buffer it covers: grads in the grad-communication dtype (fp32, 4 B), weights in the compute dtype
(bf16, 2 B). P = sum of the groups' padded sizes, computed here from the parameter shapes with the
design's layout rule (64-element alignment on CUDA, end padding to a multiple of the world size).

Per step (k micro-batches, all but the last inside ``no_sync``):

=====================  ====================================================================
no_shard               all-reduce G x 4P
optim                  reduce-scatter G x 4P (last micro-batch), all-gather G x 2P (step)
optim_grads            reduce-scatter kG x 4P (every micro-batch), all-gather G x 2P (step)
optim_grads_params     all-gather 2kG x 2P (forward + backward), reduce-scatter kG x 4P
=====================  ====================================================================

Counted twice, independently: ``model.comm_stats()`` and a ``TorchDispatchMode`` that sees every
c10d op dispatched (dispatch_counter.py), per forward / backward / optimizer step.
"""

from __future__ import annotations

import pytest

from . import harness
from .checks import assert_no_failures
from .dispatch_counter import CollectiveCounter
from .harness import STRATEGIES

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _stats_delta(before: dict, after: dict) -> dict:
    out = {}
    for name in COLLECTIVES:
        count = after[name]["count"] - before[name]["count"]
        nbytes = after[name]["bytes"] - before[name]["bytes"]
        if count or nbytes:
            out[name] = (count, nbytes)
    return out


def _expected_phase(strategy: str, i: int, phase: str, k: int, groups: int, grad_bytes: int,
                    weight_bytes: int) -> dict:
    """The strategy table for one phase of micro-batch i (phase 'step': the optimizer step)."""
    last = i == k - 1
    if phase == "step":
        return {"all_gather": (groups, weight_bytes)} if strategy in ("optim", "optim_grads") else {}
    if strategy == "no_shard":
        return {"all_reduce": (groups, grad_bytes)} if phase == "backward" and last else {}
    if strategy == "optim":
        return {"reduce_scatter": (groups, grad_bytes)} if phase == "backward" and last else {}
    if strategy == "optim_grads":
        return {"reduce_scatter": (groups, grad_bytes)} if phase == "backward" else {}
    if phase == "forward":
        return {"all_gather": (groups, weight_bytes)}
    return {"all_gather": (groups, weight_bytes), "reduce_scatter": (groups, grad_bytes)}


def _expected_step(strategy: str, k: int, groups: int, grad_bytes: int, weight_bytes: int) -> dict:
    return {
        "no_shard": {"all_reduce": (groups, grad_bytes)},
        "optim": {"reduce_scatter": (groups, grad_bytes), "all_gather": (groups, weight_bytes)},
        "optim_grads": {"reduce_scatter": (k * groups, k * grad_bytes), "all_gather": (groups, weight_bytes)},
        "optim_grads_params": {"all_gather": (2 * k * groups, 2 * k * weight_bytes),
                               "reduce_scatter": (k * groups, k * grad_bytes)},
    }[strategy]


def _count(world, strategy):
    spec = harness.short_spec()
    k = spec.micro_batches
    model, optimizer, info = harness.shard_gpt(spec, world, strategy)
    data = harness.batches(spec, world.rank, world, n=2 * k)
    counter = CollectiveCounter()
    phases, steps = {}, []
    for step in range(2):            # step 0 is cold (ZeRO-3 learns the order); step 1 is checked
        model.reset_comm_stats()

        def hook(i, phase, fn, step=step):
            before = model.comm_stats()
            with counter:
                out = fn()
            phases[(step, i, phase)] = (counter.take(), _stats_delta(before, model.comm_stats()))
            return out

        harness.plain_step(model, optimizer, data[step * k:(step + 1) * k], world, phase_hook=hook)
        steps.append(_stats_delta({n: {"count": 0, "bytes": 0} for n in COLLECTIVES}, model.comm_stats()))
    groups = model._fsdp_engine.groups
    layout = dict(padded=[g.layout.total_numel for g in groups],
                  units=len(model._fsdp_engine.units),
                  itemsizes={(g.dtypes.compute.itemsize, g.dtypes.grad_comm.itemsize) for g in groups})
    del model, optimizer
    harness.release_memory(world)
    return phases, steps, layout, info


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_per_phase_and_step_match_the_strategy_table(world, strategy):
    spec = harness.short_spec()
    k = spec.micro_batches
    phases, steps, layout, info = _count(world, strategy)
    alignment = 64 if world.is_cuda else 1
    padded = harness.expected_group_numels(info, world.size, alignment)
    weight_size, grad_size = (2 if spec.bf16 else 4), 4
    groups = len(padded)
    grad_bytes, weight_bytes = grad_size * sum(padded), weight_size * sum(padded)

    failures = []
    if layout["padded"] != padded:
        failures.append(f"group sizes {layout['padded']} != design layout {padded}")
    if layout["units"] != spec.layers + 1 or layout["itemsizes"] != {(weight_size, grad_size)}:
        failures.append(f"expected {spec.layers + 1} units with (compute, grad-comm) bytes "
                        f"{(weight_size, grad_size)}, got {layout['units']} units, {layout['itemsizes']}")
    for i in range(k + 1):
        for phase in (("step",) if i == k else ("forward", "backward")):
            want = _expected_phase(strategy, i, phase, k, groups, grad_bytes, weight_bytes)
            dispatched, stats = phases[(1, i, phase)]
            if dispatched != want:
                failures.append(f"micro-batch {i} {phase}: dispatched c10d collectives {dispatched}, expected {want}")
            if stats != want:
                failures.append(f"micro-batch {i} {phase}: comm_stats {stats}, expected {want}")
    want_step = _expected_step(strategy, k, groups, grad_bytes, weight_bytes)
    if steps[1] != want_step:
        failures.append(f"per step (comm_stats): {steps[1]}, expected {want_step}")
    # the cold first step issues the same collectives (ZeRO-3 has no prefetch yet, but no extra calls)
    if steps[0] != want_step:
        failures.append(f"first step (comm_stats): {steps[0]}, expected {want_step}")
    assert_no_failures(failures, f"{strategy}: collectives differ from the strategy table "
                                 f"(G={groups} groups, P={sum(padded)} elements, k={k}, world size {world.size})")
