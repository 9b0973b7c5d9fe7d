"""GPU validation of Megatron-LM's checkpointing with our wrapper: ``--save`` / ``--load``
(``--ckpt-format torch_dist``) through the launcher ``examples/pretrain_gpt.py`` (under ``torchrun``).

For every (saved strategy S, loaded strategy T) pair of ``--pairs``:

* reference: S trains ``--iters`` iterations without a break;
* save:      S trains to ``--iters / 2`` and saves (``--save DIR --save-interval H --exit-interval H``);
* resume:    T loads DIR (``--nproc-load`` processes, so the data-parallel size may change) and
             trains to ``--iters``.

It passes when every resumed run starts at iteration H + 1 and its losses for iterations H+1..end
are within ``--rtol`` of the reference's. Megatron-LM resets its loss accumulator only from the
second iteration of a run on (``should_reset = not is_first_iteration`` in ``training_log``), so
every run's second logged loss is the mean of its first two iterations: the resumed run's value at
H + 2 is compared with the mean of the reference's H + 1 and H + 2. A control run loads with
``--no-load-optim`` (fresh Adam state): its losses show how far off a run with lost optimizer
state would be.

Usage (on a GPU node)::

    python benchmarks/validate_megatron_checkpoint.py [--nproc-save N --nproc-load M]

Recorded results: docs/validation.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "examples", "pretrain_gpt.py")
# the launcher runs as a script (sys.path[0] = examples/): give it this checkout's megatron_fsdp_v2
LAUNCHER_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))

MODEL_ARGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
              "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 "
              "--lr 1e-3 --min-lr 1e-3 --lr-decay-style constant --bf16 --vocab-size 4096 --mock-data "
              "--log-interval 1 --eval-iters 0 --eval-interval 1000 --transformer-impl local "
              "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion --split 100,0,0")

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")


def pretrain(strategy: str, nproc: int, iters: int, extra: list, port: int) -> tuple:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
           LAUNCHER, "--data-parallel-sharding-strategy", strategy,
           "--train-iters", str(iters), *MODEL_ARGS.split(), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=LAUNCHER_ENV)
    out = proc.stdout + proc.stderr
    losses = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(out)}
    if proc.returncode != 0:
        print(out[-4000:])
    if os.environ.get("SHOW_LOG"):
        print("\n".join(line[:400] for line in out.splitlines() if "iteration" in line or "loading" in line.lower()))
    return proc.returncode, losses, time.perf_counter() - t0


def worst_rel(got: dict, want: dict, iterations) -> float:
    """Worst relative difference of a resumed run's losses; its second logged loss is the mean of
    its first two iterations (see the module docstring)."""
    first = min(iterations)
    expected = {i: (want[i - 1] + want[i]) / 2 if i == first + 1 else want[i] for i in iterations}
    return max(abs(got[i] - expected[i]) / abs(expected[i]) for i in iterations)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="optim_grads_params:optim_grads_params,optim_grads_params:no_shard,"
                                           "no_shard:optim,optim:optim_grads")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--nproc-save", type=int, default=1)
    parser.add_argument("--nproc-load", type=int, default=1)
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args()
    half = args.iters // 2
    after = range(half + 1, args.iters + 1)
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    root = tempfile.mkdtemp(prefix="mfsdp2_ckpt_")
    ok, references, saved = True, {}, {}
    print(f"iterations 1..{args.iters}, save at {half}; dp {args.nproc_save} -> {args.nproc_load}; rtol {args.rtol}")
    for source, target in pairs:
        if source not in references:
            rc, references[source], secs = pretrain(source, args.nproc_save, args.iters, [], 29611)
            print(f"reference {source}: exit {rc}, {secs:.0f} s, losses "
                  + " ".join(f"{references[source].get(i, float('nan')):.5f}" for i in after))
            directory = os.path.join(root, source)
            rc2, first, secs = pretrain(source, args.nproc_save, args.iters,
                                        ["--save", directory, "--save-interval", str(half),
                                         "--exit-interval", str(half)], 29612)
            saved[source] = directory
            written = os.path.join(directory, f"iter_{half:07d}")
            files = sorted(os.listdir(written)) if os.path.isdir(written) else "none"
            print(f"save {source} at {half}: exit {rc2}, {secs:.0f} s, iterations logged {sorted(first)}, "
                  f"files {files}")
            ok &= rc == 0 and rc2 == 0 and max(first, default=0) == half and files != "none"
            ok &= all(first[i] == references[source][i] for i in first)
        rc, resumed, secs = pretrain(target, args.nproc_load, args.iters, ["--load", saved[source]], 29613)
        good = rc == 0 and min(resumed, default=0) == half + 1 and all(i in resumed for i in after)
        rel = worst_rel(resumed, references[source], after) if good else float("nan")
        good &= rel <= args.rtol
        print(f"resume {source} -> {target}: exit {rc}, {secs:.0f} s, first iteration {min(resumed, default=None)}, "
              f"losses " + " ".join(f"{resumed.get(i, float('nan')):.5f}" for i in after)
              + f", worst relative difference {rel:.2e}: {'ok' if good else 'FAILED'}")
        ok &= good
    source = pairs[0][0]
    rc, control, _ = pretrain(source, args.nproc_load, args.iters, ["--load", saved[source], "--no-load-optim"],
                              29614)
    if rc == 0 and all(i in control for i in after):
        print(f"control {source} --no-load-optim (fresh Adam state): worst relative difference "
              f"{worst_rel(control, references[source], after):.2e}")
    shutil.rmtree(root, ignore_errors=True)
    print("CHECKPOINT VALIDATION", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
