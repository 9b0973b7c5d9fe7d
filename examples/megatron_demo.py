"""``make demo``: a tiny Megatron GPT trained with every sharding strategy on CPU ranks.

    python examples/megatron_demo.py --nproc 2      # from a checkout (or: python -m examples.megatron_demo)

Starts ``--nproc`` processes joined by a gloo group. Each builds the same small Megatron-Core
``GPTModel`` (local layer spec, fp32, ``use_cpu_initialization=True``), generates its own synthetic
token data in-process, and trains it once per strategy with Megatron's machinery:
``get_forward_backward_func()`` (``--micro-batches`` per step, all but the last inside
``no_sync``), ``finalize_model_grads`` and Megatron's optimizer (Adam, grad clipping, weight
decay; built by ``megatron_fsdp_v2.megatron.get_optimizer``). A first run uses Megatron's own
``DistributedDataParallel`` as the reference. Then rank 0 prints one table:

* final loss per run (equal across strategies) and the largest weight difference to the reference;
* bytes moved per step (``comm_stats()``: an all-gather counts its gathered output, a
  reduce-scatter its input, an all-reduce twice its tensor since it is a reduce-scatter plus an
  all-gather) in units of Psi = bytes of all parameters, against the ZeRO count for k
  micro-batches: DDP 2, ZeRO-1 2, ZeRO-2 k+1 (reduce-scatter every micro-batch keeps the
  gradients sharded), ZeRO-3 3k (all-gather in forward and in backward, reduce-scatter);
* persistent bytes per rank (weights, main weights, gradients, Adam state) against ZeRO's
  formula for fp32 training (16 Psi for DDP down to 16 Psi / N for ZeRO-3);
* a checkpoint round trip: each run's final state saved with Megatron's ``dist_checkpointing``
  (``--ckpt-format torch_dist``) and loaded into a fresh model of the next strategy.

Megatron hard-codes CUDA in a few places; the workers apply the CPU patches of
``testing/cpu_compat.py`` (demo/test scaffolding of the checkout, not installed, never used by the
library itself), so the script puts the repository root on ``sys.path``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:          # testing/ (and this checkout's megatron_fsdp_v2) when run as a script
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_fsdp_v2 import STRATEGY_NAMES  # noqa: E402
from megatron_fsdp_v2.notices import summarize_notices  # noqa: E402
from testing.megatron_gpt import local_gpt, megatron_train_step, tiny_cpu_config  # noqa: E402

ZERO_NAMES = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}
REFERENCE = "megatron DDP"


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/megatron_demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="data-parallel CPU ranks (gloo)")
    p.add_argument("--iters", type=int, default=30, help="optimizer steps per strategy")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (k)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--verbose", action="store_true",
                   help="show each notice Megatron and torch print (default: one line per kind that needs no action)")
    args = p.parse_args(argv)
    if args.nproc < 1 or args.iters < 1 or args.micro_batches < 1:
        p.error("--nproc, --iters and --micro-batches must be positive")
    return args


# ---------------------------------------------------------------------------------------------
# Model, data, loss (worker side)
# ---------------------------------------------------------------------------------------------


def _build_gpt(opts):
    """Same initial weights on every rank and for every run (seeded, caller's RNG restored)."""
    config = tiny_cpu_config(opts.layers, opts.hidden, opts.heads)
    return local_gpt(config, opts.vocab, opts.seq, seed=opts.seed), config


def _batches(opts, dp_rank: int) -> List[Dict[str, torch.Tensor]]:
    """This rank's micro-batches: sequences ``start + step * i (mod vocab)``, a learnable signal."""
    g = torch.Generator().manual_seed(opts.seed + 1000 + dp_rank)
    b, s = opts.micro_batch_size, opts.seq
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    out = []
    for _ in range(opts.iters * opts.micro_batches):
        start = torch.randint(0, opts.vocab, (b, 1), generator=g)
        step = torch.randint(1, 8, (b, 1), generator=g)
        tokens = (start + step * torch.arange(s + 1).unsqueeze(0)) % opts.vocab
        out.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                        loss_mask=torch.ones(b, s), attention_mask=causal, position_ids=positions))
    return out




# ---------------------------------------------------------------------------------------------
# One training run (worker side)
# ---------------------------------------------------------------------------------------------


class _Progress:
    """One text progress bar per run, printed by rank 0 (redrawn in place on a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = sys.stdout.isatty()
        self.start = time.time()

    def update(self, done: int, loss: float) -> None:
        if not self.enabled or (not self.tty and done < self.total):
            return
        width = 30
        filled = int(width * done / self.total)
        line = (f"  {self.label:<28} [{'#' * filled}{'.' * (width - filled)}] {done:>3}/{self.total}"
                f"  loss {loss:7.4f}  {time.time() - self.start:5.1f}s")
        print(("\r" if self.tty else "") + line, end="\n" if done == self.total else "", flush=True)


def _optimizer_config(opts, distributed: bool):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=opts.lr, weight_decay=opts.weight_decay, clip_grad=opts.clip_grad,
                           bf16=False, fp16=False, params_dtype=torch.float32,
                           use_distributed_optimizer=distributed)


def _run(opts, batches, strategy: str, rank: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer, save_dist_checkpoint

    model, config = _build_gpt(opts)
    numel = sum(p.numel() for p in model.parameters())
    reference = strategy == REFERENCE
    if reference:
        wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True), model)
        optimizer = get_megatron_optimizer(_optimizer_config(opts, False), [wrapped])
    else:
        ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True)
        wrapped = FullyShardedDataParallel(config, ddp_config, model)
        # the distributed optimizer as Megatron-FSDP means it: the strategy decides what is sharded
        # (no_shard keeps the whole optimizer state on every rank)
        optimizer = get_optimizer(_optimizer_config(opts, True), [wrapped])
        wrapped.reset_comm_stats()
    OptimizerParamScheduler(optimizer, init_lr=opts.lr, max_lr=opts.lr, min_lr=opts.lr, lr_warmup_steps=0,
                            lr_decay_steps=1 << 30, lr_decay_style="constant", start_wd=opts.weight_decay,
                            end_wd=opts.weight_decay, wd_incr_steps=1 << 30, wd_incr_style="constant")
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    k = opts.micro_batches
    label = REFERENCE if reference else f"{strategy} ({ZERO_NAMES[strategy]})"
    progress = _Progress(label, opts.iters, enabled=rank == 0)
    losses = []
    for it in range(opts.iters):
        store, ok, _ = megatron_train_step(wrapped, optimizer, batches[it * k:(it + 1) * k], opts.seq,
                                           opts.micro_batch_size)
        total = torch.stack([d["lm loss"] for d in store]).sum(0).double()
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        losses.append((total[0] / total[1]).item())
        assert ok, "optimizer step failed"
        progress.update(it + 1, losses[-1])
    config.no_sync_func = config.finalize_model_grads_func = None

    adam_bytes = sum(t.numel() * t.element_size() for state in optimizer.optimizer.state.values()
                     for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    if reference:
        comm = None
        persistent = (sum(p.numel() * p.element_size() for p in model.parameters())
                      + sum(b.grad_data.numel() * b.grad_data.element_size() for b in wrapped.buffers))
        state = {key: v.detach().clone() for key, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    else:
        comm = wrapped.comm_stats()
        persistent = wrapped.persistent_bytes()["total"]
        state = wrapped.state_dict()
        save_dist_checkpoint(os.path.join(opts.ckpt_root, strategy), wrapped, optimizer)
    return dict(label=label, strategy=strategy, losses=losses, comm=comm, persistent=persistent,
                adam=adam_bytes, state=state, numel=numel, step=_adam_steps(optimizer))


def _adam_steps(optimizer) -> set:
    return {float(state["step"]) for state in optimizer.optimizer.state.values() if "step" in state}


def _reload(opts, saved: str, target: str) -> bool:
    """Load ``saved``'s checkpoint into a fresh ``target`` model: same weights bitwise, same Adam step?"""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer, load_dist_checkpoint

    model, config = _build_gpt(opts)
    wrapped = FullyShardedDataParallel(config, DistributedDataParallelConfig(data_parallel_sharding_strategy=target),
                                       model)
    optimizer = get_optimizer(_optimizer_config(opts, True), [wrapped])
    load_dist_checkpoint(os.path.join(opts.ckpt_root, saved), wrapped, optimizer)
    return wrapped.state_dict(), _adam_steps(optimizer)


# ---------------------------------------------------------------------------------------------
# Table (rank 0)
# ---------------------------------------------------------------------------------------------


def _zero_theory(strategy: str, k: int, n: int) -> tuple:
    """(bytes moved per step, persistent bytes per rank incl. Adam), in units of Psi (fp32 bytes)."""
    moved = {"no_shard": 2, "optim": 2, "optim_grads": k + 1, "optim_grads_params": 3 * k}[strategy]
    # fp32 everywhere: weights 4 (the main weights alias them for DDP), main 4, grads 4, Adam 8
    per_param = {"no_shard": 4 + 4 + 8, "optim": 4 + 4 + (4 + 8) / n, "optim_grads": 4 + (4 + 4 + 8) / n,
                 "optim_grads_params": 16 / n}[strategy]
    return moved, per_param / 4   # persistent in units of Psi = 4 bytes x params


def _row(r: dict, ref: dict, ref_norm: float, opts, world: int) -> str:
    """One run's line of the table: loss, distance to the reference, bytes moved and kept vs ZeRO."""
    psi, mb = 4 * ref["numel"], 1 / 2 ** 20
    dw = sum((r["state"][key] - ref["state"][key]).double().pow(2).sum().item() for key in ref["state"]) ** 0.5
    if r["comm"] is None:
        moved, ratio, theory_moved, theory_kept = "-", "-", 2, 4 * psi * mb
    else:
        c = r["comm"]
        per_step = (2 * c["all_reduce"]["bytes"] + c["reduce_scatter"]["bytes"] + c["all_gather"]["bytes"]) / opts.iters
        theory_moved, theory_kept = _zero_theory(r["strategy"], opts.micro_batches, world)
        moved, ratio, theory_kept = f"{per_step * mb:.2f}MB", f"{per_step / psi:.3f}", theory_kept * psi * mb
    return (f"{r['label']:<29}{r['losses'][-1]:>10.5f}{dw / ref_norm:>10.1e}{moved:>12}{ratio:>7}{theory_moved:>6}"
            f"{(r['persistent'] + r['adam']) * mb:>10.2f}MB{theory_kept:>7.2f}MB")


def _heading(opts, world: int) -> str:
    return (f"Training a {opts.layers}-layer GPT (hidden {opts.hidden}, vocab {opts.vocab}, seq {opts.seq}) on "
            f"{world} gloo rank(s),\n{opts.iters} steps x {opts.micro_batches} micro-batches per run:")


def _round_trips(rows: List[dict]) -> List[str]:
    """Each run's checkpoint loaded into the next strategy: how many came back bitwise, and which not."""
    differs = [f"{r['strategy']} -> {r['reloaded'][0]}" for r in rows if "reloaded" in r and not (
        all(torch.equal(r["reloaded"][1][key], r["state"][key]) for key in r["state"]) and r["reloaded"][2] == r["step"])]
    trips = [r for r in rows if "reloaded" in r]
    chain = " -> ".join([trips[0]["strategy"]] + [r["reloaded"][0] for r in trips]) if trips else ""
    return [f"checkpoint round trips: {len(trips) - len(differs)} of {len(trips)} bitwise ({chain})"] + \
        [f"  DIFFERS: {pair}" for pair in differs]


def _table(rows: List[dict], opts, world: int) -> str:
    """The demo's table, at most 100 columns (its legend below it)."""
    k = opts.micro_batches
    ref = next(r for r in rows if r["strategy"] == REFERENCE)
    psi, mb = 4 * ref["numel"], 1 / 2 ** 20
    header = (f"{'run':<29}{'final loss':>10}{'|dW|/|W|':>10}{'moved/step':>12}{'x Psi':>7}{'ZeRO':>6}"
              f"{'kept/rank':>12}{'ZeRO':>9}")
    ref_norm = sum(v.double().pow(2).sum().item() for v in ref["state"].values()) ** 0.5
    lines = [header, "-" * len(header)] + [_row(r, ref, ref_norm, opts, world) for r in rows] + _round_trips(rows)
    lines += [
        "",
        f"Psi = {ref['numel']:,} parameters x 4 bytes = {psi * mb:.2f} MB; N = {world} ranks;",
        f"  k = {k} micro-batches per step, {opts.iters} steps.",
        "|dW|/|W|: final weights vs Megatron's own DDP: fp32 rounding (grad norms over shards, reductions",
        "  in another order), which Adam magnifies where the true gradient is 0 (the QKV bias's key part).",
        "moved/step: bytes entering collectives per step (an all-reduce counts as reduce-scatter +",
        "  all-gather), x Psi; ZeRO: DDP 2, ZeRO-1 2, ZeRO-2 k+1, ZeRO-3 3k.",
        "kept/rank: weights + main weights + grads + Adam state on rank 0; ZeRO: fp32 4+4+8 bytes per",
        "  parameter, the sharded parts / N.",
        "checkpoint round trips: each run's final model and Adam state saved with Megatron's",
        "  dist_checkpointing (torch_dist) and loaded into a fresh model of the next strategy.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def _summarize_notices(opts, rank: int) -> None:
    """Notices that need no action as one line per kind, from rank 0 (megatron_fsdp_v2/notices.py)."""
    if not opts.verbose:
        summarize_notices(rank=rank)


def _worker(rank: int, world: int, opts, port: int) -> None:
    _summarize_notices(opts, rank)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from testing.cpu_compat import (
            destroy_megatron_parallel_state,
            init_megatron_parallel_state,
            patch_megatron_for_cpu,
        )

        with patch_megatron_for_cpu():
            init_megatron_parallel_state(world, seed=opts.seed)
            try:
                if rank == 0:
                    print(_heading(opts, world), flush=True)
                batches = _batches(opts, rank)
                rows = [_run(opts, batches, name, rank) for name in (REFERENCE, *STRATEGY_NAMES)]
                for i, row in enumerate(rows[1:]):
                    target = STRATEGY_NAMES[(i + 1) % len(STRATEGY_NAMES)]
                    row["reloaded"] = (target, *_reload(opts, row["strategy"], target))
                if rank == 0:
                    print()
                    print(_table(rows, opts, world), flush=True)
            finally:
                destroy_megatron_parallel_state()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    opts = _parse(argv)
    _summarize_notices(opts, 0)
    start = time.time()
    import torch.multiprocessing as mp

    opts.ckpt_root = tempfile.mkdtemp(prefix="megatron_fsdp_v2_demo_")
    try:
        mp.spawn(_worker, args=(opts.nproc, opts, _free_port()), nprocs=opts.nproc, join=True)
    finally:
        shutil.rmtree(opts.ckpt_root, ignore_errors=True)
    print(f"\ndone in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
