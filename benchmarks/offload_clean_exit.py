#!/usr/bin/env python3
"""Do 2-rank CPU runs with ``OffloadPolicy(step_in_backward=True, release_after_gather=True)`` end
cleanly? Each run starts one process per rank (gloo, a file rendezvous), trains a small model
wrapped with ZeRO-3 and that policy for a few steps, then ends: with
``dist.destroy_process_group()``, or by just returning from the script (the interpreter exits with
the model and its stepping thread alive), alternating by default. A run is abnormal if any rank
exits with a code other than 0 (a SIGABRT is -6) or does not finish within ``--timeout``.
Before thread_shutdown.py ([Note: threads at exit]) about one run in 16 ended with rank 0 at -6,
"terminate called without an active exception", after training had finished::

    python benchmarks/offload_clean_exit.py --runs 50
    python benchmarks/offload_clean_exit.py --runs 50 --end exit --steps 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

ENDS = ("destroy", "exit")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="runs (default 50)")
    p.add_argument("--world-size", type=int, default=2, help="ranks per run (default 2)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    p.add_argument("--end", choices=ENDS + ("alternate",), default="alternate",
                   help="how a run ends: destroy_process_group, plain interpreter exit, or alternate (default)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as hung")
    p.add_argument("--worker", nargs=3, metavar=("RANK", "INIT_FILE", "END"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs < 1 or args.world_size < 1 or args.steps < 1:
        p.error(f"--runs, --world-size and --steps must be >= 1, got {args.runs}, {args.world_size}, {args.steps}")
    return args


def worker(rank: int, world_size: int, init_file: str, end: str, steps: int) -> None:
    """One rank of a run: train, then end as ``end`` says."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist

    from megatron_fsdp_v2 import OffloadPolicy, fully_shard
    from testing.thread_steps import observe_thread_steps
    from tests.unit.models import Block, UnevenNet, make_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                        offload=OffloadPolicy(fraction=1.0, step_in_backward=True, release_after_gather=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    records = observe_thread_steps(model)
    for step in range(steps):
        for x, y in make_batches(step, rank, 1):
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    stepped = len(records)
    print(f"rank {rank}: {steps} steps, {stepped} group steps on the thread, ending by {end}", flush=True)
    if end == "destroy":
        dist.destroy_process_group()


def one_run(args, index: int) -> tuple:
    """(abnormal?, description) of run ``index``."""
    end = ENDS[index % 2] if args.end == "alternate" else args.end
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [subprocess.Popen([sys.executable, __file__, "--world-size", str(args.world_size), "--steps",
                                   str(args.steps), "--worker", str(rank), init, end],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(args.world_size)]
        deadline = time.monotonic() + args.timeout
        outputs, codes = [], []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += "\n(timed out)"
            outputs.append(out)
            codes.append(proc.returncode)
    trained = all(f"rank {r}: {args.steps} steps" in outputs[r] for r in range(args.world_size))
    abnormal = any(code != 0 for code in codes) or not trained
    detail = f"run {index + 1}: end={end} exit codes {codes}"
    if abnormal:
        detail += "".join(f"\n  rank {r}: ...{out[-400:]!r}" for r, out in enumerate(outputs))
    return abnormal, detail


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        rank, init, end = args.worker
        worker(int(rank), args.world_size, init, end, args.steps)
        return 0
    t = time.perf_counter()
    abnormal = 0
    for index in range(args.runs):
        bad, detail = one_run(args, index)
        abnormal += bad
        print(("ABNORMAL " if bad else "") + detail, flush=True)
    print(f"{abnormal} abnormal exits in {args.runs} runs of {args.world_size} ranks "
          f"({args.steps} steps, end={args.end}; {time.perf_counter() - t:.0f} s)", flush=True)
    return 1 if abnormal else 0


if __name__ == "__main__":
    sys.exit(main())
