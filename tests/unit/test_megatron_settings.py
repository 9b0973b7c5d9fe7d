"""Every field of Megatron-Core 0.19.2's ``DistributedDataParallelConfig`` and ``OptimizerConfig``
is honoured, refused naming its field and flag, or warned about once (settings.py's table).

In the parent: the table covers every field of both dataclasses (a field Megatron adds fails here),
every flag in it is one of Megatron-LM's, refusals name field, value and flag, a no-effect setting
warns once and Megatron's defaults warn nothing, docs/megatron_settings.md holds the table. On 2 gloo
ranks (tiny GPTModel): ``grad_norm_skip_threshold`` skips the step as Megatron does,
``megatron_fsdp_main_params_dtype=None`` keeps bf16 main weights (no separate copy), refusals raise
on every rank, the launcher refuses the offload flags by name and warns nothing at its defaults, and
README's CPU command (testing/pretrain_gpt_cpu.py) passes Megatron-LM's argument validation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import re
import types
import warnings

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402
from tests.unit.test_megatron_adapter import _expect_error  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = types.SimpleNamespace(bf16=False, fp16=False, params_dtype=torch.float32, pipeline_model_parallel_size=1)


def _tables():
    from megatron_fsdp_v2.megatron import settings

    return settings


def _ddp(**kwargs):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**kwargs)


def _refusal(**kwargs) -> str:
    settings = _tables()
    strategy = kwargs.pop("data_parallel_sharding_strategy", "optim")
    with pytest.raises(ValueError) as info:
        settings.check_ddp_config(_ddp(data_parallel_sharding_strategy=strategy, **kwargs), MODEL)
    return str(info.value)


# ---------------------------------------------------------------- the table is complete
def test_every_config_field_has_a_verdict():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    settings = _tables()
    for config, table in ((DistributedDataParallelConfig, settings.DDP_SETTINGS),
                          (OptimizerConfig, settings.OPTIMIZER_SETTINGS)):
        fields = [f.name for f in dataclasses.fields(config)]
        assert sorted(fields) == sorted(table), (config.__name__, set(fields) ^ set(table))
        for name, setting in table.items():
            assert setting.field == name and setting.what, name
            if setting.verdict is not settings.Verdict.HONOURED:
                assert setting.why or setting.when is not settings._DEFAULT, name   # a refusal says why


def test_every_flag_is_one_of_megatrons():
    import argparse

    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options = {o for action in parser._actions for o in action.option_strings}
    settings = _tables()
    for setting in [*settings.DDP_SETTINGS.values(), *settings.OPTIMIZER_SETTINGS.values()]:
        for flag in re.findall(r"--[a-z0-9-]+", setting.flag or ""):
            assert flag in options, (setting.field, flag)


def test_docs_hold_the_table_and_readme_links_it():
    doc = (REPO / "docs" / "megatron_settings.md").read_text()
    assert _tables().settings_markdown() in doc
    assert "docs/megatron_settings.md" in (REPO / "README.md").read_text()


# ---------------------------------------------------------------- refused: field, value and flag
def test_refusals_name_the_field_its_value_and_flag():
    assert _refusal(check_for_large_grads=True) == (
        "FullyShardedDataParallel does not support: check_for_large_grads=True (--check-for-large-grads): "
        "Megatron's check runs its rerun state machine on each DDP bucket's gradient norm; this wrapper has "
        "no DDP buckets (check_for_nan_in_grad is supported).")
    assert ("reduce_scatter_with_fp32_accumulation=True (--ddp-reduce-scatter-with-fp32-accumulation)"
            in _refusal(reduce_scatter_with_fp32_accumulation=True))
    assert "delay_wgrad_compute=True (--delay-wgrad-compute)" in _refusal(delay_wgrad_compute=True)
    assert ("megatron_fsdp_use_decoupled_grad=True (set by --use-precision-aware-optimizer)"
            in _refusal(megatron_fsdp_use_decoupled_grad=True))
    assert "megatron_fsdp_main_grads_dtype=torch.bfloat16 (--megatron-fsdp-main-grads-dtype): it must equal " \
           "megatron_fsdp_main_params_dtype (torch.float32)" in _refusal(megatron_fsdp_main_grads_dtype=torch.bfloat16)
    both = _refusal(check_for_large_grads=True, nccl_ub=True)
    assert "check_for_large_grads=True" in both and "nccl_ub=True (--use-nccl-ub)" in both
    # accepted: the distributed optimizer with every strategy (Megatron-FSDP's validation forces it), bf16 main
    # grads with bf16 main weights
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        _tables().check_ddp_config(_ddp(use_distributed_optimizer=True, data_parallel_sharding_strategy=strategy), MODEL)
    bf16 = types.SimpleNamespace(**{**vars(MODEL), "bf16": True})
    _tables().check_ddp_config(_ddp(megatron_fsdp_main_params_dtype=None,
                                    megatron_fsdp_main_grads_dtype=torch.bfloat16), bf16)


def test_offload_is_honoured_and_precision_aware_optimizer_without_it_is_refused_by_flag():
    settings = _tables()
    settings.check_optimizer_config({"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True,
                                     "optimizer_offload_fraction": 0.5}, "optim")     # no error
    with pytest.raises(ValueError, match=r"get_optimizer: FullyShardedDataParallel does not support "
                                         r"use_precision_aware_optimizer=True \(--use-precision-aware-optimizer\)"):
        settings.check_optimizer_config({"use_precision_aware_optimizer": True}, "optim")
    with pytest.raises(ValueError, match=r"optimizer='soap' \(--optimizer\)"):
        settings.check_optimizer_config({"optimizer": "soap"}, "optim")
    settings.check_optimizer_config({"optimizer": "muon"}, "optim")       # honoured (megatron/muon.py)
    for strategy in ("no_shard", "optim_grads"):       # as Megatron-FSDP: the strategy decides what is sharded
        settings.check_optimizer_config({"use_distributed_optimizer": True}, strategy)


# ---------------------------------------------------------------- no effect: warns once
def test_no_effect_settings_warn_once_naming_field_and_flag():
    settings = _tables()
    settings._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings.check_ddp_config(_ddp(), MODEL)                       # Megatron's defaults: nothing to say
        settings.check_ddp_config(_ddp(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True,
                                       overlap_param_gather=True, use_distributed_optimizer=True), MODEL)
        assert [str(w.message) for w in caught] == []
        for _ in range(2):
            settings.check_ddp_config(_ddp(bucket_size=1000, average_in_collective=True), MODEL)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2, texts
    assert texts[0].startswith("megatron_fsdp_v2: ddp_config.bucket_size=1000 (--ddp-bucket-size): communication is "
                               "per unit (fsdp_unit_modules")
    assert texts[0].endswith("this setting has no effect here (docs/megatron_settings.md).")
    assert texts[1].startswith("megatron_fsdp_v2: ddp_config.average_in_collective=True (--ddp-average-in-collective)")


# ---------------------------------------------------------------- 2 ranks: honoured, refused, launcher
LAUNCHER_ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "5", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
    "--transformer-impl", "local",
]


def _build(strategy, config_overrides=None, **ddp_kwargs):
    from megatron_fsdp_v2.megatron import FullyShardedDataParallel
    from tests.megatron_cpu import build_tiny_gpt

    model, config = build_tiny_gpt(1234, vocab=64, seq=16, **(config_overrides or {}))
    return FullyShardedDataParallel(config, _ddp(data_parallel_sharding_strategy=strategy, **ddp_kwargs), model), config


def _steps(wrapped, config, optimizer, batches):
    """Two iterations of Megatron's schedule and optimizer step: [(update_successful, grad_norm)]."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.megatron_cpu import forward_step_func

    config.finalize_model_grads_func = finalize_model_grads
    out = []
    for it in range(2):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step_func, data_iterator=iter(batches[2 * it:2 * it + 2]),
                                    model=[wrapped], num_microbatches=2, seq_length=16, micro_batch_size=2,
                                    forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        out.append((bool(ok), float(grad_norm)))
    config.finalize_model_grads_func = None
    return out


def _moved(before, after) -> float:
    return max((after[k].float() - before[k].float()).abs().max().item() for k in before)


def _skip_and_main_dtype(batches):
    from megatron.core.optimizer import OptimizerConfig

    from megatron_fsdp_v2.megatron import get_optimizer
    from tests.megatron_cpu import constant_param_scheduler

    out = {}
    for strategy in ("no_shard", "optim_grads_params"):
        for threshold in (1e-3, 1e9, math.inf):
            wrapped, config = _build(strategy)
            optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                      grad_norm_skip_threshold=threshold), [wrapped])
            constant_param_scheduler(optimizer, 1e-2, 0.0)
            before = wrapped.state_dict()
            steps = _steps(wrapped, config, optimizer, batches)
            out[("skip", strategy, threshold)] = (steps, _moved(before, wrapped.state_dict()), type(optimizer).__name__)
        # megatron_fsdp_main_params_dtype=None: the bf16 compute weights are the main weights
        wrapped, config = _build(strategy, {"bf16": True}, megatron_fsdp_main_params_dtype=None)
        dtypes = wrapped.module._fsdp_engine.groups[0].dtypes
        out[("clip_bf16", strategy)] = _expect_error(
            lambda: get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=1.0), [wrapped]))
        optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, clip_grad=0.0), [wrapped])
        before = wrapped.state_dict()
        steps = _steps(wrapped, config, optimizer, batches)
        out[("main_none", strategy)] = ((dtypes.compute, dtypes.main, dtypes.grad), {p.dtype for p in wrapped.parameters()},
                                        wrapped.persistent_bytes(), steps, _moved(before, wrapped.state_dict()))
        fp32, _ = _build(strategy, {"bf16": True})
        out[("main_fp32", strategy)] = fp32.persistent_bytes()
    return out


def readme_cpu_command() -> list:
    """The arguments of README's CPU command (``torchrun ... testing/pretrain_gpt_cpu.py ARGS``)."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"```bash\ntorchrun --nproc-per-node 2 testing/pretrain_gpt_cpu\.py (.*?)```", text, re.S)
    assert match, "README has no CPU command for testing/pretrain_gpt_cpu.py"
    return match.group(1).replace("\\\n", " ").split()


def _launcher(world_size):
    from megatron.training import training

    from examples import pretrain_gpt

    from megatron.training import arguments

    out = {}
    # Megatron-LM's parsing and validation; with --use-megatron-fsdp it reads the GPU generation: Hopper's
    saved, arguments.get_device_arch_version = arguments.get_device_arch_version, lambda: 9
    try:
        readme = pretrain_gpt.parse_args(readme_cpu_command())
    finally:
        arguments.get_device_arch_version = saved
    out["readme_cpu"] = (readme.data_parallel_sharding_strategy, readme.distributed_backend, readme.train_iters,
                         readme.megatron_fsdp_command_line, readme.ckpt_format_fsdp_dtensor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = pretrain_gpt.parse_args(LAUNCHER_ARGS)
        from megatron_fsdp_v2.megatron import check_ddp_config, settings

        settings._WARNED.clear()
        check_ddp_config(training.get_megatron_ddp_config(args), types.SimpleNamespace(**vars(MODEL)))
        check_optimizer = settings.check_optimizer_config
        check_optimizer(vars(args), args.data_parallel_sharding_strategy)
    out["default_warnings"] = [str(w.message) for w in caught if "megatron_fsdp_v2" in str(w.message)]
    out["--use-precision-aware-optimizer"] = _expect_error(
        lambda: pretrain_gpt.parse_args(LAUNCHER_ARGS + ["--use-precision-aware-optimizer"]))
    offload = pretrain_gpt.parse_args(LAUNCHER_ARGS + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                                                       "--use-distributed-optimizer", "--optimizer-offload-fraction",
                                                       "0.5"])
    out["offload_args"] = (offload.optimizer_cpu_offload, offload.optimizer_offload_fraction,
                           offload.use_precision_aware_optimizer,
                           training.get_megatron_ddp_config(offload).megatron_fsdp_use_decoupled_grad)
    no_shard = pretrain_gpt.parse_args(
        LAUNCHER_ARGS + ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "no_shard"])
    out["no_shard_distopt"] = (no_shard.use_distributed_optimizer, no_shard.data_parallel_sharding_strategy)
    return out


def settings_worker(rank, world_size):
    from tests.megatron_cpu import (destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, synthetic_batches)

    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            out = _skip_and_main_dtype(synthetic_batches(100 + rank, 4, 2, 16, 64))
            out["refused_on_every_rank"] = _expect_error(lambda: _build("optim", check_for_large_grads=True))
            out.update(_launcher(world_size))
        finally:
            destroy_megatron_parallel_state()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(settings_worker, 2, timeout=300)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_grad_norm_skip_threshold_skips_the_step_like_megatron(two_ranks, strategy):
    for out in two_ranks:
        skipped, moved, kind = out[("skip", strategy, 1e-3)]
        assert [ok for ok, _ in skipped] == [False, False] and all(norm > 1e-3 for _, norm in skipped)
        assert moved == 0.0 and kind == "ChainedOptimizer"
        stepped, moved, kind = out[("skip", strategy, 1e9)]
        assert [ok for ok, _ in stepped] == [True, True] and moved > 0 and kind == "ChainedOptimizer"
        plain, moved_plain, kind = out[("skip", strategy, math.inf)]
        assert kind == "DistributedOptimizer" and moved_plain == moved    # same update through the chain
        assert [n for _, n in plain] == [n for _, n in stepped]


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_main_params_dtype_none_keeps_no_separate_main_weights(two_ranks, strategy):
    bf16 = torch.bfloat16
    for out in two_ranks:
        dtypes, main_dtypes, nbytes, steps, moved = out[("main_none", strategy)]
        assert dtypes == (bf16, bf16, bf16) and main_dtypes == {bf16}
        assert all(ok for ok, _ in steps) and moved > 0
        assert "clip_grad=1.0 (--clip-grad): the main weights (and their gradients) are torch.bfloat16" in \
            out[("clip_bf16", strategy)]
        fp32 = out[("main_fp32", strategy)]
        assert nbytes["total"] < fp32["total"]
        if strategy == "no_shard":      # the compute weights are the main weights: no second copy
            assert nbytes["model_weights"] == 0 and fp32["model_weights"] > 0


def test_refusal_raises_on_every_rank(two_ranks):
    errors = [out["refused_on_every_rank"] for out in two_ranks]
    assert errors[0] == errors[1] and "check_for_large_grads=True (--check-for-large-grads)" in errors[0]


def test_readme_cpu_command_is_a_valid_launch(two_ranks):
    """README's way to run the Megatron path without a GPU names a script that exists and a
    Megatron-FSDP command line Megatron-LM's validation accepts (test_doc_snippets.py runs it)."""
    assert (REPO / "testing" / "pretrain_gpt_cpu.py").is_file()
    assert two_ranks[0]["readme_cpu"] == ("optim_grads", "gloo", 4, True, True)


def test_launcher_takes_offload_refuses_precision_aware_alone_and_is_quiet_at_defaults(two_ranks):
    out = two_ranks[0]
    assert out["default_warnings"] == []
    assert "use_precision_aware_optimizer=True (--use-precision-aware-optimizer)" in \
        out["--use-precision-aware-optimizer"]
    # offload parses; the precision-aware flag Megatron demands with it is cleared, so the wrapper's
    # ddp_config asks for no decoupled gradients
    assert out["offload_args"] == (True, 0.5, False, False)
    assert out["no_shard_distopt"] == (True, "no_shard")      # Megatron-FSDP's no_shard: replicated optimizer state
