"""50 iterations of a Megatron GPT (4 layers, hidden 512, seq 512, vocab 4096, bf16, k=4 micro-batches) with
every strategy: the loss curve stays within 1% of Megatron DDP's at every iteration, live and
against the golden curves stored per GPU type and world size; two identical runs are bitwise equal.

The curves are trained once per session and shared by the tests below (``harness.curve``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from . import harness
from .checks import assert_no_failures, curve_table
from .harness import LOSS_RTOL, REFERENCE, STRATEGIES

GOLDEN_HINT = ("`torchrun --nproc-per-node={n} -m tests.functional.regenerate_golden` trains and records them; "
               "`python -m tests.functional.regenerate_golden --from $FUNCTIONAL_RESULTS_DIR/losses_measured.json` "
               "records the curves a finished run measured")


def test_reference_trains(world):
    """Megatron DDP's loss is finite and falls: otherwise 'within 1%' would compare flat lines."""
    ref = harness.curve(REFERENCE, world)
    spec = harness.loss_spec()
    assert len(ref.losses) == spec.iters
    assert all(math.isfinite(x) for x in ref.losses), ref.losses
    if not harness.smoke_mode():
        assert ref.losses[-1] < 0.9 * ref.losses[0], (
            f"Megatron DDP did not train: loss {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f} over {spec.iters} "
            f"iterations")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loss_curve_within_1pct_of_megatron_ddp(world, strategy):
    ref = harness.curve(REFERENCE, world)
    ours = harness.curve(strategy, world)
    assert len(ours.losses) == len(ref.losses) == harness.loss_spec().iters
    assert all(math.isfinite(x) for x in ours.losses), ours.losses
    gaps = harness.relative_gaps(ours.losses, ref.losses)
    bad = [i for i, gap in enumerate(gaps) if gap > LOSS_RTOL]
    assert not bad, (
        f"{strategy} ({ours.path}) differs from Megatron DDP by more than {100 * LOSS_RTOL:g}% at iterations "
        f"{bad[:10]} (worst {100 * max(gaps):.3f}%):\n{curve_table(ours.losses, ref.losses, strategy, 'ddp')}")


@pytest.mark.parametrize("name", (REFERENCE,) + STRATEGIES)
def test_loss_curve_within_1pct_of_golden(world, name):
    path = harness.golden_path()
    entry = harness.load_golden(path).get(world.gpu_name, {}).get(str(world.size))
    if entry is None or name not in entry:
        pytest.skip(f"no golden loss curve for {name!r} on {world.gpu_name!r} at world size {world.size} in "
                    f"{os.path.relpath(path)}: " + GOLDEN_HINT.format(n=world.size))
    recorded = entry.get("_meta", {}).get("spec")
    spec = harness.loss_spec().as_dict()
    if recorded is not None and recorded != spec:
        changed = sorted(k for k in set(spec) | set(recorded) if spec.get(k) != recorded.get(k))
        pytest.fail(f"the golden curves for {world.gpu_name!r} / world size {world.size} were recorded with a "
                    f"different model or training setup (changed: {changed}); regenerate them: "
                    + GOLDEN_HINT.format(n=world.size), pytrace=False)
    want = entry[name]
    got = harness.curve(name, world).losses
    assert len(got) == len(want), f"golden has {len(want)} iterations, this run {len(got)}"
    gaps = harness.relative_gaps(got, want)
    bad = [i for i, gap in enumerate(gaps) if gap > LOSS_RTOL]
    assert not bad, (
        f"{name} differs from its golden curve ({world.gpu_name}, world size {world.size}) by more than "
        f"{100 * LOSS_RTOL:g}% at iterations {bad[:10]} (worst {100 * max(gaps):.3f}%):\n"
        f"{curve_table(got, want, 'now', 'golden')}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_identical_runs_are_bitwise_identical(world, strategy):
    """Deterministic algorithms on, same seeds and data: losses, grad norms and the final full weights
    of a second run equal the first bit for bit."""
    assert torch.are_deterministic_algorithms_enabled()
    first = harness.curve(strategy, world, repeat=0)
    second = harness.curve(strategy, world, repeat=1)
    failures = []
    diff = [i for i, (a, b) in enumerate(zip(first.losses, second.losses)) if a != b]
    if diff or len(first.losses) != len(second.losses):
        i = diff[0] if diff else 0
        failures.append(f"losses differ at iterations {diff[:10]} (first: {first.losses[i]!r} vs "
                        f"{second.losses[i]!r})")
    if [repr(x) for x in first.grad_norms] != [repr(x) for x in second.grad_norms]:
        failures.append("grad norms differ: "
                        f"{[(i, a, b) for i, (a, b) in enumerate(zip(first.grad_norms, second.grad_norms)) if repr(a) != repr(b)][:3]}")
    if first.digest != second.digest:
        failures.append(f"final weights differ (sha256 {first.digest[:16]} vs {second.digest[:16]})")
    assert_no_failures(failures, f"{strategy}: two identical runs are not bitwise identical")
