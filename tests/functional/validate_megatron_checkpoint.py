"""GPU validation of Megatron-LM's checkpointing with our wrapper: ``--save`` / ``--load``
(``--ckpt-format torch_dist``) through the launcher ``examples/pretrain_gpt.py`` (under ``torchrun``),
conclusive also when the data-parallel size changes between save and load.

For every direction N -> M (``--nproc-save N --nproc-load M``; ``--both-directions`` adds M -> N) and
every (saved strategy S, loaded strategy T) pair of ``--pairs``, with dropout off
(``--attention-dropout 0 --hidden-dropout 0``):

* runs from scratch, first: every strategy at every size the pairs use (S@N, T@M) trains ``--iters``
  iterations without a break, saving at H = ``--iters / 2`` on the way (``--save DIR
  --save-interval H``; saving does not interrupt it). S@N is the pair's reference; the others are
  correct runs whose numerics differ (reduction order with the data-parallel size, strategy): the
  largest difference of any of them to the reference over H+1..end is the pair's *noise*;
* state check: T@M loads the reference's iteration H (``--load DIR --ckpt-step H``), trains no
  iteration (``--train-iters H``) and saves right away; the saved model and optimizer tensors
  (fp32 main weights, ``exp_avg``, ``exp_avg_sq``, each read back as one global tensor,
  so independent of the sharding) and the optimizer's common state must equal the reference's
  iteration-H checkpoint *bitwise*;
* resume: T@M loads iteration H and trains to ``--iters``;
* control (once per direction, first pair): like the resume but ``--no-load-optim`` (fresh Adam
  state).

A pair passes when every run exits 0, the state is bitwise equal, the resumed run starts at H + 1,
its first loss is within ``--rtol-floor`` of the reference's (bitwise equal weights: only the fp32
order of the loss reduction differs), and its worst relative loss difference over H+1..end is within
``max(--noise-factor x noise, --rtol-floor)``. The direction is conclusive only if the control's
difference exceeds every pair's tolerance (a resume that lost the optimizer state would fail); an
inconclusive direction fails. Megatron-LM resets its loss accumulator only from the second
iteration of a run on (``should_reset = not is_first_iteration`` in ``training_log``), so a resumed
run's second logged loss is the mean of its first two iterations and is compared with the mean of
the reference's H + 1 and H + 2. docs/validation.md derives the tolerance.

Usage (on a GPU node with 2 GPUs)::

    python -m tests.functional.validate_megatron_checkpoint --nproc-save 2 --nproc-load 1 --both-directions

``--cpu``: the same runs on CPU (gloo, a smaller model) through ``testing/pretrain_gpt_cpu.py`` (the
launcher under Megatron's CPU patches): a dry run of the logic, not a validation of GPU numerics.

Recorded results: docs/validation.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "examples", "pretrain_gpt.py")
# the launcher runs as a script (sys.path[0] = examples/): give it this checkout's megatron_fsdp_v2
LAUNCHER_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))

NO_DROPOUT = "--attention-dropout 0 --hidden-dropout 0"
COMMON_ARGS = ("--lr 1e-3 --min-lr 1e-3 --lr-decay-style constant --bf16 --mock-data "
               "--log-interval 1 --eval-iters 0 --eval-interval 1000 --transformer-impl local "
               "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion --split 100,0,0 "
               + NO_DROPOUT)
MODEL_ARGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
              "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 --vocab-size 4096 "
              + COMMON_ARGS)
CPU_MODEL_ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                  "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --vocab-size 512 "
                  "--use-cpu-initialization --distributed-backend gloo " + COMMON_ARGS)

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")
CPU_LAUNCHER = os.path.join(REPO, "testing", "pretrain_gpt_cpu.py")     # the launcher on CPU (gloo)

# Checkpoint entries that are not training state: Megatron's RNG and rerun-machine state (per rank,
# so they depend on the data-parallel size; byte entries, like the local layers' ``_extra_state``,
# which are not compared either); the common state is read on its own.
NOT_STATE = ("rng_state", "rerun_state_machine_state", "common_state")


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


class Run(NamedTuple):
    rc: int
    losses: Dict[int, float]
    seconds: float
    log: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pretrain(strategy: str, nproc: int, iters: int, extra: list, cpu: bool) -> Run:
    """One ``torchrun`` of the launcher (on CPU: of testing/pretrain_gpt_cpu.py, the launcher on gloo)."""
    target = [CPU_LAUNCHER] if cpu else [LAUNCHER]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           *target, "--data-parallel-sharding-strategy", strategy, "--train-iters", str(iters),
           *(CPU_MODEL_ARGS if cpu else MODEL_ARGS).split(), *extra]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=LAUNCHER_ENV)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                      for x in (exc.stdout, exc.stderr)) + "\n(timed out after 600 s)"
    losses = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(out)}
    if rc != 0:
        print(" ".join(cmd))
        print(out[-4000:])
    if os.environ.get("SHOW_LOG"):
        print("\n".join(line[:400] for line in out.splitlines()
                        if "iteration" in line or "loading" in line.lower() or "saving" in line.lower()))
    return Run(rc, losses, time.perf_counter() - t0, out)


# ---------------------------------------------------------------------------------------------
# State: global tensors of a torch_dist checkpoint, independent of how it was sharded
# ---------------------------------------------------------------------------------------------


class CheckpointState(NamedTuple):
    tensors: Dict[str, "torch.Tensor"]     # noqa: F821 - every model and optimizer tensor, global shape
    common: dict                           # {"optimizer": Megatron's common optimizer state, "iteration": int}


def read_checkpoint(directory: str) -> CheckpointState:
    """Every tensor of the DCP checkpoint in ``directory`` (one ``iter_NNNNNNN`` folder of
    ``--ckpt-format torch_dist``) as one global tensor, assembled from whatever chunks the saving
    ranks wrote, plus the optimizer part and iteration of Megatron's common state. Reads our own
    freshly written files: Megatron's common state holds its argparse namespace, so it is unpickled
    with ``weights_only=False``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(directory)
    entries = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in entries.items()
             if isinstance(meta, TensorStorageMetadata) and not key.startswith(NOT_STATE)}
    common_keys = [key for key in entries if key.startswith("common_state")]
    state.update((key, io.BytesIO()) for key in common_keys)
    with warnings.catch_warnings():     # "torch.distributed is disabled ... a single process": intended
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    common = {}
    for key in common_keys:
        value = state.pop(key)
        while isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if isinstance(value, dict):
            common.update(value)
    legacy = os.path.join(directory, "common.pt")        # older Megatron: common state in its own file
    if not common and os.path.exists(legacy):
        common = torch.load(legacy, map_location="cpu", weights_only=False)
    return CheckpointState(state, {"optimizer": common.get("optimizer"), "iteration": common.get("iteration")})


def _tensor_bytes(tensor) -> bytes:
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fingerprint(state: CheckpointState) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (sorted by name): equal fingerprints
    <=> bitwise equal tensors, whatever the data-parallel size and strategy that wrote them."""
    digest = hashlib.sha256()
    for key in sorted(state.tensors):
        tensor = state.tensors[key]
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def _first_difference(a, b, path: str) -> Optional[str]:
    """Where nested common state ``a`` and ``b`` first differ (tensors bitwise), or None."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and _tensor_bytes(a) == _tensor_bytes(b))
        return None if same else f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))[:5]} in one only"
        for key in a:
            found = _first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if (type(a) is type(b) and a == b) else f"{path}: {a!r} != {b!r}"


class StateComparison(NamedTuple):
    equal: bool
    tensors: int                  # tensors compared
    elements: int
    first_difference: Optional[str]   # the first differing tensor (sorted by name) and how, or None
    fingerprints: Tuple[str, str]


def compare_states(want: CheckpointState, got: CheckpointState) -> StateComparison:
    """Bitwise comparison of two checkpoints' global tensors and common optimizer state."""
    import torch

    problem = None
    missing, extra = sorted(want.tensors.keys() - got.tensors.keys()), sorted(got.tensors.keys() - want.tensors.keys())
    if missing or extra:
        problem = f"tensors missing {missing[:5]}, unexpected {extra[:5]}"
    for key in sorted(want.tensors.keys() & got.tensors.keys()):
        if problem:
            break
        a, b = want.tensors[key], got.tensors[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            problem = f"{key}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        elif _tensor_bytes(a) != _tensor_bytes(b):
            diff = (a.double() - b.double()).abs()
            differing = int((a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1)
                             != b.reshape(-1).view(torch.uint8).reshape(b.numel(), -1)).any(dim=1).sum())
            problem = f"{key}: {differing} of {a.numel()} elements differ, max abs diff {float(diff.max()):.3e}"
    if not problem:
        problem = _first_difference(want.common, got.common, "common")
    return StateComparison(problem is None, len(want.tensors), sum(t.numel() for t in want.tensors.values()),
                           problem, (fingerprint(want), fingerprint(got)))


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def worst_rel(got: dict, want: dict, iterations) -> float:
    """Worst relative difference of a resumed run's losses; its second logged loss is the mean of
    its first two iterations (see the module docstring)."""
    first = min(iterations)
    expected = {i: (want[i - 1] + want[i]) / 2 if i == first + 1 else want[i] for i in iterations}
    return max(rel(got[i], expected[i]) for i in iterations)


def noise_floor(other: dict, reference: dict, iterations) -> float:
    """Worst relative difference of two uninterrupted runs over ``iterations``."""
    return max(rel(other[i], reference[i]) for i in iterations)


def tolerance(noise: float, factor: float, floor: float) -> float:
    return max(factor * noise, floor)


def _losses(losses: dict, iterations) -> str:
    return " ".join(f"{losses.get(i, float('nan')):.6f}" for i in iterations)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


class Validation:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.half = args.iters // 2
        self.after = range(self.half + 1, args.iters + 1)
        self.root = tempfile.mkdtemp(prefix="mfsdp2_ckpt_")
        self.references: Dict[Tuple[str, int], Run] = {}
        self.saved_states: Dict[Tuple[str, int], CheckpointState] = {}
        self.summary: List[str] = []

    def ckpt_dir(self, strategy: str, nproc: int) -> str:
        return os.path.join(self.root, f"ref_{strategy}_dp{nproc}")

    def reference(self, strategy: str, nproc: int) -> Optional[Run]:
        """S@N for ``--iters`` iterations from scratch, saving at H (cached: a reference and a noise sample)."""
        key = (strategy, nproc)
        if key not in self.references:
            directory = self.ckpt_dir(strategy, nproc)
            run = pretrain(strategy, nproc, self.args.iters,
                           ["--save", directory, "--save-interval", str(self.half)], self.args.cpu)
            written = os.path.join(directory, f"iter_{self.half:07d}")
            ok = run.rc == 0 and os.path.isdir(written) and all(i in run.losses for i in range(1, self.args.iters + 1))
            print(f"from scratch {strategy}@{nproc}: exit {run.rc}, {run.seconds:.0f} s, saved iteration {self.half}: "
                  f"{'yes' if os.path.isdir(written) else 'NO'}, losses {self.half + 1}..{self.args.iters} "
                  f"{_losses(run.losses, self.after)}")
            self.references[key] = run if ok else None
            if ok:
                self.saved_states[key] = read_checkpoint(written)
        return self.references[key]

    def load_args(self, source: str, nproc_save: int) -> list:
        return ["--load", self.ckpt_dir(source, nproc_save), "--ckpt-step", str(self.half)]

    def state_after_load(self, source: str, target: str, n: int, m: int) -> Optional[StateComparison]:
        """T@M loads S@N's iteration H, trains nothing and saves it again at once."""
        directory = os.path.join(self.root, f"state_{source}_dp{n}_to_{target}_dp{m}")
        # --override-opt_param-scheduler: the scheduler's step counts derive from --train-iters,
        # which is H here (Megatron would refuse the checkpoint's); lr and wd are constant anyway.
        run = pretrain(target, m, self.half, [*self.load_args(source, n), "--override-opt_param-scheduler",
                                              "--save", directory, "--save-interval", str(10 * self.args.iters)],
                       self.args.cpu)
        written = os.path.join(directory, f"iter_{self.half:07d}")
        if run.rc != 0 or not os.path.isdir(written) or run.losses:
            print(f"  state run: exit {run.rc}, saved {os.path.isdir(written)}, "
                  f"trained iterations {sorted(run.losses)}")
            return None
        result = compare_states(self.saved_states[(source, n)], read_checkpoint(written))
        shutil.rmtree(directory, ignore_errors=True)
        return result

    def noise(self, source: str, n: int) -> Tuple[float, str]:
        """Worst relative difference over the resumed iterations of every other run from scratch
        (other strategies and sizes) to the reference S@N: the drift of correct runs whose
        numerics differ (reduction order, strategy); and which run it was."""
        reference = self.references[(source, n)].losses
        found = [(noise_floor(run.losses, reference, self.after), f"{strategy}@{size}")
                 for (strategy, size), run in sorted(self.references.items())
                 if run is not None and (strategy, size) != (source, n)]
        return max(found, default=(0.0, "none"))

    def direction(self, n: int, m: int, pairs: list) -> bool:
        args, after, half = self.args, self.after, self.half
        print(f"\n=== dp {n} -> {m}: iterations 1..{args.iters}, saved at {half}, resumed {half + 1}..{args.iters} ===")
        ok, tolerances, rows = True, [], []
        for source, target in pairs:
            name = f"{source}@{n} -> {target}@{m}"
            print(f"--- {name}")
            if self.references.get((source, n)) is None or self.references.get((target, m)) is None:
                rows.append(f"{name}: reference run FAILED")
                ok = False
                continue
            want = self.references[(source, n)].losses
            noise, noisiest = self.noise(source, n)
            tol = tolerance(noise, args.noise_factor, args.rtol_floor)
            tolerances.append(tol)
            state = self.state_after_load(source, target, n, m)
            if state is None:
                state_text = "state run FAILED"
            elif state.equal:
                state_text = (f"bitwise equal: yes ({state.tensors} tensors, {state.elements:,} elements, common "
                              f"optimizer state; sha256 {state.fingerprints[0][:16]} = {state.fingerprints[1][:16]})")
            else:
                state_text = f"bitwise equal: NO, first difference {state.first_difference}"
            print(f"  state right after load vs saved: {state_text}")
            resumed = pretrain(target, m, args.iters, self.load_args(source, n), args.cpu)
            good = (resumed.rc == 0 and min(resumed.losses, default=0) == half + 1
                    and all(i in resumed.losses for i in after))
            first = rel(resumed.losses[half + 1], want[half + 1]) if good else float("nan")
            worst = worst_rel(resumed.losses, want, after) if good else float("nan")
            print(f"  losses {half + 1}..{args.iters}: reference {_losses(want, after)}\n"
                  f"                resumed   {_losses(resumed.losses, after)} (exit {resumed.rc}, "
                  f"{resumed.seconds:.0f} s, first iteration {min(resumed.losses, default=None)})")
            print(f"  first resumed iteration: relative difference {first:.2e} (limit {args.rtol_floor:.0e}); "
                  f"worst {worst:.2e}, tolerance {tol:.2e} = max({args.noise_factor:g} x noise {noise:.2e} "
                  f"(from {noisiest}), {args.rtol_floor:.0e})")
            passed = bool(state and state.equal) and good and first <= args.rtol_floor and worst <= tol
            print(f"  {'passed' if passed else 'FAILED'}")
            ok &= passed
            rows.append((name, state, first, worst, tol, passed))
        # control: the first pair without the optimizer state
        source, target = pairs[0]
        control = None
        if self.references.get((source, n)) is not None:
            run = pretrain(target, m, args.iters, [*self.load_args(source, n), "--no-load-optim"], args.cpu)
            if run.rc == 0 and all(i in run.losses for i in after):
                control = worst_rel(run.losses, self.references[(source, n)].losses, after)
                print(f"control {source}@{n} -> {target}@{m} --no-load-optim (fresh Adam state): losses "
                      f"{_losses(run.losses, after)}, worst relative difference {control:.2e}")
        conclusive = control is not None and all(control > tol for tol in tolerances)
        control_text = "FAILED run" if control is None else f"{control:.2e}"
        print(f"control difference {control_text} vs largest tolerance {max(tolerances, default=float('nan')):.2e}: "
              f"{'conclusive' if conclusive else 'INCONCLUSIVE'}")
        for row in rows:
            if isinstance(row, str):
                self.summary.append(row)
                continue
            name, state, first, worst, tol, passed = row
            bitwise = "FAILED run" if state is None else ("yes" if state.equal else f"NO ({state.first_difference})")
            self.summary.append(
                f"{name}: state bitwise equal {bitwise}; first loss rel diff {first:.1e}; worst loss rel diff "
                f"{worst:.2e} {'<=' if worst <= tol else '>'} tol {tol:.2e}; control {control_text} "
                f"{'>' if control is not None and control > tol else '<='} tol: "
                f"{'PASSED' if passed and conclusive else 'FAILED'}")
        return ok and conclusive

    def main(self) -> bool:
        args = self.args
        pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
        directions = [(args.nproc_save, args.nproc_load)]
        if args.both_directions and args.nproc_save != args.nproc_load:
            directions.append((args.nproc_load, args.nproc_save))
        print(f"{'CPU dry run, ' if args.cpu else ''}dropout off; pairs {args.pairs}; noise factor "
              f"{args.noise_factor:g}, tolerance floor {args.rtol_floor:.0e}")
        needed = {(source, n) for n, _ in directions for source, _ in pairs}
        needed |= {(target, m) for _, m in directions for _, target in pairs}
        try:
            print("\n=== runs from scratch (references, and the noise of their differences) ===")
            for strategy, size in sorted(needed, key=lambda key: (key[1], key[0])):
                self.reference(strategy, size)
            ok = all([self.direction(n, m, pairs) for n, m in directions])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        print("\nsummary:\n  " + "\n  ".join(self.summary))
        print("CHECKPOINT VALIDATION", "PASSED" if ok else "FAILED")
        return ok


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="optim_grads_params:optim_grads_params,optim_grads_params:no_shard,"
                                           "no_shard:optim,optim:optim_grads")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--nproc-save", type=int, default=1)
    parser.add_argument("--nproc-load", type=int, default=1)
    parser.add_argument("--both-directions", action="store_true",
                        help="also run --nproc-load -> --nproc-save (references are shared)")
    parser.add_argument("--noise-factor", type=float, default=10.0,
                        help="loss tolerance = max(factor x noise, --rtol-floor); noise: the largest worst "
                             "relative difference over the resumed iterations of another run from scratch (any "
                             "strategy and size of this invocation) to the reference")
    parser.add_argument("--rtol-floor", type=float, default=1e-5,
                        help="smallest loss tolerance; also the limit of the first resumed iteration")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU (gloo, smaller model)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(0 if Validation(parse_args()).main() else 1)
