"""Megatron's optimizer offload flags through ``get_optimizer`` and the launcher (CPU, gloo, 2 ranks).

``optimizer_cpu_offload`` / ``optimizer_offload_fraction`` / ``overlap_cpu_optimizer_d2h_h2d`` map to
our ``OffloadPolicy`` (``adapter.offload_policy``); ``get_optimizer`` offloads the chunks' groups and
steps with torch's fused Adam on each device. Fractions 0, 0.5 and 1 train bitwise alike (fp32)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:  # find_spec: no 6 s import in the parent
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

FRACTIONS = (0.0, 0.5, 1.0)
OFFLOAD_FLAGS = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5", "--overlap-cpu-optimizer-d2h-h2d",
                 "--use-precision-aware-optimizer", "--use-distributed-optimizer"]


def _offload_config(fraction, **kwargs):
    from tests.unit.test_megatron_adapter import ADAM_EPS, LR_ADAM, _opt_config

    del ADAM_EPS
    return _opt_config("adam", LR_ADAM, optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                       use_precision_aware_optimizer=True, use_distributed_optimizer=True, **kwargs)


def _run(strategy, fraction, batches):
    from megatron_fsdp_v2.megatron import get_optimizer
    from tests.megatron_cpu import constant_param_scheduler
    from tests.unit.test_megatron_adapter import LR_ADAM, WD, _build, _train

    wrapped, config = _build(strategy)
    optimizer = get_optimizer(_offload_config(fraction), [wrapped])
    constant_param_scheduler(optimizer, LR_ADAM, WD)
    result = _train(wrapped, config, batches, optimizer, megatron_optimizer=True)
    groups = wrapped.module._fsdp_engine.groups
    inner = optimizer.optimizer
    on_host = {p.device.type for g in groups if g.offloaded is not None for p in g.main_params}
    result.update(offloaded=sum(g.offloaded is not None for g in groups), groups=len(groups), host_params=on_host,
                  inner=(type(inner).__name__, inner.defaults.get("fused")), bytes=wrapped.persistent_bytes())
    return result


def _errors():
    from megatron_fsdp_v2.megatron.adapter import offload_policy

    out = {}
    for name, (fraction, kwargs) in (("fraction", (1.5, {})), ("pins", (1.0, dict(pin_cpu_grads=False)))):
        try:
            offload_policy(_offload_config(fraction, **kwargs))
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _launcher():
    from megatron.training.training import get_megatron_optimizer_config

    from examples import pretrain_gpt
    from megatron_fsdp_v2.megatron.adapter import offload_policy
    from tests.unit.test_megatron_adapter import LAUNCHER_ARGS

    args = pretrain_gpt.parse_args(LAUNCHER_ARGS + OFFLOAD_FLAGS)
    config = get_megatron_optimizer_config(args)
    config = config[0] if isinstance(config, tuple) else config
    return repr(offload_policy(config))


def offload_worker(rank, world_size):
    from tests.megatron_cpu import (destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, synthetic_batches)
    from tests.unit.test_megatron_adapter import DATA_SEED, ITERS, MBS, NMB, SEQ, VOCAB

    out = {}
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            batches = synthetic_batches(DATA_SEED + rank, ITERS * NMB, MBS, SEQ, VOCAB)
            for strategy in ("optim_grads_params", "no_shard"):
                for fraction in FRACTIONS:
                    out[(strategy, fraction)] = _run(strategy, fraction, batches)
            out["errors"] = _errors()
            out["launcher"] = _launcher()
        finally:
            destroy_megatron_parallel_state()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(offload_worker, 2, timeout=240)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_megatron_offload_fraction_trains_bitwise_alike(results, strategy):
    for result in results:
        base = result[(strategy, 0.0)]
        assert base["offloaded"] == 0 and base["inner"] == ("AdamW", True)
        for fraction in (0.5, 1.0):
            run = result[(strategy, fraction)]
            assert run["losses"] == base["losses"] and run["grad_norms"] == base["grad_norms"]
            for name, value in base["state"].items():
                assert torch.equal(run["state"][name], value), (strategy, fraction, name)
            assert run["host_params"] == {"cpu"}
        assert 0 < result[(strategy, 0.5)]["offloaded"] < result[(strategy, 1.0)]["offloaded"]
        assert result[(strategy, 1.0)]["offloaded"] == result[(strategy, 1.0)]["groups"]
        assert result[(strategy, 1.0)]["bytes"]["main_weights"] == 0 < result[(strategy, 1.0)]["bytes"]["host_total"]
        assert base["losses"][-1] < base["losses"][0]
        if strategy == "optim_grads_params":      # reduced grads live on the host only (Megatron keeps grads)
            assert base["bytes"]["grads"] > 0 and result[(strategy, 1.0)]["bytes"]["grads"] == 0


def test_megatron_offload_settings_are_checked_naming_them(results):
    errors = results[0]["errors"]
    assert "optimizer_offload_fraction (--optimizer-offload-fraction) must be a number with 0 <= fraction <= 1, " \
           "got 1.5" in errors["fraction"]
    assert "pin_cpu_params (True) and pin_cpu_grads (False) must agree" in errors["pins"]


def test_launcher_flags_reach_the_offload_policy(results):
    assert results[0]["launcher"] == ("OffloadPolicy(fraction=0.5, pin_memory=True, overlap=True, "
                                      "step_in_backward=False, step_threads=None, release_after_gather=False)")
