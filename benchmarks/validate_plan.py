#!/usr/bin/env python3
"""``megatron_fsdp_v2.plan`` against what one GPU measures, for the ~941M GPT of bench_gpt.py.

    python benchmarks/validate_plan.py          # N = 1, then fake 8 (two child processes), < 6 min on one H200
    python benchmarks/validate_plan.py --modes 1,2 --device cpu --small   # CPU smoke run (state only)

Per mode (N = 1, or rank 0 of a fake 8-rank group: torch's fake process group, collectives are
no-ops) and row (every strategy, and ZeRO-3 with ``OffloadPolicy(fraction=0.5)`` and ``1``;
bf16 compute, fp32 main weights and grads, fused AdamW, one micro-batch, TransformerLayer units,
the storage-freeing allocator, ``zero_grad(set_to_none=True)``):

* activations: the same GPT (built in fp32 like the wrapped one, then cast to bf16: the compute
  path our wrapper runs), unwrapped, each gradient dropped as it arrives: ``A_fwd`` (allocated
  when the forward returns) and ``A`` (the peak of forward and backward), above its weights;
* state: device bytes after ``optimizer.step()`` against the plan's kept bytes (weights, main
  weights, grads, Adam state on the device); host: the plan's pinned bytes against
  ``persistent_bytes()`` and the host optimizer state;
* forward end: allocated when the wrapped forward returns, minus ``A_fwd``, against the plan's
  ``phases["forward_end"]``;
* peak: ``max_memory_allocated`` over the step minus ``A``, against the plan's
  ``peak_with_activations`` (``plan(..., activation_bytes=A)``) minus ``A``
  ([Note: the peak with activations] in megatron_fsdp_v2/plan/phases.py).

Each row ends with ``model.unshard()`` (the last refresh all-gather waited for) before the model
is freed: ProcessGroupNCCL keeps an un-waited async collective's tensors until its watchdog sees
it complete (pytorch/pytorch#148590), which otherwise frees the previous row's compute weights
in the middle of the next row's measurement. ``leak``: allocated after a row is freed minus
before it was built (0 when nothing outlives a row). PASS when state, forward end and peak are
within 3% (the last two on our bytes, activations taken out). Prints one table and writes it to
benchmarks/results/<today>/plan_validation.md (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (REPO, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

from bench_setup import allocated, build_gpt, cleanup, global_buffer_bytes, init_distributed, prepare_process  # noqa: E402
from bench_systems import _forward_loss, release_autograd_hooks, release_leftover_models  # noqa: E402

GIB = 1 << 30
TOLERANCE_PCT = 3.0
ROWS = ("no_shard", "optim", "optim_grads", "optim_grads_params", "optim_grads_params@0.5", "optim_grads_params@1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="1,8", help="comma list of world sizes: 1 = one GPU, N > 1 = fake N")
    p.add_argument("--rows", default=",".join(ROWS), help="strategy or strategy@offload_fraction, comma list")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="2 layers, hidden 256, seq 256, vocab 4096 (smoke run)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "results" / datetime.date.today().isoformat() / "plan_validation.md"))
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)   # one mode, JSON on stdout
    args = p.parse_args(argv)
    big = dict(layers=16, hidden=2048, heads=16, seq=2048, micro_batch=4, vocab=32000)
    small = dict(layers=2, hidden=256, heads=4, seq=256, micro_batch=2, vocab=4096)
    for key, value in (small if args.small else big).items():
        setattr(args, key, value)
    args.ffn, args.skip_init, args.lr, args.cpu_fused_adam = None, True, 1e-5, False
    args.fake_world_size = args.child if args.child > 1 else 0
    return args


def _pct(got, want):
    return None if got is None or want is None or not want else 100.0 * (got - want) / want


def activations(ctx) -> dict:
    """``A_fwd`` and ``A`` of the unwrapped GPT: built in fp32 as the wrapped runs are, cast to bf16
    (what our compute weights are), each gradient dropped as it arrives."""
    if not ctx.is_cuda:
        return {"forward_end": None, "peak": None}
    gpt, _ = build_gpt(ctx, torch.float32)
    model = gpt.to(torch.bfloat16)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    _forward_loss(ctx, model).backward()          # warm-up (lazy kernels and workspaces)
    cleanup(ctx)
    before = torch.cuda.memory_allocated(ctx.device)
    loss = _forward_loss(ctx, model)
    forward_end = torch.cuda.memory_allocated(ctx.device) - before
    loss.backward()
    peak = torch.cuda.max_memory_allocated(ctx.device) - before
    del model, gpt, loss
    release_leftover_models()
    cleanup(ctx)
    return {"forward_end": forward_end, "peak": peak}


def _split(row: str):
    strategy, _, fraction = row.partition("@")
    return strategy, (float(fraction) if fraction else None)


def _state_by_place(model, opt) -> tuple:
    """(device, host) optimizer-state bytes, by where each group's main weights live."""
    from bench_systems import _tensor_bytes

    device = host = 0
    for group in model._fsdp_engine.groups:
        nbytes = sum(_tensor_bytes(v) for main in group.main_params
                     for k, v in opt.state.get(main, {}).items() if k != "step")
        device, host = (device + nbytes, host) if group.offloaded is None else (device, host + nbytes)
    return device, host


def _planned(ctx, gpt, strategy, offload, act) -> dict:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp_v2 import MixedPrecisionPolicy, plan

    planned = plan(gpt, strategy, world_size=ctx.world, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                   unit_modules=[TransformerLayer], optimizer="adamw", micro_batches=1, device=ctx.device.type,
                   offload=offload, activation_bytes=act["peak"]).candidates[0]
    return dict(planned_state=planned.persistent_bytes, planned_host=planned.host_bytes,
                planned_forward_end=planned.phases["forward_end"],
                planned_peak=None if act["peak"] is None else planned.peak_with_activations - act["peak"])


def _measured_step(ctx, model, opt, baseline, act, out) -> None:
    if ctx.is_cuda:
        cleanup(ctx)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    loss = _forward_loss(ctx, model)
    if ctx.is_cuda:
        out["forward_end"] = allocated(ctx) - baseline - act["forward_end"]
    loss.backward()
    del loss
    opt.step()
    model.unshard()                               # the refresh all-gather waited for (see the docstring)
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()                  # frees offload's upload copies, held until their stream event is seen
        out["state"] = allocated(ctx) - baseline
        out["peak"] = torch.cuda.max_memory_allocated(ctx.device) - global_buffer_bytes() - baseline - act["peak"]
    device_state, host_state = _state_by_place(model, opt)
    kept = model.persistent_bytes()
    out["accounted_state"] = kept["total"] + device_state
    out["host"] = kept.get("host_total", 0) + host_state


def run_row(ctx, row: str, act: dict) -> dict:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp_v2 import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    strategy, fraction = _split(row)
    offload = None if fraction is None else OffloadPolicy(fraction=fraction)
    cleanup(ctx)
    baseline = allocated(ctx)
    gpt, _ = build_gpt(ctx, torch.float32)
    out = dict(row=row, world=ctx.world, **_planned(ctx, gpt, strategy, offload, act))
    model = fully_shard(gpt, sharding_strategy=strategy, unit_modules=[TransformerLayer], offload=offload,
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    del gpt
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=ctx.is_cuda)
    for _ in range(ctx.args.warmup):
        _forward_loss(ctx, model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _measured_step(ctx, model, opt, baseline, act, out)
    opt.zero_grad(set_to_none=True)
    release_autograd_hooks(model, opt)
    del model, opt
    release_leftover_models()
    cleanup(ctx)
    out["leak"] = None if baseline is None else allocated(ctx) - baseline
    return out


def child(args) -> None:
    ctx = init_distributed(args)
    with contextlib.ExitStack() as stack:
        prepare_process(ctx, stack)
        act = activations(ctx)
        rows = [run_row(ctx, row, act) for row in args.rows.split(",")]
    print("RESULT " + json.dumps(rows), flush=True)


def _cells(r: dict) -> tuple:
    """(cells, ok) of one table row."""
    fmt = lambda v: "-" if v is None else f"{v / GIB:.3f}"          # noqa: E731
    dev = lambda v: "-" if v is None else f"{v:+.2f}"                # noqa: E731
    state = r.get("state", r["accounted_state"])
    ds, df, dp = (_pct(state, r["planned_state"]), _pct(r.get("forward_end"), r["planned_forward_end"]),
                  _pct(r.get("peak"), r["planned_peak"]))
    dh = _pct(r["host"], r["planned_host"]) if r["planned_host"] else (0.0 if not r["host"] else None)
    ok = all(d is not None and abs(d) <= TOLERANCE_PCT for d in (ds, dh)) and \
        all(d is None or abs(d) <= TOLERANCE_PCT for d in (df, dp))
    cells = [f"{r['world']}{' (fake)' if r['world'] > 1 else ''}", r["row"].replace("@", " offload "),
             fmt(r["planned_state"]), fmt(state), dev(ds), fmt(r["planned_host"]), fmt(r["host"]),
             fmt(r["planned_forward_end"]), fmt(r.get("forward_end")), dev(df),
             fmt(r["planned_peak"]), fmt(r.get("peak")), dev(dp), fmt(r.get("leak")), "PASS" if ok else "FAIL"]
    return cells, ok


def table(rows: list) -> str:
    head = ["N", "row", "state planned", "measured", "dev %", "host planned", "host", "fwd end planned",
            "measured - A_fwd", "dev %", "peak planned - A", "measured - A", "dev %", "leak", "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(r)[0]) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    rows = []
    for mode in (int(m) for m in args.modes.split(",")):
        cmd = [sys.executable, __file__, "--child", str(mode), "--rows", args.rows, "--device", args.device,
               "--warmup", str(args.warmup)] + (["--small"] if args.small else [])
        print("running:", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not result:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            raise SystemExit(f"mode {mode} failed (exit {done.returncode}).")
        rows += json.loads(result[-1][len("RESULT "):])
    activ = [r for r in rows if r.get("peak") is not None]
    text = ("GPT of bench_gpt.py" + (" (--small)" if args.small else "") + f", device {args.device}; GiB; "
            f"A = the unwrapped GPT's activation peak; within {TOLERANCE_PCT}% = PASS\n\n" + table(rows))
    if not activ:
        text += "\n\n(no GPU: state and host bytes only, from the tensors)"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n\nCommand: python benchmarks/validate_plan.py "
                                  + " ".join(sys.argv[1:]) + "\n")
    return 0 if all(_cells(r)[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
