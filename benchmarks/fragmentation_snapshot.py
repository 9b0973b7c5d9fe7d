#!/usr/bin/env python3
"""Where the caching allocator's reserved-but-free bytes sit, for one system at one model size.

    python benchmarks/fragmentation_snapshot.py --systems ours,fsdp2 --layers ours=38,fsdp2=41 --out $OUT/frag.md

Runs bench_largest.py's systems at a fixed number of layers (issue-16 shape: hidden 4096, seq 4096,
full recompute, meta init) with ``torch.cuda.memory._record_memory_history`` on, and takes an
allocator snapshot at the first out-of-memory (an OOM observer) or, if the run trains, at the
reserved peak's end of the last step. Per system it writes: the peaks (allocated, reserved), and
the segments with the most free bytes inside them, each with its active blocks and the Python
frame (first of this repository, else of torch) that allocated each. That is what decides a fix
for fragmentation: which allocations sit in the holes, and which were there before.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

import bench_largest as bl  # noqa: E402

MIB = 1 << 20
SNAPSHOTS: dict = {}


def _frame(block) -> str:
    frames = block.get("frames") or []
    for want in ("megatron_fsdp_v2", "torch/optim", "torch/distributed/fsdp", "megatron/core"):
        for f in frames:
            if want in f.get("filename", ""):
                name = f["filename"].split("site-packages/")[-1].split("/work/")[-1]
                return f"{name}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?').split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def summarize(name: str, snap: dict, top: int = 12) -> list:
    segs = [s for s in snap["segments"] if s.get("device", 0) == torch.cuda.current_device()]
    reserved = sum(s["total_size"] for s in segs)
    active = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
    lines = [f"### {name}", "", f"segments {len(segs)}, reserved {reserved / 2**30:.2f} GiB, active "
             f"{active / 2**30:.2f} GiB, free inside segments {(reserved - active) / 2**30:.2f} GiB", ""]
    by_free = sorted(segs, key=lambda s: -(s["total_size"] - s["allocated_size"]))
    lines += ["| segment MiB | free MiB | stream | blocks (MiB, a=active f=free) : allocating frame of each active |",
              "|---:|---:|---|---|"]
    for s in by_free[:top]:
        parts = []
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                parts.append(f"a{b['size'] / MIB:.0f} {_frame(b)}")
            else:
                parts.append(f"f{b['size'] / MIB:.0f}")
        lines.append(f"| {s['total_size'] / MIB:.0f} | {(s['total_size'] - s['allocated_size']) / MIB:.0f} | "
                     f"{s.get('stream', 0)} | " + "; ".join(parts[:24]) + (" ..." if len(parts) > 24 else "") + " |")
    sizes: dict = {}
    for s in segs:
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                key = _frame(b)
                n, total = sizes.get(key, (0, 0))
                sizes[key] = (n + 1, total + b["size"])
    lines += ["", "| allocating frame | active blocks | GiB |", "|---|---:|---:|"]
    for key, (n, total) in sorted(sizes.items(), key=lambda kv: -kv[1][1])[:20]:
        lines.append(f"| {key} | {n} | {total / 2**30:.2f} |")
    return lines + [""]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        del argv[i:i + 2]
    layers_spec = "ours=38,fsdp2=41"       # each system where it runs out of memory (2026-12-01)
    if "--layers" in argv:
        i = argv.index("--layers")
        layers_spec = argv[i + 1]
        del argv[i:i + 2]
    layers_of = {k: int(v) for k, v in (t.split("=") for t in layers_spec.split(","))}
    args = bl.parse_args(argv + ["--out", os.devnull, "--json", ""])
    bl.quiet_libraries(args.verbose)
    systems = bl.select(args.systems, ())
    ctx = bl.init_distributed(args)
    counter = None
    lines = [f"# allocator snapshots at L = {layers_spec}, PYTORCH_CUDA_ALLOC_CONF="
             f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}", ""]
    import contextlib

    def on_oom(device, alloc, device_alloc, device_free):
        SNAPSHOTS.setdefault(current[0], (f"OOM requesting {alloc / MIB:.0f} MiB", torch.cuda.memory._snapshot()))

    current = [""]
    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    with contextlib.ExitStack() as stack:
        bl.prepare_process(ctx, stack)
        counter = bl.param_counter(ctx)
        for system in systems:
            current[0] = system.name
            layers = layers_of[system.name]
            ctx.args.layers, ctx.num_params = layers, counter(layers)
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            bl.PEAK_RESERVED.clear()
            r = bl.run_system(ctx, system)
            if system.name not in SNAPSHOTS:
                SNAPSHOTS[system.name] = ("trained (snapshot after the run)", torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
            what, snap = SNAPSHOTS[system.name]
            lines.append(f"{system.name} at L = {layers}: {r['status']} ({what}); peak {r.get('peak_gib')} GiB allocated, "
                         f"reserved peak {bl.PEAK_RESERVED.get('gib')} GiB; error {r.get('error')}")
            lines += summarize(system.name, snap)
            del snap
            SNAPSHOTS[system.name] = (what, None)
            bl.cleanup(ctx)
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    bl.finish_process()
    return 0


if __name__ == "__main__":
    sys.exit(main())
