#!/usr/bin/env python3
"""The largest Megatron GPT that trains, per system, with the model built on the meta device.

For each system (ours ZeRO-3, PyTorch FSDP2, Megatron-FSDP v1), every model is built under
``torch.device("meta")`` and materialized by the wrapper, a shard at a time. The number of layers
L grows at fixed width (hidden 4096, 32 heads, ffn 16384, seq 4096, micro-batch 1, vocab 32000,
bf16, Megatron's full activation recompute, one layer per recompute unit)::

    python benchmarks/bench_largest.py                      # 1 GPU
    python benchmarks/bench_largest.py --nproc 2            # 2 GPUs (torchrun, NCCL)
    python benchmarks/bench_largest.py --fake-world-size 8  # rank 0 of a fake 8-way group
    python benchmarks/bench_largest.py --device cpu --small --layers-probe 1,2   # CPU dry run

Search, per system: train at the probe sizes (``--layers-probe``, default 2 and 4 layers), fit
the peak memory linearly in L, predict the largest L whose peak fits in what the device can still
allocate minus ``--margin-gib``, then train there and walk up (while it fits) or down (while it runs
out of memory) until L trains and L+1 runs out of memory, at most ``--max-attempts`` runs after the
probes. Every run is ``--warmup`` (1) + ``--steps`` (2) steps of bench_gpt.py's ``run_system``
(forward + backward, optimizer step, zero_grad; out-of-memory caught, everything freed). With
several processes the ranks agree on each run's outcome over a gloo group (it trains only if it
trains on every rank; peak = the largest over ranks). Results: a markdown table and JSON,
rewritten after every run (default benchmarks/results/<today>/largest_<N>gpu.md/.json). See
docs/benchmarks.md, "Largest model that trains (meta-device init)".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):       # megatron_fsdp_v2 from this checkout; sibling modules
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Seconds since the run began, across the restarts of launch_workers (which sets the variable).
START = float(os.environ.get("BENCH_LARGEST_START", time.time()))


def elapsed() -> float:
    return time.time() - START


from bench_gpt import RESULTS, _fmt, add_model_arguments, notes_markdown, quiet_libraries, run_system  # noqa: E402
from bench_setup import (FULL_RECOMPUTE, Ctx, build_gpt, cleanup, count_params, init_distributed,  # noqa: E402
                         finish_process, prepare_process)
from bench_systems import (BUILDERS, GIB, Built, System, _forward_loss, _fused_ok,  # noqa: E402
                           params_grads_optimizer_bytes, torch_optimizer_state_bytes)


# =============================================================================================
# Systems: each takes the GPT build_gpt makes on the meta device (args.meta_init)
# =============================================================================================


@dataclass(frozen=True)
class MetaSystem(System):
    label: str = ""

    @property
    def description(self) -> str:
        return self.label

    @property
    def cuda_only(self) -> bool:
        return self.kind == "megatron_fsdp"


SYSTEMS = (
    MetaSystem("ours", "ours_meta", strategy="optim_grads_params",
               label="megatron_fsdp_v2 fully_shard(optim_grads_params) = ZeRO-3, unit TransformerLayer, bf16 params; "
                     "meta + init_fn=megatron_init_fn(config)"),
    MetaSystem("fsdp2", "fsdp2_meta",
               label="torch FSDP2 fully_shard per TransformerLayer + root (bf16 params, fp32 reduce) = ZeRO-3; "
                     "meta, to_empty, megatron_init_fn(config) on every submodule"),
    MetaSystem("megatron_fsdp", "megatron_fsdp", strategy="optim_grads_params",
               label="Megatron-FSDP v1 optim_grads_params = ZeRO-3 (bench_systems.build_megatron_fsdp); "
                     "meta + config.init_model_with_meta_device=True"),
)


#: torch.cuda.max_memory_reserved over the steps of the last run (ours, FSDP2): what the caching
#: allocator held, fragmentation included; run_system itself reads only the allocated peak.
PEAK_RESERVED: Dict[str, float] = {}


def _adamw_step(ctx: Ctx, model: torch.nn.Module, keep: list,
                accounted: Callable[[torch.optim.Optimizer], int], **measures) -> Built:
    """Fused AdamW over ``model.parameters()`` and bench_gpt.py's step of the torch-optimizer systems."""
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=_fused_ok(ctx))

    def zero_grad():
        opt.zero_grad(set_to_none=True)
        if ctx.is_cuda:       # run_system resets the peaks after the build: the steps' peak
            PEAK_RESERVED["gib"] = torch.cuda.max_memory_reserved(ctx.device) / GIB

    def fwd_bwd():
        loss = _forward_loss(ctx, model)
        loss.backward()
        return loss.detach()

    return Built(fwd_bwd, opt.step, zero_grad, [model, opt, *keep],
                 optimizer_state_bytes=lambda: torch_optimizer_state_bytes([opt]),
                 accounted_state_bytes=lambda: accounted(opt), **measures)


def offload_systems(fractions) -> List[MetaSystem]:
    """``--offload-fractions``: ours ZeRO-3 with ``OffloadPolicy(fraction=f)`` per f (f=0 is ``ours``)."""
    return [MetaSystem(f"ours-offload{f:g}", "ours_meta", strategy="optim_grads_params", offload=f,
                       label=f"megatron_fsdp_v2 ZeRO-3 as ours, offload=OffloadPolicy(fraction={f:g}, pin_memory=True, "
                             "step_in_backward=True)")
            for f in fractions]


def _host_available() -> Optional[int]:
    try:
        return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None


#: Host bytes per offloaded parameter: fp32 main 4 + Adam 8 + grads 4, the pinned ones at their
#: exact size (offload/host_memory.py); 0.5 more for what else the process holds. (Before the pinned
#: buffers were exact, torch's host allocator rounded them up to powers of two and 16 let the
#: kernel's out-of-memory killer end a run: benchmarks/results/2026-12-02/largest_offload.md.)
HOST_BYTES_PER_OFFLOADED_PARAM = 16.5


def _host_need(ctx: Ctx, fraction: float, num_params: int) -> float:
    """Offloaded state in host memory per rank of the group, fake or real (every real rank of this
    host holds its share)."""
    return HOST_BYTES_PER_OFFLOADED_PARAM * fraction * num_params / ctx.world * (ctx.real_world or 1)


def check_host_memory(ctx: Ctx, fraction: float) -> None:
    """Refuse a size the host cannot hold as out of memory, instead of letting the kernel's
    out-of-memory killer end the search."""
    need, available = _host_need(ctx, fraction, ctx.num_params or 0), _host_available()
    if available is not None and need > 0.9 * available:
        raise torch.OutOfMemoryError(f"host out of memory (predicted): offloaded state needs {need / GIB:.1f} GiB, "
                                     f"{available / GIB:.1f} GiB available")


def host_layer_cap(ctx: Ctx, system: "MetaSystem", params: Callable[[int], int], max_layers: int) -> int:
    """The most layers whose offloaded state the host can hold (``check_host_memory``'s rule), so
    the search starts below the host's bound rather than at the GPU's (which offload lifts far
    above it); ``max_layers`` for a system without offload."""
    available = _host_available()
    if not system.offload or available is None:
        return max_layers
    lo, hi = 0, max_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _host_need(ctx, system.offload, params(mid)) <= 0.9 * available:
            lo = mid
        else:
            hi = mid - 1
    return lo


def build_ours_meta(ctx: Ctx, system: System) -> Built:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp_v2 import MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from megatron_fsdp_v2.megatron.meta_init import megatron_init_fn

    offload = None
    if system.offload is not None:
        check_host_memory(ctx, system.offload)
        # (step in backward needs the optimizer's kernel chosen: fused AdamW, on a GPU)
        offload = OffloadPolicy(fraction=system.offload, pin_memory=True, step_in_backward=_fused_ok(ctx))
    gpt, config = build_gpt(ctx, torch.float32)           # on meta
    model = fully_shard(gpt, sharding_strategy=system.strategy, unit_modules=[TransformerLayer],
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                        init_fn=megatron_init_fn(config), offload=offload)
    del gpt
    on_device = lambda opt: sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()  # noqa: E731
                                if torch.is_tensor(v) and getattr(v, "_local_tensor", v).device.type != "cpu")
    accounted = lambda opt: model.persistent_bytes()["total"] + (  # noqa: E731
        on_device(opt) if offload is not None else torch_optimizer_state_bytes([opt]))
    return _adamw_step(ctx, model, [], accounted, persistent_bytes=model.persistent_bytes, comm_stats=model.comm_stats,
                       reset_comm_stats=model.reset_comm_stats)


def build_fsdp2_meta(ctx: Ctx, system: System) -> Built:
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from megatron_fsdp_v2.megatron.meta_init import megatron_init_fn

    model, config = build_gpt(ctx, torch.float32)         # on meta
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    policy = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in [m for m in model.modules() if isinstance(m, TransformerLayer)]:
        torch_fully_shard(layer, mesh=mesh, mp_policy=policy)
    torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    # FSDP2's recipe for a meta model: allocate this rank's shards, then initialize them in place
    # (DTensor parameters; torch.nn.init runs on DTensors). The local spec's layers have no
    # reset_parameters(): megatron_init_fn does what their constructors do. The GPT has no buffers.
    model.to_empty(device=ctx.device)
    init = megatron_init_fn(config)
    for module in model.modules():
        init(module)
    return _adamw_step(ctx, model, [mesh], lambda opt: params_grads_optimizer_bytes(model, [opt]))


BUILDERS.update(ours_meta=build_ours_meta, fsdp2_meta=build_fsdp2_meta)   # megatron_fsdp: bench_systems'


def select(spec: str, offload_fractions=()) -> List[MetaSystem]:
    everything = list(SYSTEMS) + offload_systems(offload_fractions)
    names = [s.name for s in everything]
    wanted = names if spec.strip() in ("", "all") else [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in names]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from all, {', '.join(names)}")
    return [s for s in everything if s.name in wanted]


# =============================================================================================
# One run and the search
# =============================================================================================

ATTEMPT_KEYS = ("status", "error", "peak_gib", "peak_reserved_gib", "step_ms", "tokens_per_s", "build_s", "state_gib",
                "leaked_gib", "loss_last", "notes")


class Run:
    """What the search knows so far; rank 0 writes it out before and after every training run.

    Under ``--nproc`` the processes are started by ``launch_workers``, which starts them again
    when they end during a run; the new processes read what the old ones wrote (``--state``) and
    replay the search, taking each recorded run's outcome instead of training again, and the run
    that was in progress as one that does not train at that size."""

    def __init__(self, ctx: Ctx, meta: Dict[str, Any]):
        self.ctx, self.meta, self.rows = ctx, meta, []
        self.current: Optional[Dict[str, Any]] = None      # the run in progress: system, layers
        self.recorded: Dict[tuple, Dict[str, Any]] = {}
        state = _read_json(ctx.args.state)
        if state:
            self._resume(state)
        self.agree_group = None
        if ctx.real_world > 1:   # outcomes agreed off the NCCL stream, which a stuck rank blocks
            self.agree_group = dist.new_group(backend="gloo",
                                              timeout=timedelta(seconds=ctx.args.attempt_timeout + 60))

    def _resume(self, state: Dict[str, Any]) -> None:
        old = state["meta"]
        for key in ("total_gib", "usable_gib", "capacity_gib"):     # the same predictions as before
            if old.get(key) is not None:
                self.meta[key] = old[key]
        self.meta["restarts"] = old.get("restarts", 0) + 1
        self.meta["notes"] = list(old.get("notes", []))
        for row in state["systems"]:
            for r in row["attempts"]:
                self.recorded[(row["name"], r["layers"])] = r
        hung = state.get("running")
        if hung:
            self.recorded[(hung["system"], hung["layers"])] = dict(
                status="OOM", error=f"no result within {hung['timeout_s']:.0f} s, processes restarted (a rank out "
                                    f"of memory while another waits in a collective)")
            self.meta["notes"].append(f"restart {self.meta['restarts']}: the processes were ended during "
                                      f"{hung['system']} at L={hung['layers']} (no result within "
                                      f"{hung['timeout_s']:.0f} s); that run counts as not training")

    def write(self, final: bool = False) -> None:
        if self.ctx.rank != 0:
            return
        a = self.ctx.args
        self.meta["elapsed_s"] = elapsed()
        md = results_markdown(self.meta, self.rows, self.current)
        if not final:
            md = "<!-- partial: the run has not finished -->\n" + md
        state = {"meta": dict(self.meta, complete=final), "systems": self.rows, "running": self.current}
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(md + "\n")
        for path in (a.json, a.state):
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(json.dumps(state, indent=1))
        if final:
            print("\n" + md, flush=True)
            for path in (a.out, a.json):
                if path:
                    print(f"wrote {path}")

    def agree(self, r: Dict[str, Any]) -> Dict[str, Any]:
        """Trains only if it trained on every rank; peak = the largest over ranks."""
        if self.agree_group is None:
            return r
        everyone: List[Any] = [None] * self.ctx.real_world
        dist.all_gather_object(everyone, {k: r.get(k) for k in ("status", "error", "peak_gib", "peak_reserved_gib")},
                               group=self.agree_group)
        bad = [(rank, e) for rank, e in enumerate(everyone) if e["status"] != "ok"]
        if bad:
            errors = [(rank, e) for rank, e in bad if e["status"] != "OOM"]
            rank, first = (errors or bad)[0]
            r.update(status=first["status"], error=f"rank {rank}: {first['error']}")
            if len(bad) < len(everyone):
                r["notes"] = (r.get("notes") or []) + [f"ranks {[b for b, _ in bad]} failed, the others trained"]
        peaks = [e["peak_gib"] for e in everyone]
        if all(p is not None for p in peaks):
            r["peak_gib"], r["peak_gib_ranks"] = max(peaks), peaks
        reserved = [e["peak_reserved_gib"] for e in everyone]
        if all(p is not None for p in reserved):
            r["peak_reserved_gib"] = max(reserved)
        return r

    def timeout_s(self, fits: Dict[int, Dict[str, Any]], layers: int) -> float:
        """How long a run at ``layers`` may take: 2x the estimate from the largest L that trained
        (build and steps scaled by the layers, plus 10 s), at least 30 s, at most --attempt-timeout."""
        cap = self.ctx.args.attempt_timeout
        if not fits:
            return cap
        L = max(fits)
        r, a = fits[L], self.ctx.args
        per_run = (r.get("build_s") or 0.0) + (a.warmup + a.steps) * (r.get("step_ms") or 0.0) / 1000.0
        return min(cap, max(30.0, 2.0 * (10.0 + per_run * layers / L)))

    def attempt(self, system: MetaSystem, layers: int, params: int, timeout_s: float) -> Dict[str, Any]:
        ctx = self.ctx
        recorded = self.recorded.pop((system.name, layers), None)
        if recorded is not None:
            out = {**dict.fromkeys(ATTEMPT_KEYS), **recorded, "layers": layers, "params": params}
            ctx.log(f"    L={layers:4d} ({params / 1e9:.2f}B): {out['status']} (recorded before the restart)")
            return out
        ctx.args.layers, ctx.num_params = layers, params
        self.current = dict(system=system.name, layers=layers, since_s=round(elapsed(), 1), timeout_s=timeout_s)
        self.write()
        # A run with no result in time: typically one rank ran out of memory while another waits
        # in a collective for it forever. End the process (torchrun ends the others); under
        # --nproc, launch_workers starts them again and the run counts as not training.
        timer = threading.Timer(timeout_s, _end_hung_process, args=(ctx.rank, system.name, layers, timeout_s))
        timer.daemon = True
        timer.start()
        PEAK_RESERVED.clear()
        try:
            r = run_system(ctx, system)
            if r["status"] == "ok":
                r["peak_reserved_gib"] = PEAK_RESERVED.get("gib")
            r = self.agree(r)
        finally:
            timer.cancel()
        self.current = None
        out = dict(layers=layers, params=params, **{k: r.get(k) for k in ATTEMPT_KEYS})
        if "peak_gib_ranks" in r:
            out["peak_gib_ranks"] = r["peak_gib_ranks"]
        ctx.log(f"    L={layers:4d} ({params / 1e9:.2f}B): {out['status']}"
                + (f"  peak {_fmt(out['peak_gib'])} GiB  step {_fmt(out['step_ms'], '.0f')} ms" if out["status"] == "ok"
                   else f"  {out['error']}") + f"  [{elapsed():.0f} s]")
        return out


def _end_hung_process(rank: int, name: str, layers: int, timeout_s: float) -> None:
    print(f"[rank {rank}] {name} at L={layers}: no result within {timeout_s:.0f} s; ending the process",
          file=sys.stderr, flush=True)
    os._exit(3)


def _read_json(path: Optional[str]) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def param_counter(ctx: Ctx) -> Callable[[int], int]:
    """Parameters of the L-layer GPT, from meta builds at 1 and 2 layers (exact: linear in L)."""
    counts = []
    for layers in (1, 2):
        ctx.args.layers = layers
        model, _ = build_gpt(ctx, torch.float32)
        counts.append(count_params(model))
        del model
    base, per_layer = counts[0] - (counts[1] - counts[0]), counts[1] - counts[0]
    return lambda layers: base + per_layer * layers


def fit(fits: Dict[int, Dict[str, Any]]) -> Optional[tuple]:
    """(slope GiB/layer, intercept GiB) through the two largest L that trained with a peak reading."""
    points = sorted((L, r["peak_gib"]) for L, r in fits.items() if r.get("peak_gib") is not None)
    if len(points) < 2:
        return None
    (l1, p1), (l2, p2) = points[-2:]
    slope = (p2 - p1) / (l2 - l1)
    return slope, p2 - slope * l2


def next_layers(fits: Dict[int, Dict[str, Any]], oom_at: Optional[int], capacity_gib: float, max_layers: int,
                misses: int) -> Optional[int]:
    """The next L to train: the fit's prediction, kept strictly between the largest L that trained
    and the smallest that ran out of memory; after ``misses`` >= 2 runs in a row out of memory
    (the fit is off by more than a layer), 2, 4, 8, ... layers below the last of them."""
    lo = max(fits, default=0)
    hi = oom_at if oom_at is not None else max_layers + 1
    line = fit(fits)
    predicted = lo + 1
    if line is not None and line[0] > 0:
        predicted = math.floor((capacity_gib - line[1]) / line[0])
    if misses >= 2 and oom_at is not None:
        candidate = max(hi - 2 ** (misses - 1), lo + 1)
    else:
        candidate = min(max(predicted, lo + 1), hi - 1)
    return candidate if lo < candidate < hi else None


def search(run: Run, system: MetaSystem, params: Callable[[int], int], capacity_gib: Optional[float]) -> Dict[str, Any]:
    ctx, a = run.ctx, run.ctx.args
    row: Dict[str, Any] = dict(name=system.name, description=system.description, world=ctx.world,
                               status="ok", error=None, attempts=[], notes=[])
    run.rows.append(row)
    if system.cuda_only and not ctx.is_cuda:
        row.update(status="skipped", error="CUDA-only (Megatron-FSDP v1); skipped on CPU")
        return row
    fits: Dict[int, Dict[str, Any]] = {}
    oom_at: Optional[int] = None
    max_layers = host_layer_cap(ctx, system, params, a.max_layers)
    if max_layers < a.max_layers:
        row["notes"].append(f"host memory holds the offloaded state of at most L={max_layers}: the search stays "
                            f"at or below it")

    def train(layers: int) -> bool:
        """Run at ``layers``; False where the search must stop (an error that is not OOM, or time)."""
        nonlocal oom_at
        if a.time_budget and elapsed() > a.time_budget:
            row["notes"].append(f"--time-budget {a.time_budget:.0f} s used up before L={layers}")
            return False
        r = run.attempt(system, layers, params(layers), run.timeout_s(fits, layers))
        row["attempts"].append(r)
        run.write()
        if r["status"] == "ok":
            fits[layers] = r
        elif r["status"] == "OOM":
            oom_at = layers if oom_at is None else min(oom_at, layers)
        else:
            row.update(status=r["status"], error=r["error"])
            return False
        return True

    ok = True
    for layers in a.layers_probe:
        if oom_at is not None and layers >= oom_at:
            break
        ok = train(layers)
        if not ok:
            break
    if ok and capacity_gib is None:
        row["notes"].append("no memory readings on this device: probe sizes only, no out-of-memory search")
    elif ok:
        for _ in range(a.max_attempts):
            misses = 0
            while misses < len(row["attempts"]) and row["attempts"][-1 - misses]["status"] == "OOM":
                misses += 1
            layers = next_layers(fits, oom_at, capacity_gib, max_layers, misses)
            if layers is None or not train(layers):
                break
    largest = max(fits, default=None)
    line = fit(fits)
    row.update(layers=largest, oom_layers=oom_at, gib_per_layer=line[0] if line else None,
               gib_fixed=line[1] if line else None, closed=largest is not None and oom_at == largest + 1)
    if largest is not None:
        best = fits[largest]
        row.update(params=best["params"], peak_gib=best["peak_gib"], peak_reserved_gib=best.get("peak_reserved_gib"),
                   tokens_per_s=best["tokens_per_s"], step_ms=best["step_ms"])
    elif row["status"] == "ok":
        row["status"] = "OOM"
        row["error"] = f"out of memory at every size tried (down to L={oom_at})"
    if largest is not None and largest >= max_layers:
        row["notes"].append(f"--max-layers {a.max_layers} trained: the search stopped there" if max_layers == a.max_layers
                            else f"L={max_layers} trained; L+1 needs more host memory than the host has (predicted)")
    elif capacity_gib is not None and row["status"] == "ok" and not row["closed"]:
        row["notes"].append("bracket not closed (L+1 not shown to run out of memory): raise --max-attempts "
                            "or --time-budget")
    for r in row["attempts"]:
        row["notes"] += [f"L={r['layers']}: {note}" for note in r.get("notes") or []]
    return row


# =============================================================================================
# Reporting
# =============================================================================================


def _attempt_cell(r: Dict[str, Any]) -> str:
    if r.get("peak_gib") is not None:
        return f"{r['layers']}: {r['status']} {r['peak_gib']:.1f}"
    unused = re.search(r"([\d.]+) ([GM])iB is reserved by PyTorch but unalloc", r.get("error") or "")
    if unused:
        gib = float(unused.group(1)) / (1024.0 if unused.group(2) == "M" else 1.0)
        return f"{r['layers']}: {r['status']} ({gib:.1f} reserved unused)"
    return f"{r['layers']}: {r['status']}"


def _attempts_cell(row: Dict[str, Any], current: Optional[Dict[str, Any]]) -> str:
    cells = [_attempt_cell(r) for r in row.get("attempts", [])]
    if current and current["system"] == row["name"]:
        cells.append(f"{current['layers']}: running (no result yet)")
    return ", ".join(cells) or "-"


def _fit_cell(row: Dict[str, Any]) -> str:
    if row.get("gib_per_layer") is None:
        return "-"
    return f"{row['gib_fixed']:.2f} + {row['gib_per_layer']:.3f}·L"


def goal_lines(rows: List[Dict[str, Any]]) -> List[str]:
    by = {r["name"]: r for r in rows}
    ours, fsdp2 = by.get("ours"), by.get("fsdp2")
    if not ours or not fsdp2 or ours.get("layers") is None or fsdp2.get("layers") is None:
        return []
    met = ours["layers"] >= fsdp2["layers"]
    out = [f"- goal (at least FSDP2's size): ours trains L = {ours['layers']} ({ours['params'] / 1e9:.2f}B), FSDP2 "
           f"L = {fsdp2['layers']} ({fsdp2['params'] / 1e9:.2f}B): **{'met' if met else 'missed'}**"]
    peaks = {}
    for row in (ours, fsdp2):
        for r in row["attempts"]:
            if r["status"] == "ok" and r.get("peak_gib") is not None:
                peaks.setdefault(row["name"], {})[r["layers"]] = r["peak_gib"]
    common = sorted(set(peaks.get("ours", {})) & set(peaks.get("fsdp2", {})))
    if common:
        L = common[-1]
        p, q = peaks["ours"][L], peaks["fsdp2"][L]
        out.append(f"- goal (equal or lower peak): at L = {L}, the largest size both trained, ours {p:.2f} GiB vs "
                   f"FSDP2 {q:.2f} GiB: **{'met' if p <= q else 'missed'}** ({p - q:+.2f} GiB)")
        L = fsdp2["layers"]
        if ours.get("gib_per_layer") is not None and L != common[-1] and fsdp2.get("peak_gib") is not None:
            p = ours["gib_fixed"] + ours["gib_per_layer"] * L
            q = fsdp2["peak_gib"]
            out.append(f"- at FSDP2's largest L = {L}: ours {p:.2f} GiB by its peak fit vs FSDP2 {q:.2f} GiB "
                       f"measured ({p - q:+.2f} GiB)")
    return out


def results_markdown(meta: Dict[str, Any], rows: List[Dict[str, Any]], current: Optional[Dict[str, Any]] = None) -> str:
    mode = (f"fake process group, rank 0 of {meta['world']} (collectives are no-ops)" if meta["fake"]
            else f"{meta['real_world']} process(es), {meta['backend']}")
    mem = (f"device memory {meta['total_gib']:.1f} GiB; allocatable at start {meta['usable_gib']:.1f} GiB; "
           f"prediction target = allocatable - margin {meta['margin_gib']:.1f} = {meta['capacity_gib']:.1f} GiB"
           if meta.get("capacity_gib") is not None else "no memory readings (CPU): probe sizes only")
    out = [
        f"### Largest GPT that trains, models built on the meta device: hidden {meta['hidden']}, "
        f"{meta['heads']} heads, ffn {meta['ffn']}, seq {meta['seq']}, micro-batch {meta['micro_batch']}, "
        f"vocab {meta['vocab']}, {meta['params_per_layer'] / 1e6:.1f}M params/layer + {meta['params_base'] / 1e6:.1f}M",
        "",
        f"- mode: {mode}; device: {meta['device_name']}",
        f"- torch {meta['torch']}, megatron-core {meta['megatron_core']}, python {meta['python']}; {meta['date']}"
        f"; PYTORCH_CUDA_ALLOC_CONF={meta['alloc_conf'] or '(unset)'}",
        f"- command: `{meta['command']}`",
        f"- recompute: {meta['recompute']}; step = forward + backward + optimizer step + zero_grad; each run "
        f"{meta['warmup']} warm-up + {meta['steps']} timed steps; tokens/s = {meta['micro_batch']}x{meta['seq']}"
        f"{'x' + str(meta['real_world']) if meta['real_world'] > 1 else ''} / median timed step",
        f"- search: probes at L = {meta['layers_probe']}, linear fit of the peak in L, then runs until L trains and "
        f"L+1 runs out of memory (at most {meta['max_attempts']} runs after the probes); {mem}",
        "- peak = torch.cuda.max_memory_allocated over the run's steps (absolute: includes the token batch and "
        "Megatron's shared attention-score buffer); peak reserved = torch.cuda.max_memory_reserved over the same "
        "steps (what the caching allocator held, fragmentation included; ours and FSDP2 only); with several ranks "
        "the largest over ranks; peak fit = the line through the peaks of the two largest L that trained; "
        "an OOM run shows the memory reserved but unallocated at the failed allocation",
        "",
        "| system | N | status | largest L that trained | params | peak GiB | peak reserved GiB | tokens/s | step ms | "
        "OOM at L | peak fit GiB | runs (L: outcome, peak GiB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r.get('error') or ''}"
        status = status.replace("|", "/").replace("\n", " ")
        params = f"{r['params']:,} ({r['params'] / 1e9:.2f}B)" if r.get("params") else "-"
        out.append(f"| {r['name']} | {r['world']} | {status} | {_fmt(r.get('layers'), 'd')} | {params} | "
                   f"{_fmt(r.get('peak_gib'))} | {_fmt(r.get('peak_reserved_gib'))} | "
                   f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('step_ms'), '.0f')} | "
                   f"{_fmt(r.get('oom_layers'), 'd')} | {_fit_cell(r)} | {_attempts_cell(r, current)} |")
    if current and current["system"] not in {r["name"] for r in rows}:
        out.append(f"| {current['system']} | {meta['world']} | running | - | - | - | - | - | - | - | - | "
                   f"{current['layers']}: running (no result yet) |")
    out.append("")
    goals = goal_lines(rows)
    if goals:
        out += goals + [""]
    out += ["Systems:", ""] + [f"- {r['name']}: {r['description']}" for r in rows] + [""]
    out += notes_markdown(rows, meta)
    return "\n".join(out)


# =============================================================================================
# Main
# =============================================================================================


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (the number of layers is what the search varies)")
    add_model_arguments(g, dict(hidden=4096, heads=32, seq=4096, micro_batch=1, vocab=32000),
                        "dry-run preset: hidden 256, 4 heads, seq 256, micro-batch 2, vocab 4096 (explicit flags "
                        "still win)")
    g.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="no activation recompute (default: full recompute, uniform, 1 layer per unit)")
    g = p.add_argument_group("search")
    g.add_argument("--systems", default="all", help="'all' (default) or a comma list of: ours, fsdp2, megatron_fsdp, "
                   "ours-offload<f> (one per --offload-fractions value)")
    g.add_argument("--offload-fractions", default="", help="comma list of fractions f: adds ours-offload<f>, ours "
                   "ZeRO-3 with OffloadPolicy(fraction=f) (host memory checked before each run; default none)")
    g.add_argument("--layers-probe", default="2,4", help="layer counts trained first, ascending; the fit uses the "
                   "two largest that trained (default 2,4)")
    g.add_argument("--max-attempts", type=int, default=8, help="runs per system after the probes (default 8)")
    g.add_argument("--max-layers", type=int, default=512, help="never try more layers than this (default 512)")
    g.add_argument("--margin-gib", type=float, default=2.0, help="GiB kept free in the prediction, for what "
                   "max_memory_allocated does not see (fragmentation, NCCL, workspaces) (default 2)")
    g.add_argument("--steps", type=int, default=2, help="timed steps per run (default 2)")
    g.add_argument("--warmup", type=int, default=1, help="untimed steps per run, >= 1 (default 1)")
    g.add_argument("--time-budget", type=float, default=0.0, help="seconds since start after which no new run starts "
                   "(default 0 = none)")
    g.add_argument("--attempt-timeout", type=float, default=300.0, help="at most this many seconds for a run "
                   "(2x the estimate from the largest L that trained, at least 30 s); a run without a result in "
                   "time ends the processes (default 300)")
    g.add_argument("--max-restarts", type=int, default=4, help="--nproc: start the processes again this many times "
                   "at most after they ended during a run (default 4)")
    g.add_argument("--state", default=None, help=argparse.SUPPRESS)   # launch_workers' state file
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda; cpu: dry run on gloo "
                   "(probe sizes only, Megatron-FSDP skipped)")
    g.add_argument("--nproc", type=int, default=1, help="GPUs: run under torchrun --nproc-per-node N, started "
                   "again after a run that hangs (default 1)")
    g.add_argument("--fake-world-size", type=int, default=0, help="rank 0 of an N-way job on torch's fake process "
                   "group (per-rank memory on one GPU; default 0 = off)")
    g.add_argument("--lr", type=float, default=1e-5, help="learning rate (default 1e-5)")
    g.add_argument("--megatron-adam", choices=("fused", "default"), default="fused",
                   help="Megatron-FSDP's torch AdamW fallback kernel (default fused, as the others)")
    g.add_argument("--cpu-fused-adam", action="store_true", help="use fused AdamW on CPU too")
    g.add_argument("--verbose", action="store_true", help="keep Megatron's log messages and warnings")
    g = p.add_argument_group("output (rank 0 only)")
    g.add_argument("--out", default=None, help="markdown (default benchmarks/results/<today>/largest<SUFFIX>.md, "
                   "SUFFIX = _<N>gpu / _fake<N> / _cpu<N>; '' = do not write)")
    g.add_argument("--json", default=None, help="JSON (default: the same name, .json; '' = do not write)")
    args = p.parse_args(argv)

    small = dict(hidden=256, heads=4, seq=256, micro_batch=2, vocab=4096)
    full = dict(hidden=4096, heads=32, seq=4096, micro_batch=1, vocab=32000)
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.layers_probe = [int(x) for x in args.layers_probe.split(",") if x.strip()]
    except ValueError:
        p.error("--layers-probe: a comma list of layer counts, e.g. 2,4")
    if not args.layers_probe or args.layers_probe != sorted(set(args.layers_probe)) or args.layers_probe[0] < 1:
        p.error("--layers-probe: distinct positive layer counts in ascending order")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the peak is read over both)")
    if args.hidden % args.heads:
        p.error("--hidden must be divisible by --heads")
    # read by bench_setup / bench_systems
    args.layers, args.skip_init, args.meta_init = args.layers_probe[0], False, True
    suffix = (f"_fake{args.fake_world_size}" if args.fake_world_size
              else f"_cpu{args.nproc}" if args.device == "cpu" else f"_{args.nproc}gpu")
    stem = RESULTS / datetime.date.today().isoformat() / f"largest{suffix}"
    if args.out is None:
        args.out = str(stem.with_suffix(".md"))
    if args.json is None:
        args.json = str(Path(args.out).with_suffix(".json")) if args.out else str(stem.with_suffix(".json"))
    return args


def command_line() -> str:
    return " ".join(["python", *map(shlex.quote, sys.argv)])


def launch_workers(args) -> int:
    """``--nproc N``: run this script under torchrun (N processes, without ``--nproc``, its own
    option there). When the processes end during a training run (one rank out of memory while
    another waits for it in a collective never returns), start them again, at most
    ``--max-restarts`` times: they resume the search from the state file (``Run``)."""
    if args.fake_world_size:
        raise SystemExit("--nproc and --fake-world-size are exclusive.")
    argv = sys.argv[1:]
    drop = {i for i, arg in enumerate(argv) if arg == "--nproc" or arg.startswith("--nproc=")}
    drop |= {i + 1 for i in drop if argv[i] == "--nproc"}
    fd, state = tempfile.mkstemp(prefix="bench_largest_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), *[arg for i, arg in enumerate(argv) if i not in drop], "--state", state]
    env = dict(os.environ, BENCH_LARGEST_START=str(START), BENCH_LARGEST_COMMAND=command_line())
    try:
        before = None
        for launch in range(args.max_restarts + 1):
            print(("launching: " if launch == 0 else f"restart {launch}: ") + shlex.join(cmd), flush=True)
            rc = subprocess.call(cmd, env=env)
            after = _read_json(state) or {}
            running = after.get("running")
            if rc == 0 or not running or after == before:     # done, failed outside a run, or no progress
                return rc
            before = after
            print(f"the processes ended (exit {rc}) during {running['system']} at L={running['layers']}", flush=True)
        print(f"--max-restarts {args.max_restarts} used up; results so far in {args.out or args.json}", flush=True)
        return rc
    finally:
        os.unlink(state)


def run_meta(ctx: Ctx, counter: Callable[[int], int]) -> Dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    a = ctx.args
    try:
        mcore = version("megatron-core")
    except PackageNotFoundError:
        mcore = "?"
    base = counter(0)
    return dict(
        hidden=a.hidden, heads=a.heads, ffn=a.ffn or 4 * a.hidden, seq=a.seq, micro_batch=a.micro_batch,
        vocab=a.vocab, params_base=base, params_per_layer=counter(1) - base,
        recompute=(", ".join(f"{k}={v!r}" for k, v in FULL_RECOMPUTE.items()) if a.recompute else "off"),
        steps=a.steps, warmup=a.warmup, layers_probe=a.layers_probe, max_attempts=a.max_attempts,
        margin_gib=a.margin_gib, world=ctx.world, real_world=ctx.real_world, fake=ctx.fake,
        backend=dist.get_backend(), device=str(ctx.device),
        device_name=torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else platform.processor() or "cpu",
        torch=torch.__version__, megatron_core=mcore, python=platform.python_version(),
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        command=os.environ.get("BENCH_LARGEST_COMMAND") or command_line(), notes=[],
    )


def memory_capacity(ctx: Ctx, meta: Dict[str, Any]) -> Optional[float]:
    """GiB that max_memory_allocated can reach: what is allocated now plus what the device has
    free (after the NCCL communicators exist), minus the margin."""
    if not ctx.is_cuda:
        return None
    if ctx.real_world > 1:
        dist.all_reduce(torch.ones(1, device=ctx.device))     # create the communicator first
    cleanup(ctx)
    free, total = torch.cuda.mem_get_info(ctx.device)
    usable = (free + torch.cuda.memory_allocated(ctx.device)) / GIB
    meta.update(total_gib=total / GIB, usable_gib=usable, capacity_gib=usable - ctx.args.margin_gib)
    return meta["capacity_gib"]


def report_live_at_out_of_memory(top: int = 12) -> None:
    """``BENCH_OOM_LIVE=1``: record the allocator's history and, at each CUDA out-of-memory, print
    what was live by owner (peak_breakdown.py's attribution) with a short stack: which part of a
    run fills the device (the build, a step, a transfer's temporaries) when it does not fit."""
    import peak_breakdown as P
    torch.cuda.memory._record_memory_history(max_entries=200_000)

    def observer(device, alloc, device_allocated, device_free):
        by_label: Dict[str, list] = {}
        for block in P.device_blocks(torch.cuda.memory._snapshot(), device):
            frames = (block.get("frames") or [])
            _, label = P.categorize(frames)
            python_frames = [f for f in frames if P._fname(f).endswith(".py")]
            entry = by_label.setdefault(label, [0, 0, P.short_stack(python_frames, 6)])
            entry[0] += P._block_bytes(block)
            entry[1] += 1
        print(f"[out of memory] asked for {alloc / 2**20:.0f} MiB with {device_allocated / GIB:.2f} GiB allocated; "
              "live by owner:", flush=True)
        for label, (size, count, stack) in sorted(by_label.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {size / GIB:8.2f} GiB  {count:6d}  {label}  {' < '.join(stack)}", flush=True)

    torch._C._cuda_attach_out_of_memory_observer(observer)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch_workers(args)
    quiet_libraries(args.verbose)
    systems = select(args.systems, tuple(float(t) for t in args.offload_fractions.split(",") if t.strip()))
    ctx = init_distributed(args)
    with contextlib.ExitStack() as stack:
        prepare_process(ctx, stack)
        if os.environ.get("BENCH_OOM_LIVE") == "1" and ctx.device.type == "cuda":
            report_live_at_out_of_memory()
        counter = param_counter(ctx)
        meta = run_meta(ctx, counter)
        meta["systems"] = [s.name for s in systems]
        memory_capacity(ctx, meta)
        run = Run(ctx, meta)               # after a restart: the capacity of the first launch
        capacity = meta.get("capacity_gib")
        ctx.log(f"largest GPT per system: {meta['params_per_layer'] / 1e6:.1f}M params/layer; world {ctx.world}"
                f"{' (fake)' if ctx.fake else ''}; device {meta['device_name']}"
                + (f"; target peak {capacity:.1f} GiB" if capacity is not None else ""))
        for system in systems:
            ctx.log(f"--> {system.name}: {system.description}")
            row = search(run, system, counter, capacity)
            ctx.log(f"    {system.name}: {row['status']}, largest L = {row.get('layers')}, "
                    f"OOM at L = {row.get('oom_layers')}"
                    + (f"  ({row['error']})" if row.get("error") else ""))
            run.write()
        meta["wall_s"] = elapsed()
        run.write(final=True)
        ctx.log(f"process {meta['wall_s']:.0f} s")

    finish_process()
    return 0


if __name__ == "__main__":
    sys.exit(main())
