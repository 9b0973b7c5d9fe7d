"""``benchmarks/bench_offload.py``'s search for the smallest offload fraction that trains, and its
host-memory arithmetic, on a fake ``run_one`` (no GPU, nothing built)."""

from __future__ import annotations

import pytest

from tests.benchmark_modules import load_benchmark_module

load_benchmark_module("bench_setup")
systems = load_benchmark_module("bench_systems")
bo = load_benchmark_module("bench_offload")


def _search(threshold, step, done=(), budget=None):
    """Fractions >= ``threshold`` train; ``budget``: runs after which the rest are skipped."""
    runs, notes = [], []

    def run_one(system):
        runs.append(system.offload)
        if budget is not None and len(runs) > budget:
            return dict(name=system.name, status="skipped")
        return dict(name=system.name, status="ok" if system.offload >= threshold else "OOM")

    results = [dict(name=f"ours-offload{f:g}", status="ok" if f >= threshold else "OOM") for f in done]
    systems.OFFLOAD_OPTIONS["search_step"] = step
    try:
        bo.search_smallest_fraction(systems.System("ours-offload-min", "ours_search", offload=-1.0),
                                    run_one, results, notes)
    finally:
        systems.OFFLOAD_OPTIONS["search_step"] = 0.0
    return runs, notes


def test_the_search_bisects_the_grid_and_reuses_fractions_already_run():
    runs, notes = _search(0.57, 0.125, done=(1.0,))
    assert runs == [0.375, 0.625, 0.5]          # f = 1 was run already
    assert notes == ["offload search: the smallest f on the 0.125 grid that trains is 0.625 "
                     "(f = 0.5 runs out of memory)"]


@pytest.mark.parametrize("threshold, want", [(0.0, "0"), (1.0, "1"), (0.3, "0.5")])
def test_the_search_finds_the_edges(threshold, want):
    runs, notes = _search(threshold, 0.25)
    assert runs[0] == 1.0 and notes[-1].split(" trains is ")[1].split(" ")[0] == want, (runs, notes)


def test_the_search_stops_when_the_budget_is_used_up_or_nothing_fits():
    _, notes = _search(0.57, 0.125, budget=2)
    assert notes == ["offload search stopped: smallest f that trains is in (0.375, 1]"]
    _, notes = _search(2.0, 0.5)
    assert notes == ["offload search: f = 1 does not fit; no smallest f"]


def test_host_memory_is_16_bytes_per_offloaded_parameter_per_rank_on_this_host():
    ours = systems.ours_offload(0.5)
    assert bo.host_need_bytes(ours, 10**9, world=8, real_world=1) == 16 * 0.5 * 10**9 / 8
    assert bo.host_need_bytes(ours, 10**9, world=2, real_world=2) == 16 * 0.5 * 10**9
    search = systems.System("ours-offload-min", "ours_search", offload=-1.0)
    assert bo.host_need_bytes(search, 10**9, world=1, real_world=1) == 0


@pytest.mark.parametrize("release, names", [
    ("0", ["ours-offload1", "ours-offload0.5"]),
    ("1", ["ours-offload1-release", "ours-offload0.5-release"]),
    ("both", ["ours-offload1", "ours-offload1-release", "ours-offload0.5", "ours-offload0.5-release"])])
def test_release_after_gather_both_runs_each_fraction_both_ways_side_by_side(release, names):
    systems.OFFLOAD_OPTIONS["release_after_gather"] = release
    try:
        ours = [s for s in systems.offload_systems((1.0, 0.5)) if s.kind == "ours"]
    finally:
        systems.OFFLOAD_OPTIONS["release_after_gather"] = "0"
    assert [s.name for s in ours] == names
    assert [s.release_after_gather for s in ours] == [n.endswith("-release") for n in names]
    assert [bo._fraction_of(n) for n in names] == [float(n.split("offload")[1].split("-")[0]) for n in names]


def test_offload_goals_compare_peak_allocated_and_peak_reserved_with_fsdp2_offload():
    results = [dict(name="fsdp2-cpu_offload", status="ok", step_ms=1000.0, peak_gib=10.0, reserved_gib=14.0),
               dict(name="ours-offload1", status="ok", step_ms=600.0, peak_gib=9.5, reserved_gib=14.5),
               dict(name="ours-offload0.5", status="ok", step_ms=500.0)]          # on CPU: no memory counters
    assert bo.offload_goals(results) == [
        "offload goals, ours-offload1: step 0.60x FSDP2-offload's (goal <= 0.70: met); peak allocated 9.50 vs "
        "10.00 GiB (goal <=: met); peak reserved 14.50 vs 14.00 GiB (goal <=: MISSED)",
        "offload goals, ours-offload0.5: step 0.50x FSDP2-offload's (goal <= 0.70: met)"]
