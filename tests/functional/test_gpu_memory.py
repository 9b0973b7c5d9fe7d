"""Memory per rank on the GPU, for every strategy, on a Megatron GPT under ``fully_shard``
(8 layers, hidden 512, seq 512, vocab 4096, bf16 compute / fp32 main weights and grads, k=4):

* ``persistent_bytes()`` equals the docs/design.md formula ("Buffers a rank keeps"), with the padded
  group sizes P computed here from the parameter shapes;
* the allocator's ``peak_live_bytes`` per forward / backward stays within the design bounds
  (ZeRO-2: <= 2 units of full grads + the root unit's; ZeRO-3 forward: <= 2 units of weights + the
  root's; ZeRO-3 backward: <= 2 units of weights + 1 unit of grads + the root's weights and grads;
  DDP and ZeRO-1: no temporaries) and nothing temporary outlives a step;
* ``torch.cuda.max_memory_allocated()`` over a warm step: ZeRO-2 <= ZeRO-1 from 2 ranks on (its
  temporaries are below the gradient bytes it saves), and at every world size ZeRO-2 exceeds ZeRO-1
  by at most its temporaries bound minus the gradient bytes it saves.
"""

from __future__ import annotations

import pytest
import torch

from . import harness
from .checks import assert_no_failures
from .harness import STRATEGIES

MiB = 1 << 20
# The CUDA caching allocator counts whole blocks: a request can be served by a cached block up to
# 1 MiB larger than asked (large-pool blocks are not split below that), so two measurements of the
# same program may differ by a few MiB.
CACHING_SLACK = 8 * MiB


def _measure(world, strategy: str, spec) -> dict:
    harness.release_memory(world)
    cuda = world.is_cuda
    base = torch.cuda.memory_allocated(world.device) if cuda else 0
    model, optimizer, info = harness.shard_gpt(spec, world, strategy)
    alloc = model._fsdp_engine.allocator
    k = spec.micro_batches
    data = harness.batches(spec, world.rank, world, n=2 * k)
    phases, live_after, persistent = [], [], []
    for step in range(2):             # step 0 creates Adam's state; step 1 is measured
        if step == 1 and cuda:
            torch.cuda.synchronize(world.device)
            torch.cuda.reset_peak_memory_stats(world.device)

        def hook(i, phase, fn, step=step):
            alloc.reset_peak()
            out = fn()
            if phase != "step":
                phases.append((step, i, phase, alloc.peak_live_bytes))
            else:       # what a rank keeps, read before zero_grad(set_to_none=True) frees the grads
                persistent.append(model.persistent_bytes())
            return out

        harness.plain_step(model, optimizer, data[step * k:(step + 1) * k], world, phase_hook=hook)
        live_after.append((alloc.live_bytes, [str(key) for key in alloc.live_keys()]))
    peak = None
    if cuda:
        torch.cuda.synchronize(world.device)
        peak = torch.cuda.max_memory_allocated(world.device) - base
    units = model._fsdp_engine.units
    unit_sizes = {(g.layout.total_numel * g.dtypes.compute.itemsize, g.layout.total_numel * g.dtypes.grad_comm.itemsize)
                  for u in units[1:] for g in u.groups}
    result = dict(
        persistent=persistent[-1],
        padded=[g.layout.total_numel for g in model._fsdp_engine.groups],
        expected_padded=harness.expected_group_numels(info, world.size, 64 if cuda else 1),
        groups_per_unit=[len(u.groups) for u in units],
        unit_sizes=unit_sizes,
        root_weight=sum(g.layout.total_numel * g.dtypes.compute.itemsize for g in units[0].groups),
        root_grad=sum(g.layout.total_numel * g.dtypes.grad_comm.itemsize for g in units[0].groups),
        max_grad_shard=max(g.layout.shard_numel * g.dtypes.grad_comm.itemsize for g in model._fsdp_engine.groups),
        phases=phases, live_after=live_after, peak=peak,
    )
    del model, optimizer, alloc
    harness.release_memory(world)
    return result


@pytest.fixture(scope="module")
def memory(world):
    spec = harness.memory_spec()
    _measure(world, "no_shard", spec)      # warm-up: Megatron's global attention buffer, cuBLAS workspaces
    return {strategy: _measure(world, strategy, spec) for strategy in STRATEGIES}


def _sizes(result) -> tuple:
    (unit_weight, unit_grad), = result["unit_sizes"]
    return unit_weight, unit_grad, result["root_weight"], result["root_grad"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_persistent_bytes_follow_the_design_formula(world, memory, strategy):
    spec = harness.memory_spec()
    r = memory[strategy]
    c = 2 if spec.bf16 else 4
    want = harness.design_persistent_bytes(strategy, r["expected_padded"], world.size, c=c, m=4, g=4,
                                           aliased=not spec.bf16)
    failures = []
    if r["padded"] != r["expected_padded"]:
        failures.append(f"padded group sizes {r['padded']} != design layout {r['expected_padded']}")
    if r["groups_per_unit"] != [1] * (spec.layers + 1):
        failures.append(f"expected one group per unit ({spec.layers + 1} units), got {r['groups_per_unit']}")
    got = {key: r["persistent"].get(key) for key in want}
    if got != want:
        failures.append(f"persistent_bytes {got} != design formula {want}")
    if r["persistent"].get("total") != sum(want.values()):
        failures.append(f"persistent total {r['persistent'].get('total')} != {sum(want.values())}")
    assert_no_failures(failures, f"{strategy}: persistent bytes")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_allocator_peaks_within_unit_bounds(world, memory, strategy):
    r = memory[strategy]
    failures = []
    if len(r["unit_sizes"]) != 1:
        failures.append(f"transformer-layer units differ in size: {r['unit_sizes']}")
        assert_no_failures(failures, f"{strategy}: unit sizes")
    W, G, RW, RG = _sizes(r)
    for step, i, phase, peak in r["phases"]:
        where = f"step {step} micro-batch {i} {phase}: allocator peak {peak} B"
        if strategy in ("no_shard", "optim"):
            if peak != 0:
                failures.append(f"{where}, expected no temporaries")
        elif strategy == "optim_grads":
            if phase == "forward" and peak != 0:
                failures.append(f"{where}, expected none in forward")
            if phase == "backward" and not G <= peak <= 2 * G + RG:
                failures.append(f"{where} outside [{G}, 2 x {G} + {RG}] (1..2 units of full grads + root grads)")
        else:
            if phase == "forward" and peak > 2 * W + RW:
                failures.append(f"{where} > 2 x {W} + {RW} (2 units of weights + root weights)")
            if phase == "backward" and not W + G <= peak <= 2 * W + G + RW + RG:
                failures.append(f"{where} outside [{W} + {G}, 2 x {W} + {G} + {RW} + {RG}] "
                                f"(2 units of weights + 1 of grads + the root's weights and grads)")
    for step, (live, keys) in enumerate(r["live_after"]):
        if live != 0:
            failures.append(f"after step {step}: {live} B of temporaries still live: {keys[:4]}")
    assert_no_failures(failures, f"{strategy}: temporaries outside the design bounds")


def _zero2_vs_zero1(world, memory) -> tuple:
    one, two = memory["optim"], memory["optim_grads"]
    _, G, _, RG = _sizes(two)
    bound = 2 * G + RG                                          # ZeRO-2 temporaries (design.md)
    saved = one["persistent"]["grads"] - two["persistent"]["grads"]   # g*P*(N-1)/N
    slack = 2 * two["max_grad_shard"] + CACHING_SLACK           # reduce-scatter outputs, block rounding
    return one["peak"], two["peak"], bound, saved, slack


def test_zero2_step_peak_exceeds_zero1_by_at_most_its_temporaries(world, memory):
    if not world.is_cuda:
        pytest.skip("torch.cuda.max_memory_allocated needs CUDA (FUNCTIONAL_CPU_SMOKE=1)")
    peak1, peak2, bound, saved, slack = _zero2_vs_zero1(world, memory)
    failures = []
    if peak2 - peak1 > bound - saved + slack:
        failures.append(f"ZeRO-2 step peak {peak2 / MiB:.1f} MiB - ZeRO-1 step peak {peak1 / MiB:.1f} MiB = "
                        f"{(peak2 - peak1) / MiB:.1f} MiB > temporaries bound {bound / MiB:.1f} MiB - saved grads "
                        f"{saved / MiB:.1f} MiB + slack {slack / MiB:.1f} MiB")
    assert_no_failures(failures, "ZeRO-2 vs ZeRO-1 peak memory (torch.cuda.max_memory_allocated)")


def test_zero2_step_peak_not_above_zero1(world, memory):
    if not world.is_cuda:
        pytest.skip("torch.cuda.max_memory_allocated needs CUDA (FUNCTIONAL_CPU_SMOKE=1)")
    if world.size < 2:
        pytest.skip("at world size 1 ZeRO-2's gradient shard is the whole buffer, so it holds ZeRO-1's "
                    "gradients plus its temporaries; ZeRO-2 <= ZeRO-1 needs >= 2 GPUs (the bounded "
                    "comparison above runs at every world size)")
    peak1, peak2, bound, saved, slack = _zero2_vs_zero1(world, memory)
    assert bound <= saved, (f"test model too small for the claim: ZeRO-2 temporaries bound {bound} B > grad "
                            f"bytes saved {saved} B at world size {world.size}")
    failures = []
    if peak2 > peak1:
        failures.append(f"ZeRO-2 step peak {peak2 / MiB:.1f} MiB > ZeRO-1 step peak {peak1 / MiB:.1f} MiB "
                        f"(grads saved {saved / MiB:.1f} MiB, temporaries bound {bound / MiB:.1f} MiB)")
    assert_no_failures(failures, "ZeRO-2 step peak above ZeRO-1's (torch.cuda.max_memory_allocated)")


def test_gradient_buffers_come_from_their_own_pool(world):
    """[Note: gradient buffers from their own pool]: every reduced-gradient buffer's block lies in
    a segment of the gradient pool's stream, never in the compute stream's (whose transients
    would otherwise split it), and a second step reuses the first step's blocks (no new segment)."""
    from megatron_fsdp_v2.group.grad_buffer import gradient_pool_stream

    if not world.is_cuda:
        pytest.skip("needs CUDA: the caching allocator's per-stream pools")
    spec = harness.memory_spec()
    harness.release_memory(world)
    model, optimizer, _ = harness.shard_gpt(spec, world, "optim_grads_params")
    data = harness.batches(spec, world.rank, world, n=2 * spec.micro_batches)
    pool = gradient_pool_stream(world.device).cuda_stream
    seen = []
    for step in range(2):
        def hook(i, phase, fn):
            out = fn()
            if phase == "step":
                buffers = [g.grads.live() for g in model._fsdp_engine.groups if g.grads.live() is not None]
                segments = torch.cuda.memory._snapshot()["segments"]
                streams = []
                for b in buffers:
                    ptr = b.data_ptr()
                    seg = next(s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"])
                    streams.append(seg["stream"])
                seen.append((len(buffers), streams, sorted(b.data_ptr() for b in buffers)))
            return out
        k = spec.micro_batches
        harness.plain_step(model, optimizer, data[step * k:(step + 1) * k], world, phase_hook=hook)
    (count, streams, ptrs0), (_, _, ptrs1) = seen
    assert count == len(model._fsdp_engine.groups)
    assert set(streams) == {pool}
    assert ptrs0 == ptrs1
    del model, optimizer
    harness.release_memory(world)
