"""``benchmarks/bench_gpt.py``'s checks of the losses it times: a run whose loss is not finite
fails, and each system's losses are compared with the first system's (all train from the same
weights on the same batch)."""

import math

from tests.benchmark_modules import load_benchmark_module

load_benchmark_module("bench_setup")
bench_gpt = load_benchmark_module("bench_gpt")


def test_a_loss_that_is_not_finite_fails_the_run_naming_the_step():
    assert bench_gpt.non_finite_loss([10.8, 10.3, 9.9]) is None
    assert bench_gpt.non_finite_loss([10.8, 10.3, math.nan, math.nan]) == \
        "loss not finite from step 2 on (of 4, warm-up included)"
    assert bench_gpt.non_finite_loss([math.inf]) == "loss not finite from step 0 on (of 1, warm-up included)"


def test_losses_are_compared_with_the_first_system_that_trained():
    results = [dict(name="oom", status="OOM"),
               dict(name="ref", status="ok", losses=[10.766, 10.313, 9.939, 9.443]),
               dict(name="same", status="ok", losses=[10.766, 10.313, 9.939, 9.443]),
               dict(name="drift", status="ok", losses=[10.766, 10.313, 9.939, 9.545]),
               dict(name="failed", status="error", losses=[10.766, math.nan])]
    assert bench_gpt.loss_agreement(results) == [
        "loss of same against ref's: at most 0.0000 apart (step 0)",
        "loss of drift against ref's: at most 0.1020 apart (step 3)"]
    assert bench_gpt.loss_agreement(results[:2]) == []
