"""Temporary buffers at fixed addresses: record one iteration, plan a pool, replay it.

Why: every training iteration allocates the same temporaries in the same order. After one
recorded iteration, a single flat pool per device with a planned offset for each (key,
occurrence) serves them all, so each buffer has the same ``data_ptr`` in every later iteration
(what CUDA graphs need) and buffers that are never live together share bytes.

Life of the allocator::

    iteration 1        step()            iteration 2, 3, ...            step()
    fresh torch.empty  plan_pool(trace)  views of the pool at the       re-plan only if the
    + record trace     + allocate pool   planned offsets, checked       iteration diverged
                                         against the plan

[Note: A diverging iteration never overlaps silently]
Later iterations are still recorded. An allocation is served from the pool only if its (key,
occurrence) is in the plan with the same byte size and its planned range shares no byte with a
pool range that is live right now (a reordered schedule could make two planned ranges live
together). Otherwise it gets a fresh ``torch.empty`` and the allocator re-plans at the next
``step()`` from the iteration just recorded. Re-planning needs a self-contained trace, so it
waits for a ``step()`` at which no key is live and whose iteration also began with none live.

A schedule that alternates between two different iterations re-plans every step;
``retrace_count`` makes that visible.
"""

from __future__ import annotations

import torch

from megatron_fsdp_v2.allocators.base import Allocator, BufferKey
from megatron_fsdp_v2.allocators.pool_plan import DEFAULT_ALIGNMENT, PoolPlan, SlotKey, TraceEvent, plan_pool
from megatron_fsdp_v2.allocators.storage_freeing import normalize_device

# The widest element size torch has (complex128); offsets that are multiples of it can be viewed
# as any dtype.
_VIEW_ALIGNMENT = 16


class TracePoolAllocator(Allocator):
    """Serves temporaries from one planned pool per device after a recorded first iteration.

    Attributes: ``plans`` (device -> PoolPlan, None before the first plan), ``plan`` (the
    single device's plan), ``pool_bytes`` (all pools together), ``retrace_count`` (re-plans
    after the first plan).
    """

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT, stable_keys: bool = True) -> None:
        super().__init__()
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment % _VIEW_ALIGNMENT:
            raise ValueError(f"TracePoolAllocator: alignment must be a positive multiple of {_VIEW_ALIGNMENT} bytes, got {alignment!r}.")
        self.alignment = alignment
        self.stable_keys = stable_keys   # one address per key: see [Note: Stable keys] in pool_plan.py
        self.retrace_count = 0
        self._plans: dict[torch.device, PoolPlan] | None = None
        self._pools: dict[torch.device, torch.Tensor] = {}
        self._needs_retrace = False
        self._live_device: dict[BufferKey, torch.device] = {}
        self._live_ranges: dict[BufferKey, tuple[torch.device, int, int]] = {}  # pool-served keys only
        self._reset_recording(clean_start=True)

    # -- public state -----------------------------------------------------------------------
    @property
    def plans(self) -> dict[torch.device, PoolPlan] | None:
        return None if self._plans is None else dict(self._plans)

    @property
    def plan(self) -> PoolPlan | None:
        """The current plan; a planned iteration without allocations gives an empty plan."""
        if self._plans is None:
            return None
        if len(self._plans) > 1:
            raise RuntimeError(f"TracePoolAllocator.plan: there is one plan per device for {sorted(map(str, self._plans))}; use .plans.")
        if not self._plans:
            return plan_pool([], self.alignment)
        return next(iter(self._plans.values()))

    @property
    def pool_bytes(self) -> int:
        return sum(pool.numel() for pool in self._pools.values())

    @property
    def needs_retrace(self) -> bool:
        """True when the iteration being recorded diverged from the plan (re-plan at ``step``)."""
        return self._needs_retrace

    # -- Allocator hooks ----------------------------------------------------------------------
    def _allocate(self, key: BufferKey, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        device = normalize_device(device)
        nbytes = numel * dtype.itemsize
        occurrence = self._occurrences.get((device, key), 0)
        self._occurrences[(device, key)] = occurrence + 1
        self._traces.setdefault(device, []).append(("alloc", key, nbytes))
        self._live_device[key] = device
        if self._plans is None:  # recording the first iteration
            return torch.empty(numel, dtype=dtype, device=device)
        byte_range = self._planned_range(device, (key, occurrence), nbytes)
        if byte_range is None:  # see [Note: A diverging iteration never overlaps silently]
            self._needs_retrace = True
            return torch.empty(numel, dtype=dtype, device=device)
        self._live_ranges[key] = (device, *byte_range)
        start, end = byte_range
        return self._pools[device][start:end].view(dtype)[:numel]

    def _free(self, key: BufferKey) -> None:
        device = self._live_device.pop(key)
        self._traces.setdefault(device, []).append(("free", key))
        self._live_ranges.pop(key, None)

    # -- iteration boundary -------------------------------------------------------------------
    def step(self) -> None:
        """End of one iteration: plan (first time) or re-plan (after a divergence) if possible."""
        self_contained = self._clean_start and not self.live_keys()
        if self_contained and (self._plans is None or self._needs_retrace):
            if self._plans is not None:
                self.retrace_count += 1
            self._replan()
        self._reset_recording(clean_start=not self.live_keys())

    def release(self) -> None:
        """Give every pool back; the next iteration is recorded and planned again."""
        if self.live_keys():
            raise RuntimeError(f"TracePoolAllocator.release: keys {self.live_keys()!r} are still allocated; free them first.")
        self._pools.clear()
        self._plans = None
        self._needs_retrace = False
        self._reset_recording(clean_start=True)

    # -- internals ----------------------------------------------------------------------------
    def _reset_recording(self, clean_start: bool) -> None:
        self._traces: dict[torch.device, list[TraceEvent]] = {}
        self._occurrences: dict[tuple[torch.device, BufferKey], int] = {}
        self._clean_start = clean_start

    def _replan(self) -> None:
        # Drop the old pools first so their memory can back the new ones (views handed out
        # earlier keep the old storage alive until they die; none are live now).
        self._pools.clear()
        plans = {device: plan_pool(trace, self.alignment, self.stable_keys) for device, trace in self._traces.items()}
        self._plans = plans
        self._pools = {device: torch.empty(plan.pool_bytes, dtype=torch.uint8, device=device) for device, plan in plans.items()}
        self._needs_retrace = False

    def _planned_range(self, device: torch.device, slot: SlotKey, nbytes: int) -> tuple[int, int] | None:
        """The planned byte range for ``slot`` if it is safe to hand out now, else None."""
        plan = self._plans.get(device)
        if plan is None or slot not in plan.offsets or plan.nbytes[slot] != nbytes:
            return None
        start, end = plan.byte_range(slot)
        for live_device, live_start, live_end in self._live_ranges.values():
            if live_device == device and start < live_end and live_start < end:
                return None
        return start, end
