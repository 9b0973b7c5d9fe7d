#!/usr/bin/env python3
"""How fast torch's fused CPU AdamW steps one offloaded group, alone and beside what runs with it
during an offloaded backward (offload_steps.py steps groups on a host thread while gradient
copies come down and weight copies go up through the same host memory).

    python3 benchmarks/cpu_step_contention.py [--numel 50000000] [--repeats 5]

Prints the median milliseconds of one ``AdamW(fused=True).step()`` over ``--numel`` fp32 host
parameters (pinned, as offloaded main weights are) for each case:

* ``main thread``: alone, as ``optimizer.step()`` runs it after backward;
* ``side thread``: the same step on a second Python thread, the main thread idle (threading and
  OpenMP teams alone);
* ``side thread + python``: while the main thread runs a pure-Python loop (GIL hand-offs against
  a busy Python thread, as the backward's hooks are);
* ``side thread + copies``: while the main thread streams pinned device-to-host and host-to-device
  copies of the same size back to back (host memory bandwidth shared with the copy engines).
On a CPU-only machine the copies case is skipped.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def _adamw(numel: int, pin: bool):
    param = torch.zeros(numel, pin_memory=pin)
    param.grad = torch.randn(numel).pin_memory() if pin else torch.randn(numel)
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()                                     # state made outside the timing
    return opt


def _timed(opt, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _on_thread(opt, repeats: int, busy=None) -> float:
    out, stop = {}, threading.Event()
    worker = threading.Thread(target=lambda: (out.setdefault("ms", _timed(opt, repeats)), stop.set()))
    worker.start()
    if busy is not None:
        busy(stop)
    worker.join()
    return out["ms"]


def _python_loop(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _copies(numel: int):
    device = torch.device("cuda")
    host = torch.empty(numel, pin_memory=True)
    dev = torch.empty(numel, device=device)
    down, up = torch.cuda.Stream(), torch.cuda.Stream()

    def run(stop: threading.Event) -> None:
        while not stop.is_set():
            with torch.cuda.stream(down):
                host.copy_(dev, non_blocking=True)
            with torch.cuda.stream(up):
                dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=50_000_000, help="parameters of the group (default 50M)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    opt = _adamw(args.numel, pin=cuda)
    rows = {"main thread": _timed(opt, args.repeats),
            "side thread": _on_thread(opt, args.repeats),
            "side thread + python": _on_thread(opt, args.repeats, _python_loop)}
    if cuda:
        rows["side thread + copies"] = _on_thread(opt, args.repeats, _copies(args.numel))
    print(f"fused AdamW step of {args.numel:,} fp32 host parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads:")
    for name, ms in rows.items():
        print(f"  {name:24s} {ms:8.1f} ms  ({ms / rows['main thread']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
