#!/usr/bin/env python3
"""What the rank-divergence check costs a training step (comm/ledger.py, [Note: ranks that
issue different collectives]): the 941M GPT of bench_gpt.py, wrapped by ours, as rank 0 of a fake
N-way group (torch's fake process group: collectives are no-ops, so the step is this rank's compute
and our host-side work), timed with the ledger

  off        MEGATRON_FSDP_V2_CHECK_COLLECTIVES=0: nothing recorded or checked
  default    unset: on NCCL (and the fake group) each collective recorded into its group's ring,
             and the watchdog thread running (it only reads an integer per second; it compares
             rings after a 60 s stall)
  check-all  =1: the blocking 2 x int64 fingerprint all-gather before every collective (a host
             sync per collective; on the fake group the all-gather itself costs nothing, so this
             is the sync and the host work, a lower bound of the real exhaustive mode)

on one model, the modes taking turns in rounds (so drifting clocks hit them alike). Prints the
median step per mode, its ratio to ``off``, the collectives recorded per step and the ledger's
cost per call measured alone (so calls x cost gives a bound independent of the step's noise).
The budget (issue 48): default <= 1% of the step on an H200 at a fake 8-way group::

    python benchmarks/divergence_check_cost.py --fake-world-size 8              # GPU, 941M GPT
    python benchmarks/divergence_check_cost.py --device cpu --small --fake-world-size 8 --rounds 2

The second is a CPU smoke run (a 2-layer GPT; its ratios mean little).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
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

from bench_gpt import add_model_arguments, quiet_libraries  # noqa: E402
from bench_setup import build_gpt, cleanup, count_params, finish_process, init_distributed, prepare_process, sync  # noqa: E402
from bench_systems import BUILDERS, System  # noqa: E402

MODES = ("off", "default", "check-all")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (defaults: the ~940M-parameter GPT of bench_gpt.py)")
    add_model_arguments(g, dict(layers=16, hidden=2048, heads=16, seq=2048, micro_batch=4, vocab=32000),
                        "smoke preset: 2 layers, hidden 256, 4 heads, seq 256, micro-batch 2, vocab 4096")
    g.add_argument("--skip-init", action="store_true", help="perform_initialization=False (faster build)")
    g = p.add_argument_group("run")
    g.add_argument("--strategies", default="optim,optim_grads,optim_grads_params",
                   help="comma list of sharding strategies, one model each (default: the three sharded ones)")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    g.add_argument("--fake-world-size", type=int, default=8, help="rank 0 of this many (torch's fake group; default 8)")
    g.add_argument("--warmup", type=int, default=3, help="untimed steps per model (default 3)")
    g.add_argument("--rounds", type=int, default=6, help="rounds; each times --steps steps per mode (default 6)")
    g.add_argument("--steps", type=int, default=4, help="timed steps per mode and round (default 4)")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--cpu-fused-adam", action="store_true", help="fused AdamW on CPU too")
    g.add_argument("--verbose", action="store_true")
    g.add_argument("--out", default="", help="also write the markdown table here")
    args = p.parse_args(argv)
    small = dict(layers=2, hidden=256, heads=4, seq=256, micro_batch=2, vocab=4096)
    full = dict(layers=16, hidden=2048, heads=16, seq=2048, micro_batch=4, vocab=32000)
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.fake_world_size < 2:
        p.error("--fake-world-size must be >= 2 (a 1-rank group has nothing to compare)")
    args.nproc = 1
    return args


def _communicators(model) -> list:
    """Every Communicator the wrapped model issues collectives through."""
    engine = model._fsdp_engine
    comms = [engine.comm, engine.replicas, engine.experts] + [g.comm for g in engine.groups]
    return list({id(c): c for c in comms if c is not None}.values())


def _set_mode(model, mode: str, default_modes: dict) -> None:
    """Put every Communicator of ``model`` in ``mode`` (as the environment variable would at the wrap)."""
    from megatron_fsdp_v2.comm.ledger import LedgerMode

    for comm in _communicators(model):
        comm.ledger_mode = {"off": LedgerMode.OFF, "check-all": LedgerMode.CHECK}.get(mode, default_modes[id(comm)])


def ledger_us_per_call(calls: int = 200_000) -> float:
    """One recorded call alone (``LedgerMode.RECORD``): microseconds, on a scratch ledger."""
    from megatron_fsdp_v2.comm.ledger import CollectiveLedger, LedgerMode

    ledger = CollectiveLedger(None)
    tensor = torch.empty(1 << 20, dtype=torch.bfloat16)
    label = "weights of decoder.layers.7/bfloat16/grad"
    t = time.perf_counter()
    for _ in range(calls):
        ledger.before("all_gather", tensor, label, LedgerMode.RECORD)
    return 1e6 * (time.perf_counter() - t) / calls


def time_modes(ctx, built, model) -> dict:
    """Median step (s) per mode and the ledger records per step, the modes taking turns."""
    from megatron_fsdp_v2.comm.watchdog import watch

    a = ctx.args
    default_modes = {id(c): c.ledger_mode for c in _communicators(model)}
    for comm in _communicators(model):       # NCCL's default runs the watchdog; ledger_for skips it on fake
        watch(comm.ledger)
    for _ in range(a.warmup):
        built.fwd_bwd()
        built.opt_step()
        built.zero_grad()
    times = {m: [] for m in MODES}
    records = []
    ledger = model._fsdp_engine.comm.ledger
    for r in range(a.rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            _set_mode(model, mode, default_modes)
            for _ in range(a.steps):
                sync(ctx)
                count, t = ledger.count, time.perf_counter()
                built.fwd_bwd()
                built.opt_step()
                built.zero_grad()
                sync(ctx)
                times[mode].append(time.perf_counter() - t)
                if mode == "default":
                    records.append(ledger.count - count)
    _set_mode(model, "default", default_modes)
    return {"median": {m: statistics.median(v) for m, v in times.items()}, "records": statistics.median(records)}


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_libraries(args.verbose)
    ctx = init_distributed(args)
    per_call = ledger_us_per_call()
    rows = []
    with contextlib.ExitStack() as stack:
        prepare_process(ctx, stack)
        probe, _ = build_gpt(ctx, torch.bfloat16 if ctx.is_cuda else torch.float32)
        ctx.num_params = count_params(probe)
        del probe
        cleanup(ctx)
        device = torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else (platform.processor() or "cpu")
        ctx.log(f"GPT {ctx.num_params / 1e6:.1f}M params, rank 0 of a fake {ctx.world}-way group, {device}, "
                f"torch {torch.__version__}; ledger record alone: {per_call:.3f} us per call")
        for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
            system = System(f"ours-{strategy}-sf", "ours", strategy=strategy, allocator="storage_freeing")
            built = BUILDERS["ours"](ctx, system)
            model = built.keep[0]
            result = time_modes(ctx, built, model)
            built.keep.clear()
            del built, model
            cleanup(ctx)
            med = result["median"]
            rows.append((strategy, med, result["records"]))
            ctx.log(f"{strategy}: " + ", ".join(f"{m} {1e3 * med[m]:.2f} ms" for m in MODES)
                    + f"; default/off {med['default'] / med['off']:.4f}, check-all/off "
                    f"{med['check-all'] / med['off']:.4f}; {result['records']:.0f} collectives per step")
    lines = [f"GPT {ctx.num_params / 1e6:.1f}M, rank 0 of a fake {ctx.world}-way group, {device}, torch "
             f"{torch.__version__}; medians of {args.rounds} x {args.steps} steps per mode, modes taking turns.",
             f"Ledger record alone: {per_call:.3f} us per call.", "",
             "| strategy | off (ms) | default (ms) | check-all (ms) | default / off | check-all / off "
             "| collectives per step | calls x record / step |",
             "|---|---|---|---|---|---|---|---|"]
    for strategy, med, records in rows:
        bound = records * per_call * 1e-6 / med["off"]
        lines.append(f"| {strategy} | {1e3 * med['off']:.2f} | {1e3 * med['default']:.2f} | "
                     f"{1e3 * med['check-all']:.2f} | {med['default'] / med['off']:.4f} | "
                     f"{med['check-all'] / med['off']:.4f} | {records:.0f} | {100 * bound:.4f}% |")
    table = "\n".join(lines)
    ctx.log("\n" + table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")
    finish_process()
    return 0


if __name__ == "__main__":
    sys.exit(main())
