"""Run a function on N real processes joined by a gloo process group (CPU).

Workers are spawned (not forked) so each has a clean torch; the function must be importable
(module level). A worker's exception is re-raised in the parent with its traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, init_file, fn, args, results):
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            results[rank] = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results[rank] = ("error", traceback.format_exc())


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        manager = ctx.Manager()
        results = manager.dict()
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.terminate()
        out = dict(results)
        manager.shutdown()
    errors = [f"rank {r}:\n{out[r][1]}" for r in sorted(out) if out[r][0] == "error"]
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise RuntimeError(f"distributed workers {missing} died or timed out without a result.")
    return [out[r][1] for r in range(world_size)]
