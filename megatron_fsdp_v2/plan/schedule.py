"""One step's temporaries and collectives, replayed from the engine's schedule on planned groups.

[Note: the planned schedule]
runtime/engine.py ([Note: the life of one training step], [Note: bounds on temporary buffers]) decides
when a group allocates from the allocator and when it talks; this file writes the same order
down as an allocation trace (allocators/pool_plan.py's events, so ``peak_bytes`` and
``plan_pool`` -- the trace-pool allocator's own planner -- give the peak per allocator) and as
counts of collectives in ``comm_stats()``'s form. It assumes what a training loop does: units
run in module order, every parameter gets a gradient, ``k`` micro-batches of which the first
``k - 1`` run under ``no_sync()``, one optimizer stepping every parameter, and the steady state
(the first forward does not prefetch yet: ``first_iteration=True`` replays that one). Besides the
allocator's buffers (gathered ZeRO-3 weights, reduce inputs) it traces the gradients ZeRO-2/3 hold
per parameter until their group reduces (``held_grads``: autograd's tensors, not the
allocator's); a root group is taken to hold them from the start of backward (its output layer
usually gets its gradient first), an upper bound.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..allocators.pool_plan import DEFAULT_ALIGNMENT, lifetimes_from_trace, peak_bytes, plan_pool
from ..comm import COLLECTIVES
from ..strategy import ShardingStrategy
from .groups import PlannedUnit

__all__ = ["microbatch_trace", "step_temporaries", "step_comm", "ring_bytes"]


class _Trace:
    """Events tagged with what they hold: ``weights``, ``reduce_input``, ``held_grads`` or (traced
    for plan/phases.py only) ``grad_buffer``: gradient buffers made again after ``zero_grad`` freed
    them (DDP/ZeRO-1 at a group's first gradient, ZeRO-2/3 when its first reduce is issued)."""

    def __init__(self) -> None:
        self.events: list = []
        self.live: dict = {}          # key -> (kind, bytes)
        self._bytes: dict = {}        # key -> bytes of its last allocation
        self.marks: dict = {}         # name -> how many events had happened when the schedule first passed it

    def alloc(self, key, nbytes: int, kind: str) -> None:
        if key not in self.live:
            self.live[key] = (kind, nbytes)
            self._bytes[key] = nbytes
            self.events.append(("alloc", key, nbytes, kind))

    def free(self, key) -> None:
        if key in self.live:
            self.events.append(("free", key, self.live.pop(key)[0]))

    def mark(self, name: str) -> None:
        """Name this moment of the schedule (its first pass only)."""
        self.marks.setdefault(name, len(self.events))

    def live_between(self, start: str, end: str, kinds: tuple) -> tuple:
        """(bytes of ``kinds`` live at mark ``start``, their most between ``start`` and ``end``)."""
        live = at_start = most = 0
        for index, event in enumerate(self.events + [None]):
            if index == self.marks[start]:
                at_start = most = live
            if index == self.marks[end] or event is None:
                break
            if event[-1] in kinds:
                live += event[2] if event[0] == "alloc" else -self._bytes[event[1]]
                if index >= self.marks[start]:
                    most = max(most, live)
        return at_start, most

    def allocator_events(self) -> list:
        """The trace as the allocator records it (autograd's held gradients left out)."""
        keep = [e for e in self.events if e[-1] in ("weights", "reduce_input")]
        return [("alloc", e[1], e[2]) if e[0] == "alloc" else ("free", e[1]) for e in keep]

    def all_events(self) -> list:
        """Every temporary (not the gradient buffers)."""
        keep = [e for e in self.events if e[-1] != "grad_buffer"]
        return [("alloc", e[1], e[2]) if e[0] == "alloc" else ("free", e[1]) for e in keep]


def _weights(trace: _Trace, unit: PlannedUnit, alloc: bool) -> None:
    """Gather (``alloc``: the buffer the collective fills; under per-parameter shards the rank-major
    one, the natural one following when it lands) or free a unit's weights."""
    for group in unit.groups:
        key = (group.tag, "gathered_weights" if group.layout.per_parameter else "model_weights")
        if alloc:
            if (group.tag, "model_weights") not in trace.live:
                trace.alloc(key, group.compute_bytes, "weights")
        else:
            trace.free((group.tag, "model_weights"))


def _landed(trace: _Trace, unit: PlannedUnit) -> None:
    """A unit's gather waited for: per-parameter shards copy out into the natural buffer and free
    the rank-major one."""
    for group in unit.groups:
        if (group.tag, "gathered_weights") in trace.live:
            trace.alloc((group.tag, "model_weights"), group.compute_bytes, "weights")
            trace.free((group.tag, "gathered_weights"))


def _forward(trace: _Trace, units: list, prefetch: bool) -> None:
    """ZeRO-3: the root stays gathered through forward; each unit gathers (waited for before the
    next is prefetched), prefetches the next; a unit that does not reshard after forward stays
    gathered into backward."""
    root, rest = units[0], units[1:]
    _weights(trace, root, True)
    _landed(trace, root)
    for i, unit in enumerate(rest):
        _weights(trace, unit, True)
        _landed(trace, unit)
        if prefetch and i + 1 < len(rest):
            _weights(trace, rest[i + 1], True)
        if unit.reshards_after_forward:
            _weights(trace, unit, False)
    if root.reshards_after_forward:
        _weights(trace, root, False)


class _Reducer:
    """The engine's one reduce in flight: waiting for it frees its input."""

    def __init__(self, trace: _Trace, strategy: ShardingStrategy, grad_buffers: bool) -> None:
        self.trace, self.strategy, self.in_flight = trace, strategy, None
        self.grad_buffers = grad_buffers

    def wait(self) -> None:
        if self.in_flight is not None:
            self.trace.free(self.in_flight)
            self.in_flight = None

    def first_grad(self, group) -> None:
        if self.strategy.grads_sharded:
            self.wait()
            self.trace.alloc((group.tag, "held"), group.held_grad_bytes, "held_grads")
        elif self.grad_buffers:
            self._grad_buffer(group, group.layout.total_numel)

    def _grad_buffer(self, group, numel: int) -> None:
        self.trace.alloc((group.tag, "grad_buffer"), numel * group.dtypes.grad.itemsize, "grad_buffer")

    def reduce(self, group) -> None:
        self.wait()
        needs_copy = self.strategy.grads_sharded or group.dtypes.grad_comm != group.dtypes.grad
        if needs_copy:
            key = (group.tag, "comm_grad")
            self.trace.alloc(key, group.reduce_input_bytes, "reduce_input")
            self.in_flight = key
        if self.grad_buffers and self.strategy.grads_sharded:   # the first reduce after zero_grad writes a new shard
            self._grad_buffer(group, group.layout.shard_numel)
        self.trace.free((group.tag, "held"))


def _backward(trace: _Trace, units: list, strategy: ShardingStrategy, reduces: bool, prefetch: bool,
              grad_buffers: bool = False) -> None:
    sharded = strategy.weights_sharded
    root, rest = units[0], units[1:]
    reducer = _Reducer(trace, strategy, grad_buffers)
    root_grads = [g for g in root.groups if g.requires_grad]
    if sharded:
        _weights(trace, root, True)
        _landed(trace, root)
    for group in root_grads:
        reducer.first_grad(group)
    for i in range(len(rest) - 1, -1, -1):
        unit = rest[i]
        if sharded:
            _weights(trace, unit, True)
            _landed(trace, unit)
            if prefetch and i > 0:
                _weights(trace, rest[i - 1], True)
        trace.mark("backward_start")          # the last unit's backward has begun (phases.py)
        if i == len(rest) - 2:
            trace.mark("previous_unit_grads")  # its first gradient arrives (the last unit's reduce waited)
        grad_groups = [g for g in unit.groups if g.requires_grad]
        for j, group in enumerate(grad_groups):
            reducer.first_grad(group)
            if not (reduces or strategy.reduce_every_microbatch):
                continue
            if sharded and j == len(grad_groups) - 1:
                _weights(trace, unit, False)
            reducer.reduce(group)
    trace.mark("backward_start")              # (a model with no unit below the root)
    trace.mark("previous_unit_grads")         # (or one unit only)
    if reduces or strategy.reduce_every_microbatch:
        for group in root_grads:
            if sharded:                       # its gradients are complete: resharded before it reduces
                trace.free((group.tag, "model_weights"))
            reducer.reduce(group)
    reducer.wait()
    if sharded:
        for unit in units:
            _weights(trace, unit, False)


def microbatch_trace(units: list, strategy: ShardingStrategy, shard_size: int, reduces: bool = True,
                     first_iteration: bool = False, grad_buffers: bool = False) -> _Trace:
    """One micro-batch's forward and backward ([Note: the planned schedule]); ``grad_buffers``:
    trace DDP/ZeRO-1's gradient buffers too (freed by ``zero_grad``, made again at a first gradient)."""
    trace = _Trace()
    worth = shard_size > 1          # engine.Unit.worth_prefetching: no prefetch over a one-rank gather
    if strategy.weights_sharded:
        _forward(trace, units, prefetch=worth and not first_iteration)
    trace.mark("forward_end")
    _backward(trace, units, strategy, reduces, prefetch=worth, grad_buffers=grad_buffers)
    return trace


def step_temporaries(units: list, strategy: ShardingStrategy, shard_size: int, micro_batches: int) -> dict:
    """Peak bytes of one steady step's temporaries: per kind, and per allocator."""
    trace = _Trace()
    for i in range(micro_batches):
        trace.events += microbatch_trace(units, strategy, shard_size, reduces=i == micro_batches - 1).events
    alloc_events = trace.allocator_events()
    kinds = {}
    for kind in ("weights", "reduce_input", "held_grads"):
        kinds[kind] = peak_bytes(lifetimes_from_trace(
            [(e[0], e[1], e[2]) if e[0] == "alloc" else (e[0], e[1]) for e in trace.events if e[-1] == kind]))
    # the trace-pool allocator plans its pool from the first iteration it records (allocators/trace_pool.py)
    first = microbatch_trace(units, strategy, shard_size, reduces=True, first_iteration=True)
    if not strategy.reduce_every_microbatch:
        first.events = [e for i in range(micro_batches - 1)
                        for e in microbatch_trace(units, strategy, shard_size, False, True).events] + first.events
    return {
        "gathered_weights": kinds["weights"],
        "reduce_inputs": kinds["reduce_input"],
        "held_grads": kinds["held_grads"],
        "storage_freeing": peak_bytes(lifetimes_from_trace(alloc_events)),
        "trace_pool": plan_pool(first.allocator_events(), DEFAULT_ALIGNMENT, stable_keys=True).pool_bytes,
        "peak": peak_bytes(lifetimes_from_trace(trace.all_events())),
    }


def _empty_stats() -> dict:
    return {**{name: {"count": 0, "bytes": 0} for name in COLLECTIVES}, "bytes_by_dtype": {}}


def _add(stats: dict, name: str, count: int, nbytes: int, dtype: torch.dtype) -> None:
    stats[name]["count"] += count
    stats[name]["bytes"] += count * nbytes
    by_dtype = stats["bytes_by_dtype"].setdefault(name, {})
    by_dtype[str(dtype)] = by_dtype.get(str(dtype), 0) + count * nbytes


def step_comm(units: list, strategy: ShardingStrategy, micro_batches: int, shard_size: int,
              replicas: Optional[int] = None, buffer_bytes: Sequence[tuple] = ()) -> dict:
    """Collectives of one step in ``comm_stats()``'s form: the shard group at the top level and,
    with hybrid sharding (``replicas``: the outer size), the outer group under
    ``"across_replicas"``. ``buffer_bytes``: ``(dtype, bytes)`` of the module's buffers per dtype,
    which ``broadcast_buffers`` sends once per step (at the forward outside ``no_sync()``). Weights
    are counted in their compute dtype: a float8 gather (FSDP2's extension protocol) is not modelled."""
    k = micro_batches
    shard, outer = _empty_stats(), _empty_stats()
    for unit in units:
        for group in unit.groups:
            layout, dt = group.layout, group.dtypes
            if strategy.weights_sharded:              # before forward and (if resharded) backward
                _add(shard, "all_gather", (2 if unit.reshards_after_forward else 1) * k, group.compute_bytes,
                     dt.compute)
            elif strategy.optim_sharded:
                _add(shard, "all_gather", 1, group.compute_bytes, dt.compute)      # the refresh after the step
            if not group.requires_grad:
                continue
            _add(shard, strategy.grad_reduce_op, k if strategy.reduce_every_microbatch else 1,
                 group.reduce_input_bytes, dt.grad_comm)
            if replicas is not None and replicas > 1:
                numel = layout.shard_numel if strategy.optim_sharded else layout.total_numel
                _add(outer, "all_reduce", 1, numel * dt.grad.itemsize, dt.grad)
    for dtype, nbytes in buffer_bytes:
        if shard_size > 1:
            _add(shard, "broadcast", 1, nbytes, dtype)
        if replicas is not None and replicas > 1:
            _add(outer, "broadcast", 1, nbytes, dtype)
    shard["total_bytes"] = sum(shard[name]["bytes"] for name in COLLECTIVES)
    if replicas is None:
        return shard
    outer["total_bytes"] = sum(outer[name]["bytes"] for name in COLLECTIVES)
    return {**shard, "across_replicas": outer}


# bytes that cross a rank's link per byte a collective covers, on a ring of n ranks
_RING = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: (n - 1) / n,
         # an all-to-all covering B bytes over all ranks (optim/muon.py's exchanges): a rank sends
         # its ~B/n, of which the (n - 1)/n not meant for itself leave it
         "all_to_all": lambda n: (n - 1) / (n * n)}


def ring_bytes(stats: dict, size: int) -> int:
    """Bytes a rank sends per step for ``stats`` on a ring of ``size`` ranks (0 at one rank)."""
    return int(sum(_RING[name](size) * stats[name]["bytes"] for name in COLLECTIVES))
