#!/usr/bin/env python3
"""How fast torch's fused CPU AdamW steps one offloaded group, alone and beside what runs with it
during an offloaded backward (offload/backward_steps.py steps groups on a host thread while gradient
copies come down, weight copies go up and autograd's thread launches the device's kernels).

    python3 benchmarks/cpu_step_contention.py [--numel 50000000] [--repeats 5] [--threads 16,14,12,8]
                                              [--switch-interval SECONDS]

Prints the median milliseconds of one ``AdamW(fused=True).step()`` over ``--numel`` fp32 host
parameters (pinned, as offloaded main weights are), for each intra-op thread count of the
stepping thread (``torch.set_num_threads`` there) and each case:

* ``main thread``: alone, as ``optimizer.step()`` runs it after backward;
* ``side thread``: the same step on a second Python thread, the main thread idle;
* ``+ python``: while the main thread runs a pure-Python loop (GIL hand-offs against a busy
  Python thread, as the backward's hooks are);
* ``+ launches``: while the main thread launches small device kernels back to back, as
  autograd's device thread does through backward (a core kept busy outside the OpenMP team);
* ``+ copies``: while pinned device-to-host and host-to-device copies of the same size stream
  back to back on two side streams (host memory bandwidth shared with the copy engines);
* ``+ launches + copies``: both, what an offloaded backward does.
``--switch-interval`` sets Python's GIL switch interval for the whole run (``sys.setswitchinterval``;
5 ms by default), as offload/backward_steps.py does while groups step during backward ([Note: the
stepping thread and the GIL]). Each row also gives the ratio to ``main thread`` at the default thread count. On a CPU-only
machine the device cases are skipped. The result decides ``OffloadPolicy(step_threads=...)``'s
default (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch


def _adamw(numel: int, pin: bool):
    param = torch.zeros(numel, pin_memory=pin)
    param.grad = torch.randn(numel).pin_memory() if pin else torch.randn(numel)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()                                     # state made outside the timing
    return opt


def _timed(opt, repeats: int, threads: int) -> float:
    torch.set_num_threads(threads)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _on_thread(opt, repeats: int, threads: int, busy=()) -> float:
    out, stop = {}, threading.Event()
    worker = threading.Thread(target=lambda: (out.setdefault("ms", _timed(opt, repeats, threads)), stop.set()))
    helpers = [threading.Thread(target=b, args=(stop,)) for b in busy[1:]]
    worker.start()
    for h in helpers:
        h.start()
    if busy:
        busy[0](stop)
    worker.join()
    for h in helpers:
        h.join()
    return out["ms"]


def _python_loop(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _launches():
    a = torch.ones(1 << 16, device="cuda")

    def run(stop: threading.Event) -> None:
        while not stop.is_set():
            for _ in range(64):
                a.mul_(1.0)
            torch.cuda.current_stream().synchronize()
    return run


def _copies(numel: int):
    host = torch.empty(numel, pin_memory=True)
    host_up = torch.empty(numel, pin_memory=True)
    dev = torch.empty(numel, device="cuda")
    dev_up = torch.empty(numel, device="cuda")
    down, up = torch.cuda.Stream(), torch.cuda.Stream()

    def run(stop: threading.Event) -> None:
        while not stop.is_set():
            with torch.cuda.stream(down):
                host.copy_(dev, non_blocking=True)
            with torch.cuda.stream(up):
                dev_up.copy_(host_up, non_blocking=True)
            down.synchronize()
            up.synchronize()
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=50_000_000, help="parameters of the group (default 50M)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", default="", help="comma list of intra-op thread counts (default: torch's, "
                   "then cores - 1, cores - 2, cores / 2)")
    p.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval(S) first (0: leave "
                   "Python's, 5 ms)")
    args = p.parse_args()
    if args.switch_interval > 0:
        sys.setswitchinterval(args.switch_interval)
    default = torch.get_num_threads()
    counts = [int(t) for t in args.threads.split(",") if t.strip()] or \
        sorted({default, max(1, default - 1), max(1, default - 2), max(1, default // 2)}, reverse=True)
    cuda = torch.cuda.is_available()
    opt = _adamw(args.numel, pin=cuda)
    cases = {"main thread": None, "side thread": (), "+ python": (_python_loop,)}
    if cuda:
        launches, copies = _launches(), _copies(args.numel)
        cases.update({"+ launches": (launches,), "+ copies": (copies,), "+ launches + copies": (launches, copies)})
    print(f"fused AdamW step of {args.numel:,} fp32 host parameters, torch {torch.__version__}, "
          f"os.cpu_count() {os.cpu_count()}, torch's default intra-op threads {default}, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms:")
    reference = None
    print(f"  {'case':22s} " + " ".join(f"{f'{t} thr':>14s}" for t in counts))
    for name, busy in cases.items():
        cells = []
        for threads in counts:
            ms = _timed(opt, args.repeats, threads) if busy is None else _on_thread(opt, args.repeats, threads, busy)
            reference = reference or ms
            cells.append(f"{ms:7.1f} ({ms / reference:4.2f}x)")
        print(f"  {name:22s} " + " ".join(cells), flush=True)
    torch.set_num_threads(default)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
