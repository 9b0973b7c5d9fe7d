#!/usr/bin/env python3
"""Does the README's plain loop end cleanly, run after run, on a loaded machine? Each run starts one
process per rank (gloo, a file rendezvous) running the README loop: a 4-block model, 5 steps of 2
micro-batches (``no_sync`` on the first), ``clip_grad_norm_``, ``summon_full_params``,
``export_full_state_dict``, ``destroy_process_group``; per strategy, and ``offload``: ZeRO-3 with
``OffloadPolicy(fraction=1.0, step_in_backward=True, release_after_gather=True)`` (its steps run on
a host thread in backward, so no clipping). The same loop runs under torch FSDP2 (``fully_shard``
per block and root, ``set_requires_gradient_sync``, ``get_model_state_dict``) and torch DDP (the
control). A run is abnormal if a rank exits with a code other than 0 (SIGABRT is -6), does not print
its last line, or does not finish within ``--timeout``. Loops take turns, run by run, so each sees
the same load; ``--load`` busy processes run beside them the whole time. Each rank reports how many
gloo worker threads were alive before and after ``destroy_process_group``.

gloo's worker threads alive at interpreter finalization abort a finished run now and then,
"terminate called without an active exception" (comm/thread_shutdown.py, [Note: gloo's threads at
exit]); ours are joined inside ``destroy_process_group``, FSDP2's are not. ``--unfixed`` makes the
workers keep our meshes' references to the group, as before, to compare; ``--end exit`` skips
``destroy_process_group`` (the interpreter exits with the model and the group alive)::

    python benchmarks/exit_stress.py                       # 200 runs of each loop, one busy process
    python benchmarks/exit_stress.py --runs 60 --loops optim_grads_params,fsdp2,ddp
    python benchmarks/exit_stress.py --runs 40 --loops optim_grads_params --unfixed

200 runs show a 1-in-20 abort with probability 1 - 0.95**200 > 0.9999."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OURS = ("no_shard", "optim", "optim_grads", "optim_grads_params", "offload")
LOOPS = OURS + ("fsdp2", "ddp")
ENDS = ("destroy", "exit")
DONE = "exit_stress: rank {rank} done"
GLOO_THREAD = "pt_gloo_runloop"      # torch 2.13's name of gloo's worker threads


def gloo_threads() -> int:
    """gloo worker threads alive in this process (Linux)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:            # the thread ended meanwhile
            pass
    return names.count(GLOO_THREAD)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=200, help="runs of each loop (default 200)")
    p.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)} (default all)")
    p.add_argument("--world-size", type=int, default=2, help="ranks per run (default 2)")
    p.add_argument("--load", type=int, default=1, help="busy processes beside the runs (default 1)")
    p.add_argument("--end", choices=ENDS, default="destroy",
                   help="how a run ends: destroy_process_group (default, as the README) or a plain interpreter exit")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as hung")
    p.add_argument("--unfixed", action="store_true",
                   help="the workers keep our meshes' references to the group at destroy_process_group")
    p.add_argument("--worker", nargs=4, metavar=("LOOP", "RANK", "INIT_FILE", "OUT_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.loops = [name for name in args.loops.split(",") if name]
    unknown = sorted(set(args.loops) - set(LOOPS))
    if unknown or not args.loops:
        p.error(f"--loops must name some of {', '.join(LOOPS)}, got {unknown or 'none'}")
    if args.runs < 1 or args.world_size < 1 or args.load < 0:
        p.error(f"--runs and --world-size must be >= 1 and --load >= 0, got {args.runs}, {args.world_size}, "
                f"{args.load}")
    return args


def worker(loop: str, rank: int, args: argparse.Namespace, init_file: str, out_dir: str) -> None:
    """One rank of the README loop under ``loop``: the imports first, then the process group, as a
    script does (imported after ``init_process_group``, torch.distributed.checkpoint would pin the
    default group through torch.distributed.nn.functional's default arguments)."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    from megatron_fsdp_v2.comm import thread_shutdown

    if args.unfixed:
        thread_shutdown.release_group_references = lambda group, copies: None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world_size)
    torch.manual_seed(0)
    model = wrap(loop, readme_model())
    train(model, loop, rank)
    save(model, loop, rank, os.path.join(out_dir, "model.pt"))
    if args.end == "exit":                          # the interpreter exits with the model and the group alive
        print(DONE.format(rank=rank) + ", exiting without destroy_process_group", flush=True)
        return
    before = gloo_threads()
    dist.destroy_process_group()
    print(DONE.format(rank=rank) + f", gloo worker threads {before} -> {gloo_threads()} at destroy_process_group",
          flush=True)


def readme_model():
    """The README's ``build_model()``: an input layer, 4 ``MyBlock`` and a ``head``."""
    import torch
    import torch.nn as nn

    class MyBlock(nn.Module):
        def __init__(self, width: int = 32) -> None:
            super().__init__()
            self.norm, self.up = nn.LayerNorm(width), nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, width: int = 32) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(16, width), nn.Linear(width, 8)
            self.blocks = nn.ModuleList(MyBlock(width) for _ in range(4))

        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    return Net()


def wrap(loop: str, model):
    """``model`` wrapped as ``loop`` says."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from megatron_fsdp_v2 import OffloadPolicy, fully_shard

    block = type(model.blocks[0])
    if loop == "fsdp2":
        for each in model.blocks:
            fsdp2_fully_shard(each)
        return fsdp2_fully_shard(model)
    if loop == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if loop == "offload":
        return fully_shard(model, sharding_strategy="optim_grads_params", unit_modules=[block],
                           offload=OffloadPolicy(fraction=1.0, step_in_backward=True, release_after_gather=True))
    return fully_shard(model, sharding_strategy=loop, unit_modules=[block])


def train(model, loop: str, rank: int) -> None:
    """The README's steps: 5 of 2 micro-batches, the first under ``no_sync`` (FSDP2:
    ``set_requires_gradient_sync``), clipping (not with ``offload``: its steps run in backward),
    AdamW with and without weight decay."""
    import contextlib

    import torch

    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        for i in range(2):
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            last = i == 1
            if loop == "fsdp2":
                model.set_requires_gradient_sync(last)
            with model.no_sync() if loop != "fsdp2" and not last else contextlib.nullcontext():
                torch.nn.functional.mse_loss(model(x), y).backward()
        if loop != "offload":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()


def save(model, loop: str, rank: int, path: str) -> None:
    """Full weights to one file from rank 0: ours through ``summon_full_params`` (the norm printed)
    and ``export_full_state_dict``, FSDP2's through ``get_model_state_dict``, DDP's module's."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from megatron_fsdp_v2 import export_full_state_dict

    if loop == "fsdp2":
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(state, path)
    elif loop == "ddp":
        if rank == 0:
            torch.save(model.module.state_dict(), path)
    else:
        with model.summon_full_params():
            print(f"rank {rank}: |head| {float(model.head.weight.detach().norm()):.4f}", flush=True)
        export_full_state_dict(model, path)


def one_run(args, loop: str) -> tuple:
    """(exit codes, the ranks' output) of one run of ``loop``."""
    with tempfile.TemporaryDirectory() as tmp:
        command = ([sys.executable, __file__, "--world-size", str(args.world_size), "--end", args.end]
                   + (["--unfixed"] if args.unfixed else []))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen(command + ["--worker", loop, str(rank), os.path.join(tmp, "init"), tmp], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(args.world_size)]
        deadline = time.monotonic() + args.timeout
        outputs, codes = [], []
        try:
            for proc in procs:
                try:
                    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, _ = proc.communicate()
                    out += "\n(timed out)"
                outputs.append(out)
                codes.append(proc.returncode)
        finally:                            # stopped (Ctrl-C, a kill): no rank of this run is left behind
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return codes, outputs


def verdict(codes: list, outputs: list) -> str:
    """"ok", "abort after the end" (SIGABRT once the loop printed its last line), or "abnormal"."""
    finished = all(DONE.format(rank=r) in out for r, out in enumerate(outputs))
    if all(code == 0 for code in codes) and finished:
        return "ok"
    return "abort after the end" if finished and -6 in codes else "abnormal"


def start_load(count: int) -> list:
    """``count`` busy processes; each also ends by itself once this process is gone."""
    spin = f"import os\nwhile os.getppid() == {os.getpid()}: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]


def _stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_all(args, tally: dict, seconds: dict, left: dict) -> None:
    """Every loop ``args.runs`` times, taking turns; counts into the three dicts."""
    start = time.perf_counter()
    for index in range(args.runs):
        for loop in args.loops:
            t = time.perf_counter()
            codes, outputs = one_run(args, loop)
            seconds[loop] += time.perf_counter() - t
            result = verdict(codes, outputs)
            tally[loop][result] += 1
            left[loop].update(int(n) for n in re.findall(r"gloo worker threads \d+ -> (\d+)", "".join(outputs)))
            if result != "ok":
                print(f"run {index + 1} {loop}: {result}, exit codes {codes}"
                      + "".join(f"\n  rank {r}: ...{out[-300:]!r}" for r, out in enumerate(outputs)), flush=True)
        if (index + 1) % 10 == 0 or index + 1 == args.runs:
            print(f"after {index + 1} runs of each ({time.perf_counter() - start:.0f} s): "
                  + ", ".join(f"{loop} {index + 1 - tally[loop]['ok']}" for loop in args.loops) + " abnormal",
                  flush=True)


def print_table(args, tally: dict, seconds: dict, left: dict, wall_s: float) -> None:
    print(f"\n{args.world_size} ranks, {args.load} busy process(es), end={args.end}"
          f"{', --unfixed' if args.unfixed else ''}; {wall_s:.0f} s\n")
    print("| loop | runs | abnormal | of which SIGABRT after the end | gloo threads left after destroy | s per run |")
    print("|---|---:|---:|---:|---:|---:|")
    for loop in args.loops:
        runs = sum(tally[loop].values())
        bad = runs - tally[loop]["ok"]
        print(f"| {loop} | {runs} | {bad} | {tally[loop]['abort after the end']} | "
              f"{', '.join(map(str, sorted(left[loop]))) or '?'} | {seconds[loop] / max(runs, 1):.1f} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        loop, rank, init, out_dir = args.worker
        worker(loop, int(rank), args, init, out_dir)
        return 0
    tally = {loop: {"ok": 0, "abort after the end": 0, "abnormal": 0} for loop in args.loops}
    seconds = {loop: 0.0 for loop in args.loops}
    left = {loop: set() for loop in args.loops}          # gloo threads alive after destroy_process_group
    signal.signal(signal.SIGTERM, _stop)                 # a kill, or Ctrl-C even when started with &,
    signal.signal(signal.SIGINT, _stop)                  # stops the load and prints what was counted
    load = start_load(args.load)
    start = time.perf_counter()
    try:
        run_all(args, tally, seconds, left)
    except KeyboardInterrupt as stopped:
        print(f"stopped by {stopped}", flush=True)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print_table(args, tally, seconds, left, time.perf_counter() - start)
    return 1 if any(tally[loop]["ok"] < sum(tally[loop].values()) for loop in args.loops if loop in OURS) else 0


if __name__ == "__main__":
    sys.exit(main())
