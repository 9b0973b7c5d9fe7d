#!/usr/bin/env python3
"""ZeRO-3 memory, ours against torch FSDP2, at the points PyTorch FSDP2's memory test measures.

    python -m tests.functional.step_memory --out $OUT/step_memory.md --json $OUT/step_memory.json
    python -m tests.functional.step_memory --configs 1,2:1 --out ...    # only world 1 and rank 1 of a fake 2
    python -m tests.functional.step_memory --device cpu --configs 1 --out /tmp/step_memory.md   # CPU dry run

The model, optimizer and bounds are those of pytorch/pytorch
``test/distributed/_composable/fsdp/test_fully_shard_memory.py`` (``test_fully_shard_training_memory``,
reshard_after_forward=True, no offload; tests/fsdp2_memory_model.py): a 21.3M-parameter fp32
Transformer with every block and the root wrapped, ``Adam(lr=1e-2, foreach=False)``, one (1, 4)
input. Each configuration (``--configs``: ``W`` = a real 1-rank group when W is 1, else rank 0
of torch's fake process group of W ranks; ``W:R`` = fake rank R) runs in its own process, FSDP2
then ours (``fully_shard(optim_grads_params, unit_modules=[TransformerBlock])``) one after the
other, each freed before the next. With the fake group collectives are no-ops (weights hold
garbage): the bytes are a real rank's, the values are not.

Per system and point, in MB (1e6 B) above a base taken after cuBLAS's workspace is allocated and
before the model exists (upstream's ``base_mem_mb``): ``memory_allocated`` after the point and
``max_memory_allocated`` during it (peak stats reset at the start of each point), and upstream's
bound for it. ``step`` = ``optimizer.step()`` after ``del loss`` (upstream resets the peak there too);
what is held when it begins is split into weights, grads and other (the rest: buffers, leftovers).
The step also runs under ``torch.cuda.memory._record_memory_history``; the allocations live at
its peak that the step itself made are listed (size, first frames) so an excess names its origin.

On CPU (``--device cpu``) nothing is read from an allocator: current bytes are the storages live
tensors hold and peaks come from torch.profiler's allocation events (tests/cpu_live_bytes.py);
a plumbing check, exact for the step, approximate where gloo runs collectives on its threads.
Runs in well under 2 minutes on one GPU; needs torch >= 2.4 (FSDP2's ``torch.distributed.fsdp``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:           # megatron_fsdp_v2 and tests/ from this checkout
    sys.path.insert(0, str(REPO))

MB = 1e6
SYSTEMS = ("fsdp2", "ours")
POINTS = ("init", "forward", "backward", "step", "zero_grad")
BOUND_OF = {("init", "current"): "init_current", ("init", "peak"): "init_peak", ("forward", "peak"): "forward_peak",
            ("backward", "peak"): "backward_peak", ("step", "peak"): "step_peak",
            ("zero_grad", "current"): "after_zero_grad"}
#: a block of this size (a multiple of 512: the trace records it as is) marks where a traced step begins
MARKER_BYTES = 2049 * 512
#: frames that say nothing about who allocated
NOISE = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "contextlib.py", "torch/_ops.py",
         "torch/optim/optimizer.py", "torch/_tensor.py", "<frozen", "step_memory.py")


# =============================================================================================
# Reading memory: CUDA's allocator, or CPU's storages and profiler events
# =============================================================================================


class CudaMeter:
    """Bytes above a base: current after, and peak during, each measured call."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.device = torch, device
        self.base = 0

    def settle(self) -> int:
        gc.collect()
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.empty_cache()
        return self.torch.cuda.memory_allocated(self.device)

    def start(self) -> None:
        self.base = self.settle()

    def run(self, fn: Callable[[], object], trace: bool = False) -> Tuple[object, dict]:
        cuda = self.torch.cuda
        cuda.synchronize(self.device)
        cuda.reset_peak_memory_stats(self.device)
        start = cuda.memory_allocated(self.device) - self.base
        if trace:
            cuda.memory._record_memory_history(max_entries=200_000)
            self.torch.empty(MARKER_BYTES, dtype=self.torch.uint8, device=self.device)
        out = fn()
        cuda.synchronize(self.device)
        stats = cuda.memory_stats(self.device)
        res = {"start": start, "current": cuda.memory_allocated(self.device) - self.base,
               "peak": cuda.max_memory_allocated(self.device) - self.base,
               "active_peak": stats.get("active_bytes.all.peak", 0) - self.base}
        if trace:
            snapshot = cuda.memory._snapshot()
            cuda.memory._record_memory_history(enabled=None)
            traces = snapshot.get("device_traces") or []
            index = self.device.index or 0
            res["at_peak"] = live_at_peak(traces[index] if index < len(traces) else [])
        return out, res


class CpuMeter:
    """The same readings on CPU from tests/cpu_live_bytes.py (storages held, profiler events)."""

    def __init__(self, device) -> None:
        self.baseline: dict = {}

    def start(self) -> None:
        from tests.cpu_live_bytes import live_storages

        self.baseline = live_storages()

    def run(self, fn: Callable[[], object], trace: bool = False) -> Tuple[object, dict]:
        from tests.cpu_live_bytes import measure

        box: list = []
        region = measure(lambda: box.append(fn()), self.baseline, top=10_000)
        res = {"start": region.held_at_start, "current": region.held_at_end, "peak": region.peak,
               "active_peak": region.peak}
        if trace:
            res["at_peak"] = grouped(region.at_peak)
        return box[0], res


def _frames_text(frames: List[dict], n: int = 3) -> str:
    useful = [f for f in frames if not any(x in f.get("filename", "") for x in NOISE)]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in useful[:n]) or "(no Python frames)"


def grouped(pairs, top: int = 8) -> List[Tuple[int, int, str]]:
    """``(bytes, count, who)`` per distinct ``who`` of ``(bytes, who)`` pairs, largest first."""
    totals: Dict[str, List[int]] = {}
    for size, who in pairs:
        entry = totals.setdefault(who, [0, 0])
        entry[0] += size
        entry[1] += 1
    return sorted(((b, n, who) for who, (b, n) in totals.items()), reverse=True)[:top]


def live_at_peak(trace: List[dict], top: int = 8) -> List[Tuple[int, int, str]]:
    """Replay a memory-history trace (the step only): the allocations it made that are live when
    its running total peaks, largest first (blocks it freed but did not make are ignored). The
    step begins after the last marker block (an earlier recording's events may still be there)."""
    marks = [i for i, e in enumerate(trace) if e.get("action") == "alloc" and e.get("size") == MARKER_BYTES]
    trace = trace[marks[-1] + 1:] if marks else trace
    live: Dict[int, Tuple[int, List[dict]]] = {}
    now = peak = 0
    best: Dict[int, Tuple[int, List[dict]]] = {}
    for event in trace:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            live[addr] = (event.get("size", 0), event.get("frames") or [])
            now += live[addr][0]
        elif action == "free_completed" and addr in live:
            now -= live.pop(addr)[0]
        if now > peak:
            peak, best = now, dict(live)
    return grouped(((size, _frames_text(frames)) for size, frames in best.values()), top)


# =============================================================================================
# One system through upstream's points
# =============================================================================================


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _build(system: str, device, mesh):
    import torch

    from tests.fsdp2_memory_model import FSDP2_TEST_ARGS, Transformer, TransformerBlock

    torch.manual_seed(42)
    with torch.device(device):
        model = Transformer(**FSDP2_TEST_ARGS)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for module in model.modules():
            if isinstance(module, TransformerBlock):
                torch_fully_shard(module, mesh=mesh, reshard_after_forward=True)
        torch_fully_shard(model, mesh=mesh, reshard_after_forward=True)
    else:
        from megatron_fsdp_v2 import fully_shard

        model = fully_shard(model, sharding_strategy="optim_grads_params", unit_modules=[TransformerBlock])
    # upstream: "Do not use foreach since intermediates increase peak memory"
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


def run_system(system: str, device, mesh, meter) -> dict:
    """Upstream's sequence: build, forward, backward, ``del loss``, step, zero_grad."""
    from tests.fsdp2_memory_model import fsdp2_input

    meter.start()
    out: dict = {}
    (model, optim), out["init"] = meter.run(lambda: _build(system, device, mesh))
    inp = fsdp2_input(device)
    loss, out["forward"] = meter.run(lambda: model(inp))
    _, out["backward"] = meter.run(lambda: loss.sum().backward())
    del loss
    params = list(model.parameters())
    weights, grads = _local_bytes(params), _local_bytes(p.grad for p in params if p.grad is not None)
    _, out["step"] = meter.run(optim.step, trace=True)
    out["step"]["held"] = {"weights": weights, "grads": grads,
                           "other": out["step"]["start"] - weights - grads}
    _, out["zero_grad"] = meter.run(optim.zero_grad)
    del model, optim, params
    return out


# =============================================================================================
# One configuration per process
# =============================================================================================


def _init_group(device, world: int, rank: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        torch.cuda.set_device(device)            # before NCCL's group: its communicator binds this device
    if world == 1:
        from tests.dist_pool import free_port

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore   # registers "fake"

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return init_device_mesh(device.type, (world,))


def _warm_cublas(device) -> None:
    """Upstream's pre-run: cuBLAS workspaces exist before the base is read."""
    import torch

    lin = torch.nn.Linear(768, 768, device=device)
    lin(torch.randn(1, 768, device=device)).sum().backward()


def run_config(device_name: str, world: int, rank: int, systems: List[str]) -> dict:
    import torch
    import torch.distributed as dist

    from tests.fsdp2_memory_model import FSDP2_TEST_ARGS, Transformer, fsdp2_bounds, fsdp2_numels

    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    mesh = _init_group(device, world, rank)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    _warm_cublas(device)
    meter = CudaMeter(device) if device.type == "cuda" else CpuMeter(device)
    with torch.device("meta"):
        numels = fsdp2_numels(Transformer(**FSDP2_TEST_ARGS), world)
    result = {"world": world, "rank": rank, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "torch": torch.__version__, "fake": world > 1, "numels": numels,
              "bounds": fsdp2_bounds(numels), "systems": {}}
    for system in systems:
        result["systems"][system] = run_system(system, device, mesh, meter)
    dist.destroy_process_group()
    return result


# =============================================================================================
# The report
# =============================================================================================


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MB:.2f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def config_title(res: dict) -> str:
    where = f"rank {res['rank']} of torch's fake group of {res['world']}" if res["fake"] else "a real 1-rank group"
    n = res["numels"]
    return (f"### world {res['world']}, {where}\n\n- {res['device']}, torch {res['torch']}; {n['unsharded']:,} "
            f"parameters, upstream's sharded numel {n['sharded']:,}, largest block {n['max_block']:,}")


def config_markdown(res: dict) -> str:
    """One table: rows = (point, reading), columns = FSDP2, ours, ours/FSDP2, bound, each / bound."""
    systems = res["systems"]
    fsdp2, ours = systems.get("fsdp2"), systems.get("ours")
    lines = [config_title(res), "",
             "| point | reading | FSDP2 MB | ours MB | ours / FSDP2 | upstream bound MB | FSDP2 / bound "
             "| ours / bound |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for point in POINTS:
        for reading in ("start", "current", "peak"):
            if reading == "start" and point != "step":
                continue
            key = BOUND_OF.get((point, reading))
            bound = res["bounds"][key] if key else None
            a = fsdp2[point][reading] if fsdp2 else None
            b = ours[point][reading] if ours else None
            name = {"start": "held when it begins", "current": "memory_allocated after",
                    "peak": "max_memory_allocated during"}[reading]
            lines.append(f"| {point} | {name} | {_mb(a)} | {_mb(b)} | {_ratio(b, a)} | {_mb(bound)} | "
                         f"{_ratio(a, bound)} | {_ratio(b, bound)} |")
    lines += ["", "Held when the step begins (MB): weights / grads / other (= held - weights - grads)", ""]
    for name, sys_res in systems.items():
        held = sys_res["step"]["held"]
        lines.append(f"- {name}: {_mb(held['weights'])} / {_mb(held['grads'])} / {_mb(held['other'])}; "
                     f"step peak - held at start = {_mb(sys_res['step']['peak'] - sys_res['step']['start'])} MB")
    lines += ["", "Allocations the step made, live at its peak (MB x count, by first frames):", ""]
    for name, sys_res in systems.items():
        for size, count, who in sys_res["step"].get("at_peak", []):
            lines.append(f"- {name}: {size / MB:.2f} x{count} `{who}`")
    return "\n".join(lines)


def report_markdown(results: List[dict], command: str) -> str:
    head = ["## ZeRO-3 memory at FSDP2's memory-test points: ours against torch FSDP2", "",
            f"- command: `{command}`",
            "- model, optimizer, input and bounds: pytorch/pytorch test_fully_shard_memory.py "
            "(test_fully_shard_training_memory, reshard_after_forward=True, no offload); MB = 1e6 B above the "
            "base (after cuBLAS's workspace, before the model); upstream's bounds are for its 2 ranks' formulas "
            "at each world size here (sharded numel = ceil(numel / world))",
            "- each point resets the peak stats first; step = optimizer.step() after del loss", ""]
    return "\n".join(head + [config_markdown(r) + "\n" for r in results])


# =============================================================================================
# Command line
# =============================================================================================


def parse_configs(spec: str) -> List[Tuple[int, int]]:
    out = []
    for item in spec.split(","):
        world, _, rank = item.strip().partition(":")
        w, r = int(world), int(rank or 0)
        if w < 1 or not 0 <= r < w:
            raise SystemExit(f"--configs: {item!r} must be W or W:R with W >= 1 and 0 <= R < W.")
        out.append((w, r))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--configs", default="1,2:0,2:1,8:0",
                   help="world[:rank] list; world 1 is a real 1-rank group, others torch's fake group")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="fsdp2,ours (run in this order)")
    p.add_argument("--out", default=None, help="write the markdown report here")
    p.add_argument("--json", default=None, help="write the raw numbers here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration's process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)    # "W:R:path": one configuration
    args = p.parse_args(argv)
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.system_list if s not in SYSTEMS]
    if bad or not args.system_list:
        raise SystemExit(f"--systems: got {args.systems!r}; allowed: a comma list of {', '.join(SYSTEMS)}.")
    return args


def _child(args) -> int:
    world, rank, path = args.child.split(":", 2)
    result = run_config(args.device, int(world), int(rank), args.system_list)
    Path(path).write_text(json.dumps(result))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return _child(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible (use --device cpu for a CPU dry run).")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, rank in parse_configs(args.configs):
            path = Path(tmp) / f"w{world}r{rank}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--systems", args.systems,
                   "--child", f"{world}:{rank}:{path}"]
            print(f"world {world} rank {rank} ...", flush=True)
            subprocess.run(cmd, check=True, timeout=args.timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
            results.append(json.loads(path.read_text()))
    command = "python " + " ".join([str(Path(sys.argv[0]))] + (argv if argv is not None else sys.argv[1:]))
    text = report_markdown(results, command)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
