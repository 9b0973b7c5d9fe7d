"""Allocators: the pool planner's invariants, the trace pool's fixed addresses and safety, storage freeing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fsdp_v2.allocators import (
    Allocator,
    StorageFreeingBucketAllocator,
    TracePoolAllocator,
    make_allocator,
)
from megatron_fsdp_v2.allocators.pool_plan import align_up, lifetimes_from_trace, peak_bytes, plan_pool

FAST = settings(max_examples=150, deadline=None)

# -- trace strategies -------------------------------------------------------------------------


@st.composite
def random_traces(draw, sizes=st.integers(0, 3000), max_events=40):
    """Valid traces over a few keys, each key allocated and freed any number of times."""
    keys = [f"k{i}" for i in range(draw(st.integers(1, 6)))]
    live: list[str] = []
    trace = []
    for _ in range(draw(st.integers(0, max_events))):
        free_keys = [k for k in keys if k not in live]
        if free_keys and (not live or draw(st.booleans())):
            key = draw(st.sampled_from(free_keys))
            trace.append(("alloc", key, draw(sizes)))
            live.append(key)
        else:
            key = draw(st.sampled_from(live))
            trace.append(("free", key))
            live.remove(key)
    for key in draw(st.permutations(live)):
        trace.append(("free", key))
    return trace


@st.composite
def stack_traces(draw):
    """Nested (LIFO) traces: every free frees the most recently allocated live key."""
    stack: list[str] = []
    trace, counter = [], 0
    for _ in range(draw(st.integers(0, 40))):
        if not stack or draw(st.booleans()):
            key = f"k{counter % 5}" if f"k{counter % 5}" not in stack else f"x{counter}"
            counter += 1
            trace.append(("alloc", key, draw(st.integers(0, 5000))))
            stack.append(key)
        else:
            trace.append(("free", stack.pop()))
    trace += [("free", key) for key in reversed(stack)]
    return trace


def _aligned_sum(trace, alignment):
    return sum(align_up(event[2], alignment) for event in trace if event[0] == "alloc")


# -- planner properties -----------------------------------------------------------------------


@FAST
@given(random_traces(), st.sampled_from([1, 16, 512]))
def test_plan_never_shares_bytes_between_lifetimes_that_overlap(trace, alignment):
    plan = plan_pool(trace, alignment)
    lifetimes = lifetimes_from_trace(trace)
    for i, a in enumerate(lifetimes):
        assert plan.offsets[a.slot] % alignment == 0
        a_lo, a_hi = plan.byte_range(a.slot)
        assert a_hi <= plan.pool_bytes
        for b in lifetimes[i + 1 :]:
            b_lo, b_hi = plan.byte_range(b.slot)
            if a.overlaps_in_time(b) and a.nbytes and b.nbytes:
                assert a_hi <= b_lo or b_hi <= a_lo, (a, b, plan.offsets)


@FAST
@given(random_traces(), st.sampled_from([1, 16, 512]))
def test_pool_bytes_between_aligned_peak_and_aligned_sum(trace, alignment):
    plan = plan_pool(trace, alignment)
    assert plan.peak_aligned_bytes == peak_bytes(lifetimes_from_trace(trace), alignment)
    assert plan.peak_aligned_bytes <= plan.pool_bytes <= _aligned_sum(trace, alignment)
    assert plan.peak_live_bytes <= plan.peak_aligned_bytes


@FAST
@given(random_traces(sizes=st.just(700)))
def test_pool_bytes_equal_peak_when_all_sizes_are_equal(trace):
    plan = plan_pool(trace)
    assert plan.pool_bytes == plan.peak_aligned_bytes


@FAST
@given(stack_traces(), st.sampled_from([1, 512]))
def test_pool_bytes_equal_peak_on_nested_traces(trace, alignment):
    plan = plan_pool(trace, alignment)
    assert plan.pool_bytes == plan.peak_aligned_bytes


def test_nested_trace_where_largest_first_alone_wastes_bytes():
    # R holds A then B; B holds C. Largest-first alone needs 12 units, the peak is R+B+C = 10.
    u = 512
    trace = [("alloc", "R", 4 * u), ("alloc", "A", 5 * u), ("free", "A"), ("alloc", "B", 3 * u),
             ("alloc", "C", 3 * u), ("free", "C"), ("free", "B"), ("free", "R")]
    assert plan_pool(trace).pool_bytes == 10 * u


def test_repeated_key_gets_one_slot_per_occurrence():
    trace = [("alloc", "w", 100), ("alloc", "g", 100), ("free", "w"), ("alloc", "w", 100), ("free", "g"), ("free", "w")]
    plan = plan_pool(trace)
    assert set(plan.offsets) == {("w", 0), ("w", 1), ("g", 0)}
    assert plan.pool_bytes == 1024 and plan.peak_live_bytes == 200


def test_empty_trace_plans_an_empty_pool():
    plan = plan_pool([])
    assert plan.pool_bytes == 0 and plan.offsets == {} and plan.peak_live_bytes == 0


@pytest.mark.parametrize(
    "trace, key",
    [
        ([("alloc", "twice", 8), ("alloc", "twice", 8)], "twice"),
        ([("free", "ghost")], "ghost"),
        ([("alloc", "a", 8), ("free", "a"), ("alloc", "leaked", 8)], "leaked"),
    ],
    ids=["double_alloc", "free_unknown", "never_freed"],
)
def test_invalid_trace_raises_naming_the_key(trace, key):
    with pytest.raises(ValueError, match=repr(key)):
        plan_pool(trace)


@pytest.mark.parametrize("alignment", [0, -512, 1.5])
def test_bad_alignment_raises(alignment):
    with pytest.raises(ValueError, match="alignment"):
        plan_pool([], alignment)


# -- TracePoolAllocator ---------------------------------------------------------------------


def run_iteration(alloc: Allocator, schedule, stamp: float):
    """Replay ``schedule`` (("alloc", key, numel) / ("free", key)) and check no live buffers alias.

    Every new buffer is filled with a distinct value and every live buffer is read back after
    each allocation, so two live buffers sharing bytes fail the test. Returns data_ptr per
    (key, occurrence)."""
    live: dict[str, tuple[torch.Tensor, float]] = {}
    ptrs, counts = {}, {}
    for event in schedule:
        if event[0] == "alloc":
            _, key, numel = event
            tensor = alloc.allocate(key, numel, torch.float32, torch.device("cpu"))
            assert tensor.shape == (numel,) and tensor.dtype == torch.float32
            value = stamp + len(ptrs)
            tensor.fill_(value)
            live[key] = (tensor, value)
            occurrence = counts.get(key, 0)
            counts[key] = occurrence + 1
            ptrs[(key, occurrence)] = tensor.data_ptr()
            for other, (t, v) in live.items():
                assert torch.all(t == v), f"live buffer {other!r} was overwritten by {key!r}"
        else:
            alloc.free(event[1])
            del live[event[1]]
    alloc.step()
    return ptrs


SCHEDULE = [("alloc", "w0", 300), ("alloc", "g0", 300), ("free", "w0"), ("alloc", "w1", 500),
            ("free", "g0"), ("alloc", "g1", 500), ("free", "w1"), ("free", "g1")]


def test_trace_pool_addresses_are_fixed_from_iteration_two():
    alloc = TracePoolAllocator()
    run_iteration(alloc, SCHEDULE, 1.0)
    assert alloc.plan is not None and alloc.pool_bytes == alloc.plan.pool_bytes > 0
    second = run_iteration(alloc, SCHEDULE, 100.0)
    third = run_iteration(alloc, SCHEDULE, 200.0)
    assert second == third
    assert alloc.retrace_count == 0 and alloc.peak_live_bytes == 2 * 500 * 4


@pytest.mark.parametrize(
    "changed",
    [
        [("alloc", "w0", 301) if e[:2] == ("alloc", "w0") else e for e in SCHEDULE],  # size differs
        SCHEDULE[:2] + [("alloc", "new", 64), ("free", "new")] + SCHEDULE[2:],  # new key
        # reordered: w1 is allocated while w0 is still live, so their planned ranges may overlap
        [("alloc", "w0", 300), ("alloc", "g0", 300), ("alloc", "w1", 500), ("free", "w0"),
         ("free", "g0"), ("alloc", "g1", 500), ("free", "w1"), ("free", "g1")],
    ],
    ids=["size_differs", "new_key", "reordered"],
)
def test_changed_iteration_is_served_safely_and_retraced(changed):
    alloc = TracePoolAllocator()
    for stamp in (1.0, 100.0):
        run_iteration(alloc, SCHEDULE, stamp)
    (w0_lo, w0_hi), (w1_lo, w1_hi) = alloc.plan.byte_range(("w0", 0)), alloc.plan.byte_range(("w1", 0))
    assert w0_lo < w1_hi and w1_lo < w0_hi, "the reordered case needs w0 and w1 to share planned bytes"
    run_iteration(alloc, changed, 200.0)  # asserts no live buffers alias
    assert alloc.retrace_count == 1 and not alloc.needs_retrace
    fourth = run_iteration(alloc, changed, 300.0)
    assert run_iteration(alloc, changed, 400.0) == fourth
    assert alloc.retrace_count == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(random_traces(sizes=st.integers(0, 200), max_events=16), min_size=1, max_size=4))
def test_trace_pool_never_aliases_live_buffers_under_changing_schedules(schedules):
    alloc = TracePoolAllocator(alignment=16)
    for i, schedule in enumerate(schedules * 2):
        run_iteration(alloc, schedule, 1000.0 * i)
    assert alloc.live_bytes == 0


def test_trace_pool_with_no_allocations_steps_and_releases():
    alloc = TracePoolAllocator()
    for _ in range(3):
        alloc.step()
    assert alloc.plan is not None and alloc.plan.pool_bytes == 0 and alloc.pool_bytes == 0
    alloc.release()
    assert alloc.plan is None


def test_trace_pool_plans_one_pool_per_device():
    alloc = TracePoolAllocator()
    for _ in range(2):
        alloc.allocate("cpu_buf", 10, torch.float32, torch.device("cpu"))
        alloc.allocate("meta_buf", 20, torch.bfloat16, torch.device("meta"))
        alloc.free("cpu_buf")
        alloc.free("meta_buf")
        alloc.step()
    assert {str(d) for d in alloc.plans} == {"cpu", "meta"} and alloc.pool_bytes == 1024
    assert alloc.retrace_count == 0
    with pytest.raises(RuntimeError, match="use .plans"):
        alloc.plan


def test_trace_pool_waits_for_no_live_keys_before_planning():
    alloc = TracePoolAllocator()
    alloc.allocate("carried", 4, torch.float32, "cpu")
    alloc.step()  # live key at the boundary: the trace is not self-contained
    alloc.free("carried")
    alloc.step()  # this iteration began with a live key: still not self-contained
    assert alloc.plan is None
    run_iteration(alloc, SCHEDULE, 1.0)
    assert alloc.plan is not None


def test_trace_pool_release_requires_no_live_keys():
    alloc = TracePoolAllocator()
    alloc.allocate("x", 4, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="'x'"):
        alloc.release()
    alloc.free("x")
    alloc.step()
    alloc.release()
    assert alloc.pool_bytes == 0 and alloc.plan is None


@pytest.mark.parametrize("alignment", [0, 8, 100])
def test_trace_pool_rejects_alignment_that_breaks_typed_views(alignment):
    with pytest.raises(ValueError, match=f"got {alignment}"):
        TracePoolAllocator(alignment=alignment)


# -- StorageFreeingBucketAllocator --------------------------------------------------------------


def test_storage_freeing_returns_same_tensor_and_frees_storage():
    alloc = StorageFreeingBucketAllocator()
    first = alloc.allocate("w", 64, torch.float32, "cpu")
    view = first[8:16]
    assert first.untyped_storage().nbytes() == 256
    alloc.free("w")
    assert first.untyped_storage().nbytes() == 0 and alloc.live_bytes == 0
    again = alloc.allocate("w", 64, torch.float32, "cpu")
    assert again is first and again.untyped_storage().nbytes() == 256
    assert view.data_ptr() == again.data_ptr() + 8 * 4
    again.copy_(torch.arange(64, dtype=torch.float32))
    assert torch.equal(view, torch.arange(8, 16, dtype=torch.float32))


def test_storage_freeing_new_tensor_when_shape_changes():
    alloc = StorageFreeingBucketAllocator()
    first = alloc.allocate("w", 64, torch.float32, "cpu")
    alloc.free("w")
    assert alloc.allocate("w", 32, torch.float32, "cpu") is not first
    alloc.free("w")
    assert alloc.allocate("w", 32, torch.bfloat16, "cpu").dtype == torch.bfloat16


def test_storage_freeing_accounts_live_and_peak_bytes():
    alloc = StorageFreeingBucketAllocator()
    alloc.allocate("a", 100, torch.float32, "cpu")
    alloc.allocate("b", 50, torch.bfloat16, "cpu")
    assert alloc.live_bytes == alloc.peak_live_bytes == 500
    alloc.free("a")
    assert alloc.live_bytes == 100 and alloc.peak_live_bytes == 500
    with pytest.raises(RuntimeError, match="'b'"):
        alloc.release()
    alloc.free("b")
    alloc.release()
    assert alloc.cached_tensor("a") is None


# -- factory ----------------------------------------------------------------------------------


def test_make_allocator_by_name_and_instance():
    assert isinstance(make_allocator("storage_freeing"), StorageFreeingBucketAllocator)
    assert isinstance(make_allocator("trace_pool"), TracePoolAllocator)
    mine = TracePoolAllocator()
    assert make_allocator(mine) is mine


def test_make_allocator_unknown_name_lists_choices():
    with pytest.raises(ValueError) as info:
        make_allocator("caching")
    assert str(info.value) == "allocator must be one of ['storage_freeing', 'trace_pool'], got 'caching'."


def test_stable_keys_keep_one_offset_per_key_without_overlap():
    from megatron_fsdp_v2.allocators.pool_plan import lifetimes_from_trace, plan_pool as plan
    # ZeRO-3-like: each unit's weights live in forward and again in backward (reverse order)
    trace = []
    for u in range(4):
        trace += [("alloc", f"w{u}", 1000)] + ([("free", f"w{u-1}")] if u else [])
    trace += [("free", "w3")]
    for u in reversed(range(4)):
        trace += [("alloc", f"w{u}", 1000)] + ([("free", f"w{u+1}")] if u < 3 else [])
    trace += [("free", "w0")]
    p = plan(trace, 512, stable_keys=True)
    for u in range(4):
        assert p.offsets[(f"w{u}", 0)] == p.offsets[(f"w{u}", 1)]
    lives = lifetimes_from_trace(trace)
    for a in lives:
        for b in lives:
            if a is not b and a.overlaps_in_time(b):
                lo_a, hi_a = p.offsets[a.slot], p.offsets[a.slot] + 1024
                lo_b, hi_b = p.offsets[b.slot], p.offsets[b.slot] + 1024
                assert hi_a <= lo_b or hi_b <= lo_a
    assert p.pool_bytes <= 3 * 1024      # neighbours differ; three colours suffice for a chain
