"""Profile a few steps of chosen systems of bench_gpt.py with torch.profiler (GPU).

    python benchmarks/profile_step.py --systems ours-optim_grads_params-sf,fsdp2-zero3 [bench_gpt model flags]

Prints, per system: median step time, the GPU-busy time per step (sum of kernel time), the
host-side time per step spent in our hooks vs everything else, and the top kernels. Used to explain
where our step time differs from FSDP2's (docs/benchmarks.md). ``PROFILE_SYNC_STACKS=1`` also prints
the Python stacks of every CUDA synchronize the host makes in two steps.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpt as B  # noqa: E402


def _phase_times(built, steps: int = 3) -> dict:
    """Wall time of forward + backward, optimizer step and zero_grad, each followed by a device
    synchronize (so overlap across phases is lost: the parts, not the step)."""
    rows = {"fwd_bwd": [], "opt_step": [], "zero_grad": []}
    thread = _backward_steps(built)         # ours with OffloadPolicy(step_in_backward=True): the thread's time
    records: list = []
    remove = thread.add_observer(records.append) if thread is not None else None
    for _ in range(steps):
        for name, fn in (("fwd_bwd", built.fwd_bwd), ("opt_step", built.opt_step), ("zero_grad", built.zero_grad)):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            rows[name].append((time.perf_counter() - t0) * 1e3)
    out = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    if remove is not None:
        remove()
    if records:
        n = len(records)
        out["thread waiting_for_grads per group"] = sum(r.attached - r.began for r in records) * 1e3 / n
        out["thread stepping per group"] = sum(r.stepped - r.attached for r in records) * 1e3 / n
        out["thread waiting_for_upload per group"] = sum(r.upload_started - r.stepped for r in records) * 1e3 / n
        out["groups uploaded by the thread / stepped"] = sum(r.uploaded for r in records) / n
    return out


def _backward_steps(built):
    """The engine's stepping thread (offload/backward_steps.py's BackwardSteps) of a built system, if it has one."""
    return next((s for obj in built.keep
                 if (s := getattr(getattr(obj, "_fsdp_engine", None), "backward_steps", None)) is not None), None)


def _thread_timeline(built) -> None:
    """One step of an offloaded system that steps groups during backward, as a timeline (ms from
    the step's start, the device idle then): per group when backward handed it over (host) and
    finished it (device), when the thread took it, when its gradients had landed on the host and
    were attached, when its CPU step ended and when its upload was started; beside it
    the host's phase ends and, from device events, when the device finished forward + backward
    and the step."""
    steps = _backward_steps(built)
    if steps is None:
        return
    timeline: list = []
    remove = steps.add_observer(timeline.append)
    torch.cuda.synchronize()
    start, after_bwd, after_step = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter()
    start.record()
    built.fwd_bwd()
    t_bwd = time.perf_counter()
    after_bwd.record()
    built.opt_step()
    t_step = time.perf_counter()
    after_step.record()
    built.zero_grad()
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    ms = lambda t: (t - t0) * 1e3          # noqa: E731
    print(f"timeline (ms): host fwd+bwd returned {ms(t_bwd):.1f}, optimizer.step() returned {ms(t_step):.1f}, "
          f"synchronized {ms(t_end):.1f}; device fwd+bwd done {start.elapsed_time(after_bwd):.1f}, "
          f"step done {start.elapsed_time(after_step):.1f}")
    print("  per group: the autograd thread handed it over (host) / the device had finished its backward;")
    print("  the stepping thread took it / its gradient copy had landed / .grad attached / stepped / upload started")
    print(f"  {'group':40s} {'handed':>8s} {'device':>8s} {'taken':>8s} {'landed':>8s} {'attached':>8s} "
          f"{'stepped':>8s} {'upload':>8s}")
    for r in timeline:
        device = start.elapsed_time(r.handed_event) if r.handed_event is not None else float("nan")
        handed = ms(r.handed_over) if r.handed_over is not None else float("nan")
        print(f"  {r.group[-40:]:40s} {handed:8.1f} {device:8.1f} {ms(r.began):8.1f} {ms(r.copied):8.1f} "
              f"{ms(r.attached):8.1f} {ms(r.stepped):8.1f} {ms(r.upload_started):8.1f}")
    remove()


def _sync_stacks(built, steps: int = 2) -> None:
    """Where the host waits for the device: the Python stacks of every CUDA synchronize (stream,
    event, device) in ``steps`` steps, by count (``PROFILE_SYNC_STACKS=1``)."""
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            built.fwd_bwd(); built.opt_step(); built.zero_grad()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages(group_by_stack_n=12) if "Synchronize" in e.key]
    rows.sort(key=lambda e: -e.count)
    print(f"host waits for the device in {steps} steps (calls, self CPU ms, stack):")
    for e in rows[:8]:
        print(f"  {e.key} x{e.count}, {e.self_cpu_time_total / 1e3:.1f} ms")
        for frame in list(e.stack)[:12]:
            print(f"      {frame}")
    parents = {}
    for event in prof.events():
        if "Synchronize" not in event.name:
            continue
        chain, up = [], event.cpu_parent
        while up is not None and len(chain) < 6:
            chain.append(up.name)
            up = up.cpu_parent
        key = (event.name, " < ".join(chain))
        parents[key] = parents.get(key, 0) + 1
    print("the same by enclosing profiled ops (innermost first):")
    for (name, chain), count in sorted(parents.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {name} x{count}: {chain or '(no enclosing op)'}")
    _cross_device_copies(built)


def _cross_device_copies(built) -> None:
    """Python stacks of the ``Tensor.to`` / ``copy_`` / ``cpu`` calls between devices in one step
    (the profiler records no Python stack on other threads, where the stepping thread runs)."""
    import collections
    import traceback
    seen = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("to", "copy_", "cpu", "item", "tolist")}

    def spy(name):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            other = args[0] if name == "copy_" and args else out
            crossing = name in ("item", "tolist", "cpu") or (
                torch.is_tensor(other) and other.device.type != self.device.type)
            if crossing and (self.device.type == "cuda" or (torch.is_tensor(other) and other.device.type == "cuda")):
                frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                          for f in traceback.extract_stack()[-7:-1]]
                seen[(name, threading_name(), " < ".join(reversed(frames)))] += 1
            return out
        return wrapper

    def threading_name():
        import threading
        return threading.current_thread().name

    for name in originals:
        setattr(torch.Tensor, name, spy(name))
    try:
        built.fwd_bwd(); built.opt_step(); built.zero_grad()
        torch.cuda.synchronize()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    print("host <-> device copies and reads from Python in one step (calls, thread, stack innermost first):")
    for (name, thread, stack), count in seen.most_common(10):
        print(f"  {name} x{count} [{thread}]: {stack}")


def main() -> int:
    args = B.parse_args(sys.argv[1:] + ["--warmup", "3"])
    B.quiet_libraries(args.verbose)
    systems = B.select_systems(args.systems, args.offload_fractions)
    ctx = B.init_distributed(args)
    with contextlib.ExitStack() as stack:
        B.prepare_process(ctx, stack)
        for system in systems:
            B.cleanup(ctx)
            built = B.BUILDERS[system.kind](ctx, system)
            for _ in range(args.warmup):
                built.fwd_bwd(); built.opt_step(); built.zero_grad()
            torch.cuda.synchronize()
            times = []
            steps = 5
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    built.fwd_bwd(); built.opt_step(); built.zero_grad()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            events = prof.key_averages()
            gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
            times.sort()
            print(f"\n=== {system.name}: median step {times[len(times) // 2] * 1e3:.1f} ms, "
                  f"GPU kernel time {gpu_us / steps / 1e3:.1f} ms/step, "
                  f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
            print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
            print(events.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
            print(f"phases of {system.name} (ms, synchronized after each; median of 3): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in _phase_times(built).items()), flush=True)
            _thread_timeline(built)
            if os.environ.get("PROFILE_SYNC_STACKS") == "1":
                _sync_stacks(built)
            B.release_autograd_hooks(*built.keep)
            del built
            B.cleanup(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
