"""Pure planning of one fixed-address memory pool from one iteration's allocation trace.

Why a plan: a training iteration allocates and frees the same temporary buffers in the same
order every step. Recording that order once lets us give every buffer a fixed byte range in one
flat pool, so addresses never change (CUDA graphs, no allocator fragmentation) while buffers
whose lifetimes do not overlap share bytes. No torch here: the math is testable on its own.

A trace is a list of events ``("alloc", key, nbytes)`` / ``("free", key)``. A key may be
allocated and freed several times (one per microbatch, say); each (key, occurrence) is its own
lifetime, an interval of event indices::

    event:  0 alloc A | 1 alloc B | 2 free A | 3 alloc A | 4 free B | 5 free A
    A#0:    [0, 2)    live 0-1                      pool (512 B each, alignment 512):
    B#0:    [1, 4)    live 1-3                        [   0,  512)  A#0, then A#1
    A#1:    [3, 5)    live 3-4                        [ 512, 1024)  B#0

[Note: Placement is interval-graph colouring with sizes]
Each lifetime, rounded up to ``alignment``, is placed by first fit: at the lowest aligned offset
where it shares no byte with an already-placed lifetime that overlaps it in time. Two orders are
tried and the smaller pool kept:

* largest first (ties by start): the usual heuristic for mixed sizes, optimal when all sizes
  are equal (then it is start order);
* start order: optimal for stack-like (nested, LIFO) traces, where largest first is not. With
  R=4 holding A=5 then B=3, and B holding C=3, largest first places A@0, R@5, B@0 and C@9 (12
  units) although at most R+B+C = 10 are ever live; start order stacks each lifetime on its
  live ancestors and needs exactly 10.

[Note: Stable keys]
With ``stable_keys=True`` every occurrence of a key gets the same offset: the key is placed once,
avoiding every placed lifetime that overlaps any of its own lifetimes in time. The engine needs
this for ZeRO-3 weights: autograd may save a *view* of a weight in forward (``weight.t()`` inside
``linear``) and read it in backward, after the unit was resharded and all-gathered again. The view
points at the forward's bytes, so the backward's buffer must sit at the same address.

Any plan needs at least ``peak_aligned_bytes`` (the lifetimes live at the peak moment are
pairwise disjoint) and first fit never needs more than the sum of all rounded sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

DEFAULT_ALIGNMENT = 512

TraceEvent = tuple  # ("alloc", key, nbytes) | ("free", key)
SlotKey = tuple[Hashable, int]  # (key, occurrence index within the trace)


@dataclass(frozen=True)
class Lifetime:
    """One (key, occurrence): ``nbytes`` live from event ``start`` up to event ``end`` (exclusive)."""

    slot: SlotKey
    nbytes: int
    start: int
    end: int

    def overlaps_in_time(self, other: "Lifetime") -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(frozen=True)
class PoolPlan:
    """Where each (key, occurrence) of a trace lives in one flat pool.

    ``nbytes`` keeps the requested size of every slot so a later iteration can be checked
    against the trace the plan came from. ``peak_live_bytes`` is the trace's peak of requested
    bytes; ``peak_aligned_bytes`` the same peak with sizes rounded up to ``alignment`` (the lower
    bound for ``pool_bytes``).
    """

    offsets: Mapping[SlotKey, int]
    nbytes: Mapping[SlotKey, int]
    pool_bytes: int
    peak_live_bytes: int
    peak_aligned_bytes: int
    alignment: int

    def byte_range(self, slot: SlotKey) -> tuple[int, int]:
        offset = self.offsets[slot]
        return offset, offset + self.nbytes[slot]


def align_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def lifetimes_from_trace(trace: Sequence[TraceEvent]) -> list[Lifetime]:
    """Turn a trace into lifetimes, rejecting traces that no schedule could have produced."""
    open_allocs: dict[Hashable, tuple[int, int, int]] = {}  # key -> (occurrence, nbytes, start)
    occurrences: dict[Hashable, int] = {}
    lifetimes: list[Lifetime] = []
    for index, event in enumerate(trace):
        kind = event[0] if isinstance(event, tuple) and event else None
        if kind == "alloc" and len(event) == 3:
            _, key, nbytes = event
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise ValueError(f"pool plan: event {index} allocates key {key!r} with nbytes {nbytes!r}; nbytes must be an int >= 0.")
            if key in open_allocs:
                raise ValueError(f"pool plan: key {key!r} is allocated again at event {index} without being freed first.")
            occurrence = occurrences.get(key, 0)
            occurrences[key] = occurrence + 1
            open_allocs[key] = (occurrence, nbytes, index)
        elif kind == "free" and len(event) == 2:
            key = event[1]
            if key not in open_allocs:
                raise ValueError(f"pool plan: key {key!r} is freed at event {index} but is not allocated.")
            occurrence, nbytes, start = open_allocs.pop(key)
            lifetimes.append(Lifetime((key, occurrence), nbytes, start, index))
        else:
            raise ValueError(f"pool plan: event {index} must be ('alloc', key, nbytes) or ('free', key), got {event!r}.")
    if open_allocs:
        raise ValueError(f"pool plan: key(s) {sorted(map(repr, open_allocs))} are still allocated at the end of the trace; every alloc needs a free.")
    return lifetimes


def peak_bytes(lifetimes: Iterable[Lifetime], alignment: int = 1) -> int:
    """Largest sum of (rounded) sizes live at one moment."""
    deltas: list[tuple[int, int]] = []
    for life in lifetimes:
        size = align_up(life.nbytes, alignment)
        deltas += [(life.start, size), (life.end, -size)]
    live = peak = 0
    for _, delta in sorted(deltas):  # event indices are unique, so no ties to order
        live += delta
        peak = max(peak, live)
    return peak


def first_fit(lifetimes: Sequence[Lifetime], alignment: int) -> tuple[dict[SlotKey, int], int]:
    """Place lifetimes in the given order; return (offsets, pool_bytes). See the Note above."""
    placed: list[tuple[Lifetime, int, int]] = []  # (lifetime, first byte, end byte), rounded
    offsets: dict[SlotKey, int] = {}
    pool_bytes = 0
    for life in lifetimes:
        size = align_up(life.nbytes, alignment)
        if size == 0:  # an empty buffer shares no byte with anything
            offsets[life.slot] = 0
            continue
        blockers = sorted((lo, hi) for other, lo, hi in placed if other.overlaps_in_time(life))
        offset = 0
        for lo, hi in blockers:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        offsets[life.slot] = offset
        placed.append((life, offset, offset + size))
        pool_bytes = max(pool_bytes, offset + size)
    return offsets, pool_bytes


def first_fit_stable(lifetimes: Sequence[Lifetime], alignment: int) -> tuple[dict[SlotKey, int], int]:
    """First fit of whole keys (all their occurrences at one offset), largest key first."""
    by_key: dict = {}
    for life in lifetimes:
        by_key.setdefault(life.slot[0], []).append(life)
    order = sorted(by_key.values(), key=lambda lives: (-max(align_up(l.nbytes, alignment) for l in lives),
                                                         min(l.start for l in lives)))
    placed: list[tuple[Lifetime, int, int]] = []
    offsets: dict[SlotKey, int] = {}
    pool_bytes = 0
    for lives in order:
        size = max(align_up(l.nbytes, alignment) for l in lives)
        if size == 0:
            offsets.update({l.slot: 0 for l in lives})
            continue
        blockers = sorted((lo, hi) for other, lo, hi in placed if any(other.overlaps_in_time(l) for l in lives))
        offset = 0
        for lo, hi in blockers:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        for life in lives:
            offsets[life.slot] = offset
            placed.append((life, offset, offset + size))
        pool_bytes = max(pool_bytes, offset + size)
    return offsets, pool_bytes


def plan_pool(trace: Sequence[TraceEvent], alignment: int = DEFAULT_ALIGNMENT,
              stable_keys: bool = False) -> PoolPlan:
    """Plan one pool for ``trace``; an empty trace gives an empty pool (``pool_bytes == 0``)."""
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise ValueError(f"pool plan: alignment must be a positive int, got {alignment!r}.")
    lifetimes = lifetimes_from_trace(trace)
    if stable_keys:
        offsets, pool_bytes = first_fit_stable(lifetimes, alignment)
        return PoolPlan(offsets=offsets, nbytes={life.slot: life.nbytes for life in lifetimes},
                        pool_bytes=pool_bytes, peak_live_bytes=peak_bytes(lifetimes),
                        peak_aligned_bytes=peak_bytes(lifetimes, alignment), alignment=alignment)
    largest_first = sorted(lifetimes, key=lambda life: (-align_up(life.nbytes, alignment), life.start))
    start_order = sorted(lifetimes, key=lambda life: life.start)
    offsets, pool_bytes = first_fit(largest_first, alignment)
    other_offsets, other_pool_bytes = first_fit(start_order, alignment)
    if other_pool_bytes < pool_bytes:
        offsets, pool_bytes = other_offsets, other_pool_bytes
    return PoolPlan(
        offsets=offsets,
        nbytes={life.slot: life.nbytes for life in lifetimes},
        pool_bytes=pool_bytes,
        peak_live_bytes=peak_bytes(lifetimes),
        peak_aligned_bytes=peak_bytes(lifetimes, alignment),
        alignment=alignment,
    )
