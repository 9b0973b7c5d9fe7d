#!/usr/bin/env python3
"""What is live at the peak of one training step: ours (ZeRO-3) against torch FSDP2, from the CUDA
caching allocator's memory history.

    python3 benchmarks/peak_breakdown.py --out $OUT/peak_1gpu.md --json $OUT/peak_1gpu.json
    python3 benchmarks/peak_breakdown.py --fake-world-size 8 --out $OUT/peak_fake8.md --json $OUT/peak_fake8.json
    python3 benchmarks/peak_breakdown.py --small --save-snapshots $OUT/snapshots   # + raw snapshots
    python benchmarks/peak_breakdown.py --device cpu --small     # CPU: plumbing run only, no history

Per system (bench_gpt.py's builders and ``--systems`` names; default ours ZeRO-3 with the
storage_freeing allocator and FSDP2 ZeRO-3): build, ``--warmup`` steps, then ONE step as
bench_gpt.py runs it (forward + loss + backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``) with ``torch.cuda.memory._record_memory_history`` on, and
``torch.cuda.memory._snapshot()`` taken just before and just after it. ``analyze_step`` (pure
Python, no torch) replays the step's alloc/free events on top of the blocks live when the step began
(a snapshot taken just before it), finds the event at which the live bytes peak, and groups what is
live there by the first stack frame that names an owner: ``megatron_fsdp_v2/`` (ours; its
``allocators/`` give way to their caller), ``torch/distributed/fsdp/`` (FSDP2), ``torch/optim/``,
``megatron/core/``; else autograd (allocations on the autograd thread have no Python frames) or the
innermost user frame. Each group is split by origin: ``held`` (live when the step began: weights,
grads, optimizer state, the batch) and ``step`` (allocated during the step). The phase of the peak
comes from marker allocations (``_phase_marker``) made between forward, backward (a forward hook on
the root module), optimizer step and zero_grad.

Recording starts at process start (``--record-from start``, default) so that the blocks built
before the traced step carry the stack that allocated them; ``--record-from step`` records the
traced step only (held blocks then have no stack). Sizes are the bytes requested (the trace holds
no block sizes): the replayed peak is checked against ``memory_stats()['requested_bytes.all.peak']``;
``max_memory_allocated`` (rounded blocks) is reported beside it.

Every model flag of bench_gpt.py (``--small``, ``--layers``, ``--hidden``, ``--seq``, ``--micro-batch``,
``--vocab``, ``--skip-init``, ``--device``, ``--fake-world-size``, ``--lr``, ...) is accepted as there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
GIB = float(1 << 30)

DEFAULT_SYSTEMS = "ours-optim_grads_params-sf,fsdp2-zero3"

#: Phases of a step, in order. Marker k (a ``_phase_marker`` allocation of (k + 1) x 512 bytes)
#: is made when phase k begins; "backward" begins at the root module's forward hook.
PHASES = ("forward", "backward", "optimizer.step", "zero_grad", "end")
MARKER_FUNCTION = "_phase_marker"
MARKER_UNIT = 512

#: (group, path fragment): the first frame, innermost first, that holds a fragment names the owner.
OWNER_RULES = (
    ("ours", "megatron_fsdp_v2/"),
    ("fsdp2", "torch/distributed/fsdp/"),
    ("optimizer", "torch/optim/"),
    ("megatron", "megatron/core/"),
)
#: Owner frames passed over for an outer frame of the same owner (ours' buffer allocators: the
#: caller, e.g. ``param_group.py:unshard``, says what the buffer is for).
PASS_OVER = ("megatron_fsdp_v2/allocators/",)
#: Frames that say nothing about who allocated (wrappers every call goes through).
NOISE = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "torch/_compile.py",
         "torch/_dynamo/", "<frozen ")


# =============================================================================================
# Analysis of a snapshot (pure Python: unit-tested without torch's CUDA or Megatron)
# =============================================================================================


def _fname(frame: Dict[str, Any]) -> str:
    return str(frame.get("filename", "")).replace("\\", "/")


def _where(frame: Dict[str, Any]) -> str:
    return f"{os.path.basename(_fname(frame))}:{frame.get('name', '?')}"


def _is_noise(frame: Dict[str, Any]) -> bool:
    name = _fname(frame)
    return any(n in name for n in NOISE)


def categorize(frames: Sequence[Dict[str, Any]], origin: str = "step") -> Tuple[str, str]:
    """(group, label) of an allocation from its stack (innermost frame first, as torch records it).

    ``origin`` ("held": live when the step began, or "step") only names stackless allocations:
    during the step these are the autograd engine's (its thread has no Python frames); held ones
    were allocated before recording started."""
    frames = list(frames or ())
    for i, frame in enumerate(frames):
        fn = _fname(frame)
        for group, fragment in OWNER_RULES:
            if fragment in fn:
                if any(p in fn for p in PASS_OVER):
                    outer = next((f for f in frames[i + 1:] if fragment in _fname(f)
                                  and not any(p in _fname(f) for p in PASS_OVER)), None)
                    frame = outer or frame
                return group, f"{group} {_where(frame)}"
    if not frames:
        if origin == "step":
            return "autograd", "autograd engine (no Python frames)"
        return "unknown", "no stack (allocated before recording)"
    if any("torch/autograd/" in _fname(f) for f in frames):
        return "autograd", "autograd (backward, Python caller)"
    for frame in frames:                              # innermost frame outside torch and the stdlib
        fn = _fname(frame)
        if not _is_noise(frame) and "/torch/" not in fn and "/lib/python" not in fn and not fn.startswith("<"):
            return "user", f"user {_where(frame)}"
    inner = next((f for f in frames if not _is_noise(f)), frames[0])
    return "other", f"other {_where(inner)}"


def short_stack(frames: Sequence[Dict[str, Any]], n: int = 4) -> List[str]:
    """The ``n`` innermost informative frames as ``file.py:line:function``."""
    out = []
    for frame in frames or ():
        if _is_noise(frame):
            continue
        out.append(f"{os.path.basename(_fname(frame))}:{frame.get('line', '?')}:{frame.get('name', '?')}")
        if len(out) == n:
            break
    return out


def marker_phase(event: Dict[str, Any]) -> Optional[str]:
    """The phase a ``_phase_marker`` allocation opens, or None if ``event`` is no marker."""
    if event.get("action") != "alloc":
        return None
    if not any(f.get("name") == MARKER_FUNCTION for f in event.get("frames") or ()):
        return None
    k = int(round(event.get("size", 0) / MARKER_UNIT)) - 1
    return PHASES[k] if 0 <= k < len(PHASES) else None


def infer_phase(frames: Sequence[Dict[str, Any]]) -> str:
    """A guess from one allocation's stack, when the trace has no markers."""
    group, _ = categorize(frames)
    names = {f.get("name") for f in frames or ()}
    if group == "optimizer" or "step" in names:
        return "optimizer.step (from its stack)"
    if group == "autograd" or "backward" in names or any("backward" in str(n) for n in names):
        return "backward (from its stack)"
    return "forward (from its stack)"


def device_blocks(snapshot: Dict[str, Any], device: int = 0) -> List[Dict[str, Any]]:
    """The snapshot's blocks in use by tensors (state ``active_allocated``) on ``device``."""
    out = []
    for seg in snapshot.get("segments", ()):
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", ()):
            if block.get("state") == "active_allocated":
                out.append(block)
    return out


def _block_bytes(block: Dict[str, Any]) -> int:
    return int(block.get("requested_size", block.get("size", 0)))


class _Live:
    """An allocation live during the replay."""

    __slots__ = ("size", "frames", "origin", "index")

    def __init__(self, size: int, frames, origin: str, index: int):
        self.size, self.frames, self.origin, self.index = size, frames or [], origin, index


def analyze_step(snapshot: Dict[str, Any], *, device: int = 0,
                 start_blocks: Optional[Iterable[Dict[str, Any]]] = None,
                 baseline_bytes: Optional[int] = None, top: int = 15) -> Dict[str, Any]:
    """Replay the traced step of ``snapshot`` and break down what is live at its peak.

    - The step begins at the last "forward" marker of ``snapshot['device_traces'][device]`` (the
      whole trace if there is none).
    - What was live when it began: ``start_blocks`` (the ``active_allocated`` blocks of a snapshot
      taken just before the step, with the stacks that allocated them) if given; else the blocks
      still live in ``snapshot`` that the step did not allocate, plus the blocks the step freed
      without having allocated them (stack: the earlier trace, else none).
    - ``baseline_bytes`` (``requested_bytes.all.current`` when the step began): what it holds
      beyond those blocks is counted as "unattributed".
    Sizes are the requested bytes the trace records."""
    traces = snapshot.get("device_traces") or []
    trace = list(traces[device]) if device < len(traces) else []
    warnings: List[str] = []

    starts = [i for i, e in enumerate(trace) if marker_phase(e) == PHASES[0]]
    begin = starts[-1] if starts else 0
    if not starts:
        warnings.append("no phase markers in the trace: the whole trace is taken as the step")
    window = trace[begin:]

    # Allocations traced before the step began and still live then: their stacks, by address.
    earlier: Dict[int, Any] = {}
    for e in trace[:begin]:
        if e.get("action") == "alloc":
            earlier[e["addr"]] = e.get("frames") or []
        elif e.get("action") in ("free_requested", "free_completed"):
            earlier.pop(e.get("addr"), None)

    held: Dict[int, _Live] = {}
    if start_blocks is not None:
        for b in start_blocks:
            if b.get("state", "active_allocated") == "active_allocated":
                held[b["address"]] = _Live(_block_bytes(b), b.get("frames"), "held", -1)
    else:
        live_end, allocated, unknown_frees = set(), set(), {}
        for e in window:
            action, addr = e.get("action"), e.get("addr")
            if action == "alloc":
                live_end.add(addr)
                allocated.add(addr)
            elif action in ("free_requested", "free_completed"):
                live_end.discard(addr)
                # Freed, never allocated in the step: live when it began (a free_completed alone
                # may end a free requested before the step).
                if action == "free_requested" and addr not in allocated and addr not in unknown_frees:
                    unknown_frees[addr] = e
        for b in device_blocks(snapshot, device):
            if b["address"] not in live_end:
                held[b["address"]] = _Live(_block_bytes(b), b.get("frames"), "held", -1)
        for addr, e in unknown_frees.items():
            if addr not in held:
                held[addr] = _Live(int(e.get("size", 0)), earlier.get(addr, []), "held", -1)

    held_bytes = sum(a.size for a in held.values())
    unattributed = 0
    if baseline_bytes is not None:
        unattributed = int(baseline_bytes) - held_bytes
        if unattributed < 0:
            warnings.append(f"blocks live at the start hold {-unattributed} B more than baseline_bytes")
            unattributed = 0
    start_bytes = held_bytes + unattributed

    def replay(stop: Optional[int] = None):
        """Replay the window (up to and including event ``stop``); returns what the caller needs."""
        live = dict(held)
        current = start_bytes
        peak, peak_at = current, -1
        phase, phase_peaks, phase_at = "start", {}, {}
        double_allocs = unknown = 0
        for i, e in enumerate(window):
            if stop is not None and i > stop:
                break
            action, addr = e.get("action"), e.get("addr")
            if action == "alloc":
                p = marker_phase(e)
                if p is not None:
                    phase = p
                    phase_at[p] = i
                old = live.pop(addr, None)
                if old is not None:                      # its free was not recorded
                    current -= old.size
                    double_allocs += 1
                size = int(e.get("size", 0))
                live[addr] = _Live(size, e.get("frames"), "step", i)
                current += size
                if current > peak:
                    peak, peak_at = current, i
            elif action == "free_requested" or action == "free_completed":
                old = live.pop(addr, None)
                if old is not None:
                    current -= old.size
                elif action == "free_requested":
                    unknown += 1
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), current)
        return live, current, peak, peak_at, phase_peaks, phase_at, double_allocs, unknown

    _, end_bytes, peak, peak_at, phase_peaks, phase_at, double_allocs, unknown = replay()
    if double_allocs:
        warnings.append(f"{double_allocs} allocation(s) at an address already live (missed frees)")
    if unknown:
        warnings.append(f"{unknown} free(s) of an address not known to be live")
    live = replay(stop=peak_at)[0] if peak_at >= 0 else dict(held)

    # Phase of the peak: the last marker at or before it.
    phase_at_peak = "start"
    for p, i in sorted(phase_at.items(), key=lambda kv: kv[1]):
        if i <= peak_at:
            phase_at_peak = p
    peak_event = window[peak_at] if peak_at >= 0 else None
    if not phase_at and peak_event is not None:
        phase_at_peak = infer_phase(peak_event.get("frames") or [])

    cats: Dict[Tuple[str, str, str], List[int]] = defaultdict(lambda: [0, 0])
    for a in live.values():
        group, label = categorize(a.frames, a.origin)
        c = cats[(a.origin, group, label)]
        c[0] += 1
        c[1] += a.size
    if unattributed:
        cats[("held", "unknown", "unattributed (live before the step, no block)")] = [1, unattributed]
    categories = [dict(origin=o, group=g, label=l, count=c[0], bytes=c[1]) for (o, g, l), c in cats.items()]
    categories.sort(key=lambda c: -c["bytes"])
    groups: Dict[str, int] = defaultdict(int)
    for c in categories:
        groups[f"{c['origin']}: {c['group']}"] += c["bytes"]

    biggest = sorted(live.values(), key=lambda a: -a.size)[:top]
    top_allocations = [dict(bytes=a.size, origin=a.origin, label=categorize(a.frames, a.origin)[1],
                            stack=short_stack(a.frames)) for a in biggest]

    # Check: the replay's end state against the blocks live in the (end) snapshot.
    end_blocks = device_blocks(snapshot, device)
    end_check = sum(_block_bytes(b) for b in end_blocks) + unattributed if end_blocks else None
    if end_check is not None and end_check != end_bytes:
        warnings.append(f"replay ends at {end_bytes} B, the snapshot's live blocks hold {end_check} B")

    return dict(
        events=len(window), trace_events=len(trace), start_bytes=start_bytes, unattributed_bytes=unattributed,
        peak_bytes=peak, peak_event=peak_at, end_bytes=end_bytes, end_check_bytes=end_check,
        phase_at_peak=phase_at_peak, phase_peaks=dict(phase_peaks),
        peak_alloc=(dict(bytes=int(peak_event.get("size", 0)), label=categorize(peak_event.get("frames") or [])[1],
                         stack=short_stack(peak_event.get("frames") or []))
                    if peak_event is not None else None),
        held_at_peak=sum(c["bytes"] for c in categories if c["origin"] == "held"),
        step_at_peak=sum(c["bytes"] for c in categories if c["origin"] == "step"),
        categories=categories, groups=dict(groups), top_allocations=top_allocations, warnings=warnings,
    )


# =============================================================================================
# Reporting
# =============================================================================================


def _gib(b: Optional[float], spec: str = ".3f") -> str:
    return "-" if b is None else format(b / GIB, spec)


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def system_markdown(res: Dict[str, Any], top: int = 12) -> str:
    out = [f"### {res['name']}: {res.get('description', '')}", ""]
    if res.get("status") != "ok":
        return "\n".join(out + [f"- **{res.get('status')}**: {_cell(res.get('error') or '')}", ""])
    a = res.get("analysis")
    if a is None:
        return "\n".join(out + [f"- {res.get('note', 'no memory history')}", ""])
    req_peak = res.get("requested_peak_bytes")
    gap = f"{(a['peak_bytes'] - req_peak) / 2**20:+.1f}" if req_peak is not None else "-"
    out += [
        f"- peak (replay of {a['events']} events, requested bytes): **{_gib(a['peak_bytes'])} GiB** during "
        f"**{a['phase_at_peak']}** (event {a['peak_event']}); torch requested_bytes peak {_gib(req_peak)} GiB "
        f"(replay - torch = {gap} MiB); "
        f"max_memory_allocated {_gib(res.get('max_allocated_bytes'))} GiB (rounded blocks)",
        f"- live when the step began: {_gib(a['start_bytes'])} GiB"
        + (f" ({_gib(a['unattributed_bytes'])} GiB of it unattributed)" if a["unattributed_bytes"] else "")
        + f"; at the peak: held {_gib(a['held_at_peak'])} GiB + allocated in the step {_gib(a['step_at_peak'])} GiB; "
        f"after the step {_gib(a['end_bytes'])} GiB",
        "- highest live bytes per phase: " + ", ".join(f"{p} {_gib(b)}" for p, b in a["phase_peaks"].items()) + " GiB",
    ]
    if a.get("peak_alloc"):
        pa = a["peak_alloc"]
        out.append(f"- the allocation that reached the peak: {pa['bytes'] / 2**20:.1f} MiB, {_cell(pa['label'])} "
                   f"(`{' < '.join(pa['stack'])}`)")
    if res.get("step_s") is not None:
        out.append(f"- traced step {res['step_s']:.2f} s; build + warm-up {res.get('build_warmup_s', 0):.1f} s")
    for w in a.get("warnings", []):
        out.append(f"- warning: {_cell(w)}")
    out += ["", "| origin | what (first owning frame) | count | GiB at peak |", "|---|---|---:|---:|"]
    for c in a["categories"][:top]:
        out.append(f"| {c['origin']} | {_cell(c['label'])} | {c['count']} | {_gib(c['bytes'])} |")
    rest = a["categories"][top:]
    if rest:
        out.append(f"| | {len(rest)} more | {sum(c['count'] for c in rest)} | "
                   f"{_gib(sum(c['bytes'] for c in rest))} |")
    out += ["", "Largest single allocations live at the peak:", "",
            "| MiB | origin | what | stack (innermost first) |", "|---:|---|---|---|"]
    for t in a["top_allocations"][:8]:
        where = " < ".join(t["stack"]) or "(none)"
        out.append(f"| {t['bytes'] / 2**20:.1f} | {t['origin']} | {_cell(t['label'])} | `{where}` |")
    return "\n".join(out + [""])


def comparison_markdown(results: List[Dict[str, Any]], top: int = 25) -> str:
    """Side by side, GiB live at each system's peak: by origin and owner, then by category."""
    done = [r for r in results if r.get("analysis")]
    if len(done) < 2:
        return ""
    names = [r["name"] for r in done]
    ref = names[-1]                     # the last system (FSDP2 in bench_gpt.py's order) is the reference
    head = "| | " + " | ".join(names) + " | " + " | ".join(f"{n} - {ref}" for n in names[:-1]) + " |"
    rule = "|---|" + "---:|" * (2 * len(names) - 1)

    def line(k, vals, bold=False):
        fmt = (lambda t: f"**{t}**") if bold else (lambda t: t)
        return (f"| {fmt(_cell(k))} | " + " | ".join(fmt(_gib(v)) for v in vals) + " | "
                + " | ".join(fmt(f"{(v - vals[-1]) / GIB:+.3f}") for v in vals[:-1]) + " |")

    def rows(key_of, keys):
        return [line(k, [key_of(r, k) for r in done]) for k in keys]

    def group_bytes(r, k):
        return r["analysis"]["groups"].get(k, 0)

    groups = sorted({k for r in done for k in r["analysis"]["groups"]},
                    key=lambda k: -max(group_bytes(r, k) for r in done))
    out = ["### Side by side: GiB live at each system's peak", "",
           "By origin (held = live when the step began; step = allocated during it) and owner:", "",
           head, rule]
    out += rows(group_bytes, groups)
    out.append(line("peak", [r["analysis"]["peak_bytes"] for r in done], bold=True))
    out.append("| phase at peak | " + " | ".join(r["analysis"]["phase_at_peak"] for r in done)
               + " |" * len(names))
    out.append("")
    for r in done[:-1]:
        deltas = sorted(((group_bytes(r, k) - group_bytes(done[-1], k), k) for k in groups), reverse=True)
        more = [f"{k} {d / GIB:+.3f}" for d, k in deltas if d > 0][:4]
        if more:
            out.append(f"- {r['name']} holds more than {ref} at its peak in: " + "; ".join(more) + " GiB.")

    def cat_bytes(r, k):
        return sum(c["bytes"] for c in r["analysis"]["categories"] if f"{c['origin']}: {c['label']}" == k)

    cats = {f"{c['origin']}: {c['label']}" for r in done for c in r["analysis"]["categories"]}
    cats = sorted(cats, key=lambda k: -max(cat_bytes(r, k) for r in done))[:top]
    out += ["", f"By category (top {top}; the systems' own code has different frames, so compare by owner above):",
            "", head, rule]
    out += rows(cat_bytes, cats)
    return "\n".join(out + [""])


def report_markdown(meta: Dict[str, Any], results: List[Dict[str, Any]]) -> str:
    mode = (f"fake process group, rank 0 of {meta['world']}" if meta.get("fake")
            else f"{meta.get('world', 1)} process(es)")
    out = [f"## Peak breakdown: GPTModel {meta.get('num_params', 0) / 1e6:.1f}M params, {meta.get('layers')} layers, "
           f"hidden {meta.get('hidden')}, seq {meta.get('seq')}, micro-batch {meta.get('micro_batch')}, "
           f"vocab {meta.get('vocab')}", "",
           f"- mode: {mode}; device: {meta.get('device_name')}; torch {meta.get('torch')}; {meta.get('date')}",
           f"- command: `{meta.get('command')}`",
           f"- one traced step (forward + backward, optimizer.step, zero_grad) after {meta.get('warmup')} warm-up "
           f"steps; memory history recorded from {meta.get('record_from')}; sizes are requested bytes", ""]
    for note in meta.get("notes", []):
        out.append(f"- {note}")
    out.append("")
    out += [system_markdown(r) for r in results]
    comp = comparison_markdown(results)
    if comp:
        out.append(comp)
    return "\n".join(out)


# =============================================================================================
# Running the systems (torch, Megatron and bench_gpt.py imported here only)
# =============================================================================================


def _phase_marker(phase: str, device) -> None:
    """A short-lived allocation whose size names ``phase`` (see PHASES), found in the trace by
    this function's name."""
    import torch

    t = torch.empty(MARKER_UNIT * (PHASES.index(phase) + 1), dtype=torch.uint8, device=device)
    del t


def _record_history(enabled: Optional[str], max_entries: int, clear: bool = False) -> None:
    import torch

    rec = torch.cuda.memory._record_memory_history
    if enabled is None:
        rec(enabled=None)
        return
    try:
        rec(enabled=enabled, context="all", stacks="python", max_entries=max_entries, clear_history=clear)
    except TypeError:                           # an older signature: no clear_history
        rec(enabled=enabled, context="all", stacks="python", max_entries=max_entries)


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def run_system(B, ctx, system, opts) -> Dict[str, Any]:
    """Build ``system``, warm up, trace one step and analyze it (bench_gpt.py's builders)."""
    import torch

    res: Dict[str, Any] = dict(name=system.name, description=system.description, status="ok", error=None)
    if system.cuda_only and not ctx.is_cuda:
        res.update(status="skipped", error="CUDA-only (Megatron DDP/FSDP); skipped on CPU")
        return res
    B.cleanup(ctx)
    built = hook = snap = start_snap = None
    dev = ctx.device
    try:
        t0 = time.perf_counter()
        built = B.BUILDERS[system.kind](ctx, system)
        for _ in range(opts.warmup):
            built.fwd_bwd()
            built.opt_step()
            built.zero_grad()
        B.sync(ctx)
        res["build_warmup_s"] = time.perf_counter() - t0
        root = built.keep[0] if built.keep else None
        if isinstance(root, torch.nn.Module):
            hook = root.register_forward_hook(lambda *_: _phase_marker("backward", dev))
        else:
            res.setdefault("notes", []).append("no nn.Module to hook: forward and backward share one phase")

        if ctx.is_cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            _record_history("all", opts.max_entries, clear=True)   # (re)start with an empty trace
            start_snap = torch.cuda.memory._snapshot()
            baseline = torch.cuda.memory_stats(dev).get("requested_bytes.all.current")
            res["start_allocated_bytes"] = torch.cuda.memory_allocated(dev)
        t1 = time.perf_counter()
        _phase_marker("forward", dev)
        loss = built.fwd_bwd()
        _phase_marker("optimizer.step", dev)
        built.opt_step()
        _phase_marker("zero_grad", dev)
        built.zero_grad()
        _phase_marker("end", dev)
        B.sync(ctx)
        res["step_s"] = time.perf_counter() - t1
        res["loss"] = float(loss)
        del loss
        if not ctx.is_cuda:
            res["note"] = "CPU: no CUDA memory history; plumbing run of one step only"
            return res

        stats = torch.cuda.memory_stats(dev)
        res["max_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        res["requested_peak_bytes"] = stats.get("requested_bytes.all.peak")
        t2 = time.perf_counter()
        snap = torch.cuda.memory._snapshot()
        if opts.record_from == "step":
            _record_history(None, opts.max_entries)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        traces = snap.get("device_traces") or []
        trace_len = len(traces[index]) if index < len(traces) else 0
        res["analysis"] = analyze_step(snap, device=index, start_blocks=device_blocks(start_snap, index),
                                       baseline_bytes=baseline, top=opts.top)
        if trace_len >= opts.max_entries:
            res["analysis"]["warnings"].append(f"the trace is full ({trace_len} events = --max-entries): "
                                               "its oldest events were overwritten; raise --max-entries")
        res["analyze_s"] = time.perf_counter() - t2
        if opts.save_snapshots:
            d = Path(opts.save_snapshots)
            d.mkdir(parents=True, exist_ok=True)
            for tag, s in (("", snap), ("_start", start_snap)):
                with open(d / f"{_safe_name(system.name)}{tag}.pickle", "wb") as f:
                    pickle.dump(s, f)
            res["snapshots"] = str(d / f"{_safe_name(system.name)}.pickle")
    except Exception as exc:  # noqa: BLE001 -- one failing system must not end the run
        import traceback

        oom = "out of memory" in str(exc).lower()
        res.update(status="OOM" if oom else "error",
                   error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        if not oom:
            traceback.print_exc()
    finally:
        snap = start_snap = None
        if hook is not None:
            hook.remove()
        if built is not None:
            B.release_autograd_hooks(*built.keep)
            built.keep.clear()
        built = None
        B.release_leftover_models()
        B.cleanup(ctx)
    return res


def select_systems(B, spec: str, offload_fractions=()) -> list:
    """bench_gpt.py's ``--systems``, except that a full system name selects that system alone
    (there ``ours-optim_grads_params-sf`` also takes ``ours-optim_grads_params-sf-rootsplit``)."""
    exact = {s.name: s for s in B.all_systems(offload_fractions)}
    chosen = []
    for token in (t.strip() for t in spec.split(",")):
        if token:
            for s in [exact[token]] if token in exact else B.select_systems(token, offload_fractions):
                if s not in chosen:
                    chosen.append(s)
    order = list(exact)
    return sorted(chosen, key=lambda s: order.index(s.name))


def parse_args(argv=None) -> Tuple[argparse.Namespace, argparse.Namespace]:
    """This script's options, and bench_gpt.py's (model, device, fake world) from the rest."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        epilog="Every other option goes to bench_gpt.py's parser (see python benchmarks/bench_gpt.py --help).")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"bench_gpt.py's system names/prefixes; a full "
                   f"name selects that system alone (default {DEFAULT_SYSTEMS}); the last one is the reference "
                   "of the side-by-side differences")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the traced one (default 3)")
    p.add_argument("--out", default=None, help="markdown report (default: stdout only)")
    p.add_argument("--json", default=None, help="JSON results (default: none)")
    p.add_argument("--save-snapshots", default=None, metavar="DIR", help="pickle each system's raw snapshots "
                   "(<system>.pickle after the step, for pytorch.org/memory_viz; <system>_start.pickle before it); "
                   "tens to hundreds of MB (default off)")
    p.add_argument("--record-from", choices=("start", "step"), default="start",
                   help="start: record from process start, so held blocks carry their allocation stack (default); "
                   "step: record the traced step only")
    p.add_argument("--max-entries", type=int, default=200000, help="memory-history ring buffer (default 200000)")
    p.add_argument("--top", type=int, default=15, help="largest allocations kept per system (default 15)")
    opts, rest = p.parse_known_args(argv)
    if opts.warmup < 0:
        p.error("--warmup must be >= 0 (0: trace the first step)")
    if any(a == "--nproc" or a.startswith("--nproc=") for a in rest):
        p.error("--nproc is not supported: use --fake-world-size N for rank 0 of an N-way job")
    sys.path.insert(0, str(HERE))
    import bench_gpt as B

    bench_args = B.parse_args(rest + ["--systems", opts.systems, "--warmup", str(max(opts.warmup, 1)), "--steps", "1",
                                      "--out", "", "--json", "", "--png", ""])
    return opts, bench_args


def main(argv=None) -> int:
    opts, args = parse_args(argv)
    import bench_gpt as B  # noqa: E402 -- on sys.path from parse_args
    import torch
    import torch.distributed as dist

    B.quiet_libraries(args.verbose)
    systems = select_systems(B, args.systems, args.offload_fractions)
    ctx = B.init_distributed(args)
    if not ctx.is_cuda:
        print("--device cpu: CUDA memory history does not exist on CPU; running one plumbing step per system "
              "(build, warm-up, the traced step's code path), no breakdown.", flush=True)
    elif opts.record_from == "start":
        _record_history("all", opts.max_entries)
    results: List[Dict[str, Any]] = []
    t_all = time.perf_counter()
    with contextlib.ExitStack() as stack:
        B.prepare_process(ctx, stack)
        probe, _ = B.build_gpt(ctx, torch.bfloat16 if ctx.is_cuda else torch.float32)
        ctx.num_params = B.count_params(probe)
        del probe
        B.cleanup(ctx)
        meta = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                    micro_batch=args.micro_batch, vocab=args.vocab, num_params=ctx.num_params, world=ctx.world,
                    fake=ctx.fake, warmup=opts.warmup, record_from=opts.record_from, torch=torch.__version__,
                    device_name=torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else "cpu",
                    date=time.strftime("%Y-%m-%d %H:%M"), systems=[s.name for s in systems],
                    command=" ".join(["python3", *sys.argv]), notes=[])
        if not ctx.is_cuda:
            meta["notes"].append("CPU run: no CUDA memory history, so no breakdown (plumbing only)")
        ctx.log(f"GPTModel {ctx.num_params / 1e6:.1f}M params; world {ctx.world}{' (fake)' if ctx.fake else ''}; "
                f"systems {', '.join(meta['systems'])}")
        for system in systems:
            ctx.log(f"--> {system.name}: {system.description}")
            r = run_system(B, ctx, system, opts)
            results.append(r)
            a = r.get("analysis")
            ctx.log(f"    {r['status']}" + (f"  peak {_gib(a['peak_bytes'])} GiB during {a['phase_at_peak']}  "
                                             f"(torch requested peak {_gib(r.get('requested_peak_bytes'))}, "
                                             f"max_memory_allocated {_gib(r.get('max_allocated_bytes'))})"
                                             if a else f"  {r.get('error') or r.get('note') or ''}")
                    + f"  [{time.perf_counter() - t_all:.0f} s]")
        if ctx.is_cuda:
            _record_history(None, opts.max_entries)
        meta["total_s"] = time.perf_counter() - t_all
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

    md = report_markdown(meta, results)
    print("\n" + md, flush=True)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(md + "\n")
        print(f"wrote {opts.out}")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
        print(f"wrote {opts.json}")
    print(f"systems {meta['total_s']:.0f} s")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
