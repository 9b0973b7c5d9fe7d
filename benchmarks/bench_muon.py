#!/usr/bin/env python3
"""Muon against AdamW on bench_gpt.py's GPT under ``fully_shard`` (issue 49, item 5).

Both optimizers run in ONE process, one after the other (build, warm up, time, free), on the same
GPT, batch and strategy::

    python benchmarks/bench_muon.py                             # the ~941M GPT, 1 GPU (N = 1)
    python benchmarks/bench_muon.py --fake-world-size 8         # each as rank 0 of a fake 8-way group
    python benchmarks/bench_muon.py --device cpu --small --steps 2 --warmup 1    # CPU dry run (minutes)

Per optimizer: the median step time (forward + backward of one micro-batch, ``optimizer.step()``,
``zero_grad``) over ``--steps`` timed steps after ``--warmup`` untimed ones, the peak memory allocated
over those steps and the optimizer state this rank keeps. For Muon also: the Newton-Schulz time of
this rank per step (measured in ``--ns-steps-timed`` further steps, each call timed between two
device synchronizations, so those steps are not the timed ones), the fraction of the matrix elements
this rank orthogonalizes (its owner share: about 1/N) and the bytes of its two all-to-alls per step
(``comm_stats()["all_to_all"]``: 2 x 2 bytes x the matrix elements). With a fake group the
collectives move nothing, so step times show the work of rank 0 of N, not the wire.

Which parameters Muon steps: the 2-D ones but the word embedding and the output layer (AdamW, the
usual rule), as ``megatron_fsdp_v2.optim.Muon``'s README recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (REPO, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

from bench_setup import build_gpt, finish_process, init_distributed, prepare_process, sync  # noqa: E402

GIB = 1 << 30


def _is_muon(name: str, param) -> bool:
    return param.ndim == 2 and "embedding" not in name and "output_layer" not in name


def _optimizer(kind: str, model, args):
    if kind == "adamw":
        fused = args.device == "cuda"
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=fused)
    from megatron_fsdp_v2.optim import Muon

    named = list(model.named_parameters())
    return Muon([{"params": [p for n, p in named if _is_muon(n, p)]},
                 {"params": [p for n, p in named if not _is_muon(n, p)], "use_muon": False}],
                lr=args.muon_lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", adamw_lr=args.lr,
                adamw_betas=(0.9, 0.95), adamw_weight_decay=0.1)


def _state_bytes(opt) -> int:
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


@contextlib.contextmanager
def _timed_newton_schulz(ctx, record: list):
    """Time every Newton-Schulz call of the Muon step (a device sync on each side of it)."""
    from megatron_fsdp_v2.optim import muon as muon_module

    original = muon_module.zeropower_via_newtonschulz

    def timed(*args, **kwargs):
        sync(ctx)
        start = time.perf_counter()
        out = original(*args, **kwargs)
        sync(ctx)
        record.append(time.perf_counter() - start)
        return out

    muon_module.zeropower_via_newtonschulz = timed
    try:
        yield
    finally:
        muon_module.zeropower_via_newtonschulz = original


def run_one(ctx, kind: str) -> dict:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard
    from megatron_fsdp_v2.optim.matrix_owners import assign_owners

    args = ctx.args
    gpt, _ = build_gpt(ctx, torch.float32)
    model = fully_shard(gpt, sharding_strategy=args.strategy, unit_modules=[TransformerLayer],
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    del gpt
    opt = _optimizer(kind, model, args)

    def step() -> float:
        out = model(ctx.tokens, ctx.position_ids, ctx.attention_mask, labels=ctx.labels)
        loss = out.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step() for _ in range(args.warmup)]
    if ctx.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    model.reset_comm_stats()
    times = []
    for _ in range(args.steps):
        sync(ctx)
        start = time.perf_counter()
        losses.append(step())
        sync(ctx)
        times.append(time.perf_counter() - start)
    row = {"optimizer": kind, "strategy": args.strategy, "world": ctx.world, "fake": ctx.fake,
           "step_ms": 1e3 * statistics.median(times), "losses": losses,
           "peak_gib": torch.cuda.max_memory_allocated() / GIB if ctx.is_cuda else None,
           "optimizer_state_gib": _state_bytes(opt) / GIB if ctx.is_cuda else None}
    stats = model.comm_stats()
    row["all_to_all_bytes_per_step"] = stats["all_to_all"]["bytes"] / args.steps
    if kind == "muon":
        matrices = [p for n, p in model.named_parameters() if _is_muon(n, p)]
        numels = [p.numel() for p in matrices]
        sharded = args.strategy != "no_shard" and ctx.world > 1
        owners = assign_owners(numels, ctx.world) if sharded else (0,) * len(numels)
        row["owned_fraction"] = sum(n for n, o in zip(numels, owners) if o == ctx.rank) / sum(numels)
        row["matrix_elements"] = sum(numels)
        calls: list = []
        with _timed_newton_schulz(ctx, calls):
            for _ in range(args.ns_steps_timed):
                step()
        row["newton_schulz_ms_per_step"] = 1e3 * sum(calls) / args.ns_steps_timed
        row["newton_schulz_calls_per_step"] = len(calls) / args.ns_steps_timed
    del model, opt
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 x hidden)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--small", action="store_true", help="2 layers, hidden 256, 4 heads, seq 256, micro-batch 2, "
                                                          "vocab 4096")
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    p.add_argument("--optimizers", default="adamw,muon")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ns-steps-timed", type=int, default=3, help="further Muon steps that time Newton-Schulz")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's (and Muon's AdamW part) learning rate")
    p.add_argument("--muon-lr", type=float, default=1e-5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--fake-world-size", type=int, default=0, help="run as rank 0 of an N-way job on torch's fake "
                                                                  "process group (memory and per-rank work)")
    p.add_argument("--skip-init", action="store_true", help="perform_initialization=False (faster build)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.heads, args.seq, args.micro_batch, args.vocab = 2, 256, 4, 256, 2, 4096
    args.ffn = args.ffn or 4 * args.hidden
    args.nproc, args.verbose, args.recompute, args.meta_init = 1, False, False, False
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = init_distributed(args)
    rows = []
    with contextlib.ExitStack() as stack:
        prepare_process(ctx, stack)
        for kind in [k.strip() for k in args.optimizers.split(",") if k.strip()]:
            rows.append(run_one(ctx, kind))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    finish_process()
    if ctx.rank == 0:
        print("\n| optimizer | strategy | N | step (ms) | peak (GiB) | optimizer state (GiB) | Newton-Schulz (ms/step) "
              "| owned share | all_to_all (MB/step) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            fmt = (lambda v, spec: "-" if v is None else format(v, spec))
            print(f"| {r['optimizer']} | {r['strategy']} | {r['world']}{' (fake)' if r['fake'] else ''} | "
                  f"{r['step_ms']:.1f} | {fmt(r['peak_gib'], '.2f')} | {fmt(r['optimizer_state_gib'], '.2f')} | "
                  f"{fmt(r.get('newton_schulz_ms_per_step'), '.1f')} | {fmt(r.get('owned_fraction'), '.3f')} | "
                  f"{r['all_to_all_bytes_per_step'] / 1e6:.1f} |")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
