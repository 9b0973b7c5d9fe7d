#!/usr/bin/env python3
"""``megatron_fsdp_v2.plan`` against what one GPU measures, for the ~941M GPT of bench_gpt.py.

    python benchmarks/validate_plan.py          # N = 1, then fake 8 (two child processes), ~5 min on one H200
    python benchmarks/validate_plan.py --modes 8 --device cpu --small   # CPU smoke run (state only)

Per mode (N = 1, or rank 0 of a fake 8-rank group: torch's fake process group, collectives are
no-ops) and strategy (bf16 compute, fp32 main weights and grads, fused AdamW, one micro-batch,
TransformerLayer units, the storage-freeing allocator):

* state: ``torch.cuda.memory_allocated`` after ``optimizer.step()`` minus before the model was
  built, against the plan's bytes kept between steps (weights, main weights, grads, Adam state);
* peak: ``max_memory_allocated`` over a warm step (forward, backward, step) minus the activation
  peak of the same GPT without any wrapper (bf16 weights, each gradient dropped as it arrives),
  against the plan's kept bytes plus its temporaries' peak.

PASS when both are within 3%. Prints one table and writes it to
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
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="1,8", help="comma list of world sizes: 1 = one GPU, N > 1 = fake N")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="2 layers, hidden 256, seq 256, vocab 4096 (smoke run)")
    p.add_argument("--warmup", type=int, default=2)
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
    return None if got is None or not want else 100.0 * (got - want) / want


def activation_peak(ctx) -> int | None:
    """Peak bytes of a forward and backward above the unwrapped bf16 GPT's own weights; each
    gradient is dropped as it arrives, so only activations (and one gradient) remain."""
    if not ctx.is_cuda:
        return None
    from megatron.core.transformer.module import Float16Module

    gpt, config = build_gpt(ctx, torch.bfloat16)
    model = Float16Module(config, gpt)             # as megatron.training.get_model does with --bf16
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    _forward_loss(ctx, model).backward()          # warm-up (lazy kernels and workspaces)
    cleanup(ctx)
    before = torch.cuda.memory_allocated(ctx.device)
    _forward_loss(ctx, model).backward()
    peak = torch.cuda.max_memory_allocated(ctx.device) - before
    del model
    release_leftover_models()
    cleanup(ctx)
    return peak


def run_strategy(ctx, strategy: str) -> dict:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard, plan

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    cleanup(ctx)
    baseline = allocated(ctx)
    gpt, _ = build_gpt(ctx, torch.float32)
    planned = plan(gpt, strategy, world_size=ctx.world, mixed_precision=policy, unit_modules=[TransformerLayer],
                   optimizer="adamw", micro_batches=1, device=ctx.device.type)[strategy]
    model = fully_shard(gpt, sharding_strategy=strategy, unit_modules=[TransformerLayer], mixed_precision=policy)
    del gpt
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.args.lr, fused=ctx.is_cuda)
    from bench_systems import torch_optimizer_state_bytes

    out = dict(strategy=strategy, world=ctx.world, planned_state=planned.persistent_bytes,
               planned_peak=planned.peak_bytes, planned_temporaries=planned.temporaries)
    for step in range(ctx.args.warmup + 1):
        if step == ctx.args.warmup and ctx.is_cuda:
            cleanup(ctx)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        _forward_loss(ctx, model).backward()
        opt.step()
        if step == ctx.args.warmup:
            if ctx.is_cuda:
                torch.cuda.synchronize(ctx.device)
                out["state"] = allocated(ctx) - baseline
                out["peak"] = torch.cuda.max_memory_allocated(ctx.device) - global_buffer_bytes() - baseline
            out["accounted_state"] = model.persistent_bytes()["total"] + torch_optimizer_state_bytes([opt])
        opt.zero_grad(set_to_none=True)
    release_autograd_hooks(model, opt)
    del model, opt
    release_leftover_models()
    cleanup(ctx)
    return out


def child(args) -> None:
    ctx = init_distributed(args)
    with contextlib.ExitStack() as stack:
        prepare_process(ctx, stack)
        act = activation_peak(ctx)
        rows = []
        for strategy in args.strategies.split(","):
            row = run_strategy(ctx, strategy)
            row["activation_peak"] = act
            rows.append(row)
    print("RESULT " + json.dumps(rows), flush=True)


def table(rows: list) -> str:
    head = ["N", "strategy", "state planned", "measured", "dev %", "peak planned", "measured - activations", "dev %",
            "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        state = r.get("state", r["accounted_state"])
        peak = None if r.get("peak") is None or r.get("activation_peak") is None else r["peak"] - r["activation_peak"]
        ds, dp = _pct(state, r["planned_state"]), _pct(peak, r["planned_peak"])
        ok = abs(ds) <= TOLERANCE_PCT and (dp is None or abs(dp) <= TOLERANCE_PCT)
        fmt = lambda v: "-" if v is None else f"{v / GIB:.3f}"          # noqa: E731
        lines.append("| " + " | ".join([
            f"{r['world']}{' (fake)' if r['world'] > 1 else ''}", r["strategy"], fmt(r["planned_state"]), fmt(state),
            f"{ds:+.2f}", fmt(r["planned_peak"]), fmt(peak), "-" if dp is None else f"{dp:+.2f}",
            "PASS" if ok else "FAIL"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    rows = []
    for mode in (int(m) for m in args.modes.split(",")):
        cmd = [sys.executable, __file__, "--child", str(mode), "--strategies", args.strategies, "--device", args.device,
               "--warmup", str(args.warmup)] + (["--small"] if args.small else [])
        print("running:", " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not result:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            raise SystemExit(f"mode {mode} failed (exit {done.returncode}).")
        rows += json.loads(result[-1][len("RESULT "):])
    text = ("GPT of bench_gpt.py" + (" (--small)" if args.small else "") + f", device {args.device}; units in GiB; "
            f"within {TOLERANCE_PCT}% = PASS\n\n" + table(rows))
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n\nCommand: python benchmarks/validate_plan.py "
                                  + " ".join(sys.argv[1:]) + "\n")
    return 0 if all("FAIL" not in line for line in text.splitlines()) else 1


if __name__ == "__main__":
    sys.exit(main())
