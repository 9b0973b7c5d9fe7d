"""CPU bytes a process holds during a region of code, where no allocator counter exists.

``torch.cuda.max_memory_allocated`` has no CPU counterpart, so a peak on CPU is put together
from two exact pieces:

* held bytes: every CPU storage reachable from a live tensor, found by a scan of the garbage
  collector's objects (each storage counted once, however many views share it), less those
  already live in a ``baseline`` taken before the measured code began (a pooled worker keeps
  other tests' tensors; the baseline keeps its storages referenced, so no new storage can reuse
  their addresses and be mistaken for one of them);
* the allocator's events inside the region, from ``torch.profiler`` with ``profile_memory``: each
  allocation and each free of a block allocated inside the region, in order, on the calling
  thread. Their running sum's maximum is the most the region ever added on top of what it began
  with; the frees of blocks that existed before are not seen, so the peak is an upper bound.

``measure(fn, baseline)`` runs ``fn`` once and returns ``RegionBytes`` (held at start, peak, held
at end, and the largest allocations live at the peak, named by the op and Python frames that
made them). ``held at start + net events == held at end`` checks the two pieces against each
other. Frees on other threads (gloo's workers) are not reported to the profiler, so regions that
run collectives are not measured exactly: the optimizer step of a ZeRO-3 model runs none.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from testing.settled import settled

__all__ = ["RegionBytes", "allocated_peak", "held_bytes", "live_storages", "measure"]

#: Frames that say nothing about who allocated (every call goes through them).
_NOISE = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "contextlib.py", "torch/_ops.py",
          "torch/optim/optimizer.py")


def live_storages() -> Dict[int, Tuple[int, object]]:
    """``{data_ptr: (nbytes, storage)}`` of every non-empty CPU storage a live tensor uses."""
    gc.collect()
    found: Dict[int, Tuple[int, object]] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):        # type(): no __class__ lookups (deprecated objects warn)
            continue
        try:
            if obj.device.type != "cpu" or obj.is_meta:
                continue
            storage = obj.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):          # wrapper subclasses (DTensor): no storage
            continue
        if ptr and nbytes:
            found[ptr] = (nbytes, storage)
    return found


def held_bytes(baseline: Dict[int, Tuple[int, object]]) -> int:
    """Bytes of the CPU storages live now that were not live in ``baseline``, once two readings agree
    (see testing/settled.py)."""
    return settled(lambda: sum(nbytes for ptr, (nbytes, _) in live_storages().items() if ptr not in baseline))


@dataclass
class RegionBytes:
    """What a measured region held: bytes at its start, at its peak, at its end."""

    held_at_start: int
    peak: int
    held_at_end: int
    net_events: int                                # allocations minus frees the profiler saw
    at_peak: List[Tuple[int, str]] = field(default_factory=list)   # (bytes, who), largest first

    @property
    def consistent(self) -> bool:
        """The scan at the end agrees with the scan at the start plus the events between."""
        return self.held_at_start + self.net_events == self.held_at_end


def _label(node) -> str:
    op, frames = "", []
    parent = node.parent
    while parent is not None and len(frames) < 4:
        if parent.tag == _EventType.TorchOp and not op and not frames:
            op = parent.name
        elif parent.tag == _EventType.PyCall and not any(n in parent.name for n in _NOISE):
            frames.append(parent.name.rsplit("/", 1)[-1])
        parent = parent.parent
    return " < ".join(([op] if op else []) + frames)


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _replay(events) -> Tuple[int, int, List[Tuple[int, str]]]:
    """(peak of the running sum, its final value, allocations live at the peak)."""
    live: Dict[int, Tuple[int, object]] = {}
    now = peak = 0
    at_peak: Dict[int, Tuple[int, object]] = {}
    for node in events:
        fields = node.extra_fields
        if fields.alloc_size > 0:
            if fields.ptr in live:                 # freed where the profiler did not see it
                now -= live.pop(fields.ptr)[0]
            live[fields.ptr] = (fields.alloc_size, node)
            now += fields.alloc_size
        elif fields.ptr in live:
            now -= live.pop(fields.ptr)[0]
        if now > peak:
            peak, at_peak = now, dict(live)
    named = sorted(((size, _label(node)) for size, node in at_peak.values()), reverse=True)
    return peak, now, named


def _events_of(fn: Callable[[], object]) -> Tuple[int, int, List[Tuple[int, str]]]:
    """Run ``fn()`` under the profiler: ``_replay`` of its CPU allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        fn()
    events = [n for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
              if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"]
    events.sort(key=lambda n: n.start_time_ns)
    return _replay(events)


def measure(fn: Callable[[], object], baseline: Dict[int, Tuple[int, object]], top: int = 8) -> RegionBytes:
    """Run ``fn()`` once and report the CPU bytes held at its start, peak and end (see module)."""
    start = held_bytes(baseline)
    peak, net, at_peak = _events_of(fn)
    return RegionBytes(start, start + peak, held_bytes(baseline), net, at_peak[:top])


def allocated_peak(fn: Callable[[], object], top: int = 8) -> Tuple[int, List[Tuple[int, str]]]:
    """``measure``'s peak above what was held when ``fn`` began, and the allocations live at it, from
    the allocator's events alone: no scan of live storages (each takes about a second with torch,
    torchao and transformers imported). Exact for a region whose tensors all come into being
    inside it (a model built and wrapped there), an upper bound otherwise."""
    peak, _, at_peak = _events_of(fn)
    return peak, at_peak[:top]
