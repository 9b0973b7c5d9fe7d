"""Profile a few steps of chosen systems of bench_gpt.py with torch.profiler (GPU).

    python benchmarks/profile_step.py --systems ours-optim_grads_params-sf,fsdp2-zero3 [bench_gpt model flags]

Prints, per system: median step time, the GPU-busy time per step (sum of kernel time), the
host-side time per step spent in our hooks vs everything else, and the top kernels. Used to explain
where our step time differs from FSDP2's (docs/benchmarks.md).
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


def main() -> int:
    args = B.parse_args(sys.argv[1:] + ["--warmup", "3"])
    B.quiet_libraries(args.verbose)
    systems = B.select_systems(args.systems)
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
            B.release_autograd_hooks(*built.keep)
            del built
            B.cleanup(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
