"""CPU offload in bench_gpt.py: the host memory each offload system needs (checked before it is
built, so a size the host cannot hold is an out-of-memory row, not a process the kernel kills),
the search for the smallest fraction that trains (``--offload-search STEP``), the host's threads,
and issue 31's goals for the table's notes. See docs/benchmarks_history.md, "CPU offload by fraction".
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

import torch

from bench_systems import GIB, OFFLOAD_OPTIONS, System, ours_offload

# Host bytes per offloaded parameter: fp32 main weights 4 + Adam's two moments 8 + fp32 grads 4
# (ours: per rank of the group, for the offloaded fraction; FSDP2's CPUOffloadPolicy: all of it;
# Megatron's HybridDeviceOptimizer: fp32 master 4 + Adam 8 + its host copy of the grads 4).
HOST_BYTES_PER_PARAM = 16.0
HOST_HEADROOM = 0.9             # of MemAvailable: the process, CUDA's context and pinned rounding


def host_need_bytes(system: System, num_params: int, world: int, real_world: int) -> float:
    """What ``system`` keeps in this host's memory (every rank on it: real_world of them)."""
    fraction = max(system.offload or 0.0, 0.0)
    return HOST_BYTES_PER_PARAM * fraction * num_params / world * real_world


def check_host_memory(ctx, system: System) -> None:
    """Raise an out-of-memory error (reported as OOM) when the host cannot hold the system's state."""
    need = host_need_bytes(system, ctx.num_params or 0, ctx.world, ctx.real_world or 1)
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return
    if need > HOST_HEADROOM * available:
        raise torch.OutOfMemoryError(f"host out of memory (predicted): {system.name} keeps {need / GIB:.1f} GiB on the "
                                     f"host, {available / GIB:.1f} GiB available")


def _fraction_of(name: str):
    try:
        return float(name[len("ours-offload"):].removesuffix("-release")) if name.startswith("ours-offload") else None
    except ValueError:
        return None


def search_smallest_fraction(search: System, run_one: Callable[[System], Dict[str, Any]],
                             results: List[Dict[str, Any]], notes: List[str]) -> List[Dict[str, Any]]:
    """Binary search on the grid 0, STEP, 2 STEP, ..., 1 for the smallest fraction that trains
    (fitting is monotone in f: more offload, less GPU memory). Fractions already in ``results``
    are not run again; every run is a row (the sweep of f gets them too)."""
    step = OFFLOAD_OPTIONS["search_step"]
    count = max(1, int(round(1.0 / step)))
    grid = [min(1.0, round(i * step, 6)) for i in range(count + 1)]
    known = {f: r["status"] == "ok" for r in results if (f := _fraction_of(r["name"])) is not None}
    rows: List[Dict[str, Any]] = []

    def fits(index: int):
        f = grid[index]
        if f not in known:
            row = run_one(ours_offload(f, search.step_in_backward, search.release_after_gather))
            rows.append(row)
            if row["status"] not in ("ok", "OOM"):
                return None                      # skipped (time budget) or failed: stop searching
            known[f] = row["status"] == "ok"
        return known[f]

    low, high = -1, len(grid) - 1                # grid[low] does not fit (-1: none tried), grid[high] does
    top = fits(high)
    if not top:
        notes.append(f"offload search: f = 1 {'does not fit' if top is False else 'did not run'}; no smallest f")
        return rows
    while high - low > 1:
        middle = (low + high) // 2
        result = fits(middle)
        if result is None:
            notes.append(f"offload search stopped: smallest f that trains is in ({grid[low] if low >= 0 else '-'}, "
                         f"{grid[high]:g}]")
            return rows
        low, high = (low, middle) if result else (middle, high)
    below = f" (f = {grid[low]:g} runs out of memory)" if low >= 0 else ""
    notes.append(f"offload search: the smallest f on the {step:g} grid that trains is {grid[high]:g}{below}")
    return rows


def cpu_notes() -> List[str]:
    """The host threads the CPU optimizer step can use (oversubscription shows here)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return [f"host: os.cpu_count() {os.cpu_count()}, usable cores (affinity) {affinity}, "
            f"torch.get_num_threads() {torch.get_num_threads()}, OMP_NUM_THREADS "
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}"]


def offload_goals(results: List[Dict[str, Any]]) -> List[str]:
    """Issue 31's goals at one model, where the run has the systems: ours with offload (each
    fraction) steps in at most 0.7x FSDP2-with-CPUOffloadPolicy's time and below Megatron's
    --optimizer-cpu-offload, at a peak no higher than FSDP2-offload's; issue 63's: reserved too.
    Reported, never asserted."""
    ok = {r["name"]: r for r in results if r.get("status") == "ok" and r.get("step_ms")}
    fsdp2, megatron = ok.get("fsdp2-cpu_offload"), ok.get("megatron_ddp-cpu_offload")
    lines = []
    for name, r in ok.items():
        if not name.startswith("ours-offload"):
            continue
        parts = []
        if fsdp2:
            ratio = r["step_ms"] / fsdp2["step_ms"]
            parts.append(f"step {ratio:.2f}x FSDP2-offload's (goal <= 0.70: {'met' if ratio <= 0.7 else 'MISSED'})")
            for key, label in (("peak_gib", "peak allocated"), ("reserved_gib", "peak reserved")):
                if r.get(key) is not None and fsdp2.get(key) is not None:
                    met = r[key] <= fsdp2[key]
                    parts.append(f"{label} {r[key]:.2f} vs {fsdp2[key]:.2f} GiB (goal <=: "
                                 f"{'met' if met else 'MISSED'})")
        if megatron:
            ratio = r["step_ms"] / megatron["step_ms"]
            parts.append(f"step {ratio:.2f}x Megatron-offload's (goal < 1: {'met' if ratio < 1 else 'MISSED'})")
        if parts:
            lines.append(f"offload goals, {name}: " + "; ".join(parts))
    return lines
