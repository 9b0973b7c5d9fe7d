"""Issue 3: the engine's temporary buffers stay within the bounds ``runtime/engine.py`` promises.

Every temporary (ZeRO-3's unsharded weights, ZeRO-2/3's full-size grads) goes through the
allocator, and ``Allocator.allocate`` updates ``peak_live_bytes`` on every call, so the peak read
after a phase (``reset_peak()`` before it) is the exact maximum of ``live_bytes`` over that phase.

The model is a ``Sequential`` of N identical ``Block`` units plus one 0-d root parameter, so every
non-root group has the same layout and "unit buffers" = bytes / unit bytes means something:

    unit weight bytes = layout.total_numel * compute element size   (ZeRO-3's unsharded weights)
    unit grad bytes   = layout.total_numel * grad-comm element size (ZeRO-2/3's full-size grads)

The root unit's buffers (a few bytes) come on top of the unit bounds: the root is unsharded at
the start of backward and stays so until the end of backward, by design.

All configurations of one world size run in one spawned job (``bounds_worker``); a module-scoped
fixture shares its report between the tests below, so each property is its own test but the
processes start only twice (2 and 4 ranks).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_v2 import STRATEGY_NAMES, MixedPrecisionPolicy, fully_shard

from .dist_utils import run_distributed

ALLOCATORS = ("storage_freeing", "trace_pool")
UNIT_COUNTS = (4, 8)
STEPS = 4                     # AdamW steps per configuration
MICRO_BATCHES = 2             # per step; no_sync on the first (ZeRO-2/3 reduce anyway)
WIDTH = 16
BF16 = "bf16"                 # extra configurations, see POLICIES
BF16_GRADS = "bf16_grads"


class Block(nn.Module):
    """One unit: the same shapes in every instance."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return x + self.out(torch.tanh(self.fc(x)))


class BlockStack(nn.Module):
    """``n_units`` identical Blocks and one tiny (0-d) root parameter."""

    def __init__(self, n_units: int, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(n_units)))
        self.offset = nn.Parameter(torch.tensor(0.1))

    def forward(self, x):
        return self.blocks(x) + self.offset


def _batches(step: int, rank: int, k: int, dtype=torch.float32):
    """Different per rank; in the compute dtype (the engine does not cast inputs)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(4, WIDTH, generator=g).to(dtype), torch.randn(4, WIDTH, generator=g).to(dtype))
            for _ in range(k)]


def _record_allocations(alloc):
    """Wrap ``alloc.allocate`` / ``free`` / ``step`` (instance attributes shadow the methods) to log
    every event as (kind, key, data_ptr or None, live_bytes after the event)."""
    events = []
    allocate, free, step = alloc.allocate, alloc.free, alloc.step

    def recording_allocate(key, numel, dtype, device):
        tensor = allocate(key, numel, dtype, device)
        events.append(("alloc", key, tensor.data_ptr(), alloc.live_bytes))
        return tensor

    def recording_free(key):
        free(key)
        events.append(("free", key, None, alloc.live_bytes))

    def recording_step():
        step()
        events.append(("step", None, None, alloc.live_bytes))

    alloc.allocate, alloc.free, alloc.step = recording_allocate, recording_free, recording_step
    return events


def _addresses_per_iteration(events):
    """[{(key, occurrence): data_ptr}] per allocator iteration (the events between two ``step()``
    calls; the engine calls ``step()`` after every backward that reduces)."""
    iterations, ptrs, seen = [], {}, {}
    for kind, key, ptr, _ in events:
        if kind == "step":
            iterations.append(ptrs)
            ptrs, seen = {}, {}
        elif kind == "alloc":
            occurrence = seen.get(key, 0)
            seen[key] = occurrence + 1
            ptrs[(key, occurrence)] = ptr
    return iterations


def _byte_sizes(model):
    """Weight and grad bytes of one unit's buffer and of the root unit's buffers, from the layouts."""
    units = model._fsdp_engine.units
    per_unit = set()
    for unit in units[1:]:
        assert len(unit.groups) == 1, "every Block must be exactly one group"
        group = unit.groups[0]
        numel = group.layout.total_numel
        per_unit.add((numel * group.dtypes.compute.itemsize, numel * group.dtypes.grad_comm.itemsize))
    assert len(per_unit) == 1, f"units differ in size: {per_unit}"
    unit_weight, unit_grad = per_unit.pop()
    root = units[0]
    assert root.is_root and len(units) == len(model.blocks) + 1
    root_weight = sum(g.layout.total_numel * g.dtypes.compute.itemsize for g in root.groups)
    root_grad = sum(g.layout.total_numel * g.dtypes.grad_comm.itemsize for g in root.groups)
    return {"unit_weight": unit_weight, "unit_grad": unit_grad, "root_weight": root_weight, "root_grad": root_grad}


POLICIES = {
    None: None,
    # compute weights half the size of grads: the ZeRO-3 bound is 2 * W + G, not 3 * W
    BF16: MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    # bf16 everywhere but fp32 grad collectives: ZeRO-2's temporaries (fp32) are twice as wide per
    # unit as ZeRO-1's persistent grads (bf16), so ZeRO-2 <= ZeRO-1 needs the in-flight bound
    BF16_GRADS: MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.bfloat16,
                                     main_grads_dtype=torch.bfloat16, grad_comm_dtype=torch.float32),
}


def _run_config(rank, strategy, allocator, n_units, precision=None):
    torch.manual_seed(0)
    model = fully_shard(BlockStack(n_units), sharding_strategy=strategy, unit_modules=[Block],
                        allocator=allocator, mixed_precision=POLICIES[precision])
    alloc = model._fsdp_engine.allocator
    events = _record_allocations(alloc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    compute_dtype = torch.float32 if precision is None else torch.bfloat16
    steps = []
    for step in range(STEPS):
        phases = []   # per micro-batch: (forward peak, backward peak)
        for i, (x, y) in enumerate(_batches(step, rank, MICRO_BATCHES, compute_dtype)):
            with (model.no_sync() if i < MICRO_BATCHES - 1 else contextlib.nullcontext()):
                alloc.reset_peak()
                out = model(x)
                forward_peak = alloc.peak_live_bytes
                alloc.reset_peak()
                ((out - y) ** 2).mean().backward()
                phases.append((forward_peak, alloc.peak_live_bytes))
        opt.step()
        persistent = model.persistent_bytes()     # before zero_grad(set_to_none=True) frees the grads
        opt.zero_grad()
        steps.append({"phases": phases, "live_after": alloc.live_bytes, "live_keys": alloc.live_keys()})
    result = {
        "sizes": _byte_sizes(model),
        "steps": steps,
        "peak_over_run": max(max(p) for s in steps for p in s["phases"]),
        "persistent": persistent,
        "state": {n: t.clone() for n, t in model.full_state_dict().items()},
        "events": [(kind, key, live) for kind, key, _, live in events if kind != "step"],
        "iterations": _addresses_per_iteration(events),
    }
    if allocator == "trace_pool":
        result.update(retrace_count=alloc.retrace_count, pool_bytes=alloc.pool_bytes,
                      plan_pool_bytes=alloc.plan.pool_bytes if alloc.plan is not None else None,
                      pool_ranges=[(p.data_ptr(), p.data_ptr() + p.numel()) for p in alloc._pools.values()])
    return result


def default_configs():
    # optim / no_shard make no temporaries at any size: 4 units suffice for them, plus one 8-unit
    # ZeRO-1 run whose persistent grads the 8-unit ZeRO-2 runs are compared with
    configs = [(s, a, n, None) for s in STRATEGY_NAMES for a in ALLOCATORS for n in UNIT_COUNTS
               if n == UNIT_COUNTS[0] or s in ("optim_grads", "optim_grads_params")]
    configs += [("optim", "storage_freeing", n, None) for n in UNIT_COUNTS[1:]]
    configs += [("optim_grads_params", a, 4, BF16) for a in ALLOCATORS]
    configs += [(s, "storage_freeing", 4, BF16_GRADS) for s in ("optim", "optim_grads")]
    return configs


def bounds_worker(rank, world_size, configs=None):
    """Train every configuration for ``STEPS`` steps; return {config: measurements} (see _run_config).

    The full state dicts are compared here (between allocators, bitwise) so they need not travel."""
    report = {config: _run_config(rank, *config) for config in (configs or default_configs())}
    for (strategy, allocator, n_units, precision), result in report.items():
        reference = report.get((strategy, "storage_freeing", n_units, precision))
        if allocator == "trace_pool" and reference is not None:
            result["differs_from_storage_freeing"] = [
                name for name, value in result["state"].items()
                if not (value.dtype == reference["state"][name].dtype and torch.equal(value, reference["state"][name]))]
            initial = _initial_state(n_units)
            result["moved"] = max((result["state"][n] - initial[n]).abs().max().item() for n in initial)
    for result in report.values():
        del result["state"]
    return report


def _initial_state(n_units):
    torch.manual_seed(0)
    return BlockStack(n_units).state_dict()


# -- the tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"dp{ws}")
def reports(request):
    """Per rank: {(strategy, allocator, n_units, precision): measurements}, one spawned job per world size."""
    return run_distributed(bounds_worker, request.param)


def _configs(reports, strategy):
    for rank, report in enumerate(reports):
        for config, result in report.items():
            if config[0] == strategy:
                yield rank, config, result


def _in_units(nbytes, unit_bytes):
    return round(nbytes / unit_bytes, 3)


def test_every_configuration_ran(reports):
    assert len(reports[0]) == len(default_configs())
    for report in reports:
        assert set(report) == set(default_configs())


def test_every_step_frees_every_temporary(reports):
    for rank, report in enumerate(reports):
        for config, result in report.items():
            for step, s in enumerate(result["steps"]):
                assert s["live_after"] == 0 and not s["live_keys"], (rank, config, step, s["live_keys"])


def test_zero3_backward_holds_at_most_three_unit_buffers(reports):
    """Current unit's weights + the prefetched unit's weights + one full-size grad in flight."""
    for rank, config, result in _configs(reports, "optim_grads_params"):
        sz = result["sizes"]
        root = sz["root_weight"] + sz["root_grad"]
        bound = 2 * sz["unit_weight"] + sz["unit_grad"] + root
        for step, s in enumerate(result["steps"]):
            for micro, (forward_peak, backward_peak) in enumerate(s["phases"]):
                where = f"rank {rank} {config} step {step} micro-batch {micro}"
                assert backward_peak <= bound, (
                    f"{where}: backward peak {backward_peak} B > bound {bound} B = 2 x {sz['unit_weight']} "
                    f"(weights) + {sz['unit_grad']} (grad) + {root} (root unit); that is "
                    f"{_in_units(backward_peak - root, sz['unit_weight'])} unit weight buffers")
                # forward: this unit + the prefetched next one, no grads
                assert forward_peak <= 2 * sz["unit_weight"] + sz["root_weight"], (
                    f"{where}: forward peak {forward_peak} B > 2 unit weight buffers + root ({sz})")
                # the measurement is live: a ZeRO-3 backward needs one unit's weights and grads
                assert backward_peak >= sz["unit_weight"] + sz["unit_grad"], (where, backward_peak, sz)


def test_zero2_holds_at_most_two_units_of_full_grads(reports):
    for rank, config, result in _configs(reports, "optim_grads"):
        sz = result["sizes"]
        bound = 2 * sz["unit_grad"] + sz["root_grad"]
        for step, s in enumerate(result["steps"]):
            for micro, (forward_peak, backward_peak) in enumerate(s["phases"]):
                where = f"rank {rank} {config} step {step} micro-batch {micro}"
                assert forward_peak == 0, f"{where}: ZeRO-2 allocated {forward_peak} B in forward"
                assert backward_peak <= bound, (
                    f"{where}: backward peak {backward_peak} B > bound {bound} B "
                    f"({_in_units(backward_peak, sz['unit_grad'])} unit grad buffers)")
                assert backward_peak >= sz["unit_grad"], (where, backward_peak, sz)


def test_zero2_temporary_peak_within_zero1_persistent_grads(reports):
    for rank, report in enumerate(reports):
        for (strategy, allocator, n_units, precision), result in report.items():
            if strategy != "optim_grads":
                continue
            # persistent bytes do not depend on the allocator
            zero1 = (report.get(("optim", allocator, n_units, precision))
                     or report[("optim", "storage_freeing", n_units, precision)])
            zero1_grads = zero1["persistent"]["grads"]
            assert result["peak_over_run"] <= zero1_grads, (
                f"rank {rank} {(strategy, allocator, n_units, precision)}: ZeRO-2 temporaries peak at "
                f"{result['peak_over_run']} B, ZeRO-1 keeps {zero1_grads} B of full grads")
            assert zero1_grads > 0


@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_unsharded_grad_strategies_make_no_temporaries(reports, strategy):
    for rank, config, result in _configs(reports, strategy):
        if config[3] == BF16_GRADS:
            # grads kept in bf16, reduced in fp32: the only temporary is the cast for the reduce,
            # one group at a time (one unit of fp32 grads at most)
            keys = {event[1][1] for event in result["events"]}
            assert keys == {"comm_grad"}, (rank, config, keys)
            assert 0 < result["peak_over_run"] <= 2 * result["sizes"]["unit_grad"], (rank, config)
            continue
        assert result["peak_over_run"] == 0 and not result["events"], (rank, config, result["events"][:4])
        if config[1] == "trace_pool":
            # an empty trace plans an empty pool, and steps over it without ever re-planning
            assert len(result["iterations"]) == STEPS and not any(result["iterations"]), (rank, config)
            assert result["plan_pool_bytes"] == 0 and result["pool_bytes"] == 0, (rank, config)
            assert result["retrace_count"] == 0, (rank, config)


# ZeRO-3 unshards every unit twice per iteration (forward, backward). autograd saves *views* of the
# forward's weights (``weight.t()`` inside ``linear``) and reads them in backward, so the trace pool
# must give both occurrences of a key the same bytes (``stable_keys``, pool_plan.py); with one range
# per (key, occurrence) the two ZeRO-3 cases below fail (wrong gradients; a re-plan in iteration 2
# because iteration 1's forward cannot prefetch before the forward order is known).
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_trace_pool_addresses_fixed_in_iterations_two_and_three(reports, strategy):
    """Iterations are the allocator's (between two ``step()`` calls: every micro-batch for ZeRO-2/3,
    every optimizer step for ZeRO-1 and DDP)."""
    for rank, config, result in _configs(reports, strategy):
        if config[1] != "trace_pool":
            continue
        iterations = result["iterations"]
        assert len(iterations) >= 3, (rank, config, len(iterations))
        second, third = iterations[1], iterations[2]
        moved = sorted(k for k in set(second) | set(third) if second.get(k) != third.get(k))
        assert not moved, f"rank {rank} {config}: addresses of {moved} differ between iterations 2 and 3"
        assert result["retrace_count"] == 0, (rank, config, result["retrace_count"])
        if strategy in ("optim_grads", "optim_grads_params"):
            assert second, (rank, config, "no temporaries recorded")
            (lo, hi), = result["pool_ranges"]
            outside = [k for k, ptr in second.items() if not lo <= ptr < hi]
            assert not outside, f"rank {rank} {config}: {outside} not served from the pool"


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_allocators_give_bitwise_identical_numerics(reports, strategy):
    """Full state dicts after 4 AdamW steps: trace_pool vs storage_freeing, torch.equal per tensor."""
    compared = 0
    for rank, config, result in _configs(reports, strategy):
        if config[1] != "trace_pool":
            continue
        compared += 1
        assert result["differs_from_storage_freeing"] == [], (rank, config)
        assert result["moved"] > 1e-3, (rank, config, "weights did not train")
    assert compared >= len(reports)
