"""Switching from Megatron-FSDP (``use_megatron_fsdp``) and back: its ``--ckpt-format fsdp_dtensor``
checkpoints (megatron_fsdp_v2/megatron/checkpoint/fsdp_dtensor_format.py) on a tiny GPT (CPU, gloo; Megatron-FSDP
runs there under the test-only patches of testing/megatron_fsdp_cpu.py).

* Megatron-FSDP (ZeRO-3, dp 2) trains 2 iterations, writes the checkpoint exactly as Megatron-LM's
  ``save_checkpoint`` does for fsdp_dtensor (``generate_state_dict``, ``preprocess_fsdp_dtensor_state_dict``,
  ``torch.distributed.checkpoint.save``), trains 2 more.
* We load it at dp 2 (every strategy) and dp 1: weights, Adam's exp_avg / exp_avg_sq and step equal
  the saved tensors bitwise; at dp 2 the next iterations give Megatron-FSDP's losses and weights.
* The way back: our save in that layout loads into Megatron-FSDP with Megatron-LM's own load steps,
  and it continues with our losses.
* Unsupported models are refused on every rank, naming the flag.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402
from tests.unit.test_megatron_distopt_checkpoint import (MORE_ITERS, NMB, SAVED_ITERS, SEQ, VOCAB,  # noqa: E402
                                                        _batches, _iterate)

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _opt_config(strategy: str = "optim", bf16: bool = False):
    """Adam with the distributed optimizer, as a Megatron-FSDP run has it for every strategy; bf16:
    fp32 main parameters and optimizer state."""
    from tests.unit.test_megatron_adapter import LR_ADAM, _opt_config

    del strategy
    return _opt_config("adam", LR_ADAM, use_distributed_optimizer=True, bf16=bf16)
#: what Megatron-LM's save_checkpoint / load_checkpoint read from args for fsdp_dtensor
ARGS = SimpleNamespace(ckpt_format="fsdp_dtensor", no_save_optim=False, swiglu=False, num_experts=None,
                       use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=False, no_save_rng=True)


def _gpt(seed, bf16=False):
    """The tiny GPT; with ``bf16`` in ``Float16Module``, as Megatron-LM's get_model wraps it."""
    from megatron.core.transformer.module import Float16Module

    from tests.megatron_cpu import build_tiny_gpt

    model, config = build_tiny_gpt(seed, vocab=VOCAB, seq=SEQ, bf16=bf16)
    return (Float16Module(config, model) if bf16 else model), config


def _megatron_fsdp(seed, bf16=False):
    """A tiny GPT in Megatron-FSDP (ZeRO-3) and its DistributedOptimizer (inside the patches)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer

    model, config = _gpt(seed, bf16)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                               data_parallel_sharding_strategy="optim_grads_params",
                                               gradient_reduce_div_fusion=False)
    wrapped = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model, device=torch.device("cpu"))
    return wrapped, config, get_megatron_optimizer(_opt_config(bf16=bf16), [wrapped])


def _full_weights(wrapped) -> dict:
    """Megatron-FSDP's weights, whole (its own ``uneven_dtensor_to_full_tensor`` all-gathers uneven
    pieces, which gloo refuses: the pieces travel as objects here)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    out = {}
    for key, value in wrapped.state_dict().items():
        if value is None or key.endswith("_extra_state"):
            continue
        pieces = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(pieces, (gather_and_compute_chunk_metadata(value).offsets,
                                                     value.to_local().detach().clone()))
        full = torch.zeros(value.shape, dtype=value.dtype)
        for offsets, piece in pieces:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
        out[key] = full
    return out


def _megatron_lm_save(wrapped, optimizer, path):
    """Megatron-LM's save_checkpoint for fsdp_dtensor, less its RNG and scheduler state."""
    from megatron.training import checkpointing

    state = checkpointing.generate_state_dict(ARGS, [wrapped], optimizer, None, None, iteration=SAVED_ITERS)
    state = checkpointing.preprocess_fsdp_dtensor_state_dict(ARGS, state, wrapped)
    torch.distributed.checkpoint.save(state, storage_writer=torch.distributed.checkpoint.FileSystemWriter(path))


@contextlib.contextmanager
def steps_in_param_groups(optimizer):
    """Adam's step as Transformer Engine's FusedAdam keeps it: one number per param group, none in
    the state (what Megatron-FSDP checkpoints on GPUs hold); put back on exit."""
    inner = optimizer.optimizer
    steps = {p: state.pop("step") for p, state in inner.state.items()}
    for group in inner.param_groups:
        group["step"] = int(next(iter(steps.values())).item())
    try:
        yield
    finally:
        for p, step in steps.items():
            inner.state[p]["step"] = step
        for group in inner.param_groups:
            del group["step"]


def megatron_fsdp_save_worker(rank, world_size, path, bf16=False):
    from megatron.core import parallel_state as ps

    from testing.megatron_fsdp_cpu import fill_empty_optimizer_states, megatron_fsdp_on_cpu
    from tests.megatron_cpu import destroy_megatron_parallel_state, init_megatron_parallel_state, patch_megatron_for_cpu

    with patch_megatron_for_cpu(), megatron_fsdp_on_cpu():
        init_megatron_parallel_state(world_size)
        try:
            dp_rank = ps.get_data_parallel_rank()
            wrapped, config, optimizer = _megatron_fsdp(1234, bf16)
            _iterate(wrapped, config, optimizer, _batches(dp_rank, 0, SAVED_ITERS * NMB))
            fill_empty_optimizer_states(optimizer)
            _megatron_lm_save(wrapped, optimizer, path)
            if bf16:                # the keys are what the bf16 case checks
                return None
            with steps_in_param_groups(optimizer):          # Transformer Engine's FusedAdam keeps them there
                _megatron_lm_save(wrapped, optimizer, path + "_fused_adam")
            losses = _iterate(wrapped, config, optimizer, _batches(dp_rank, SAVED_ITERS * NMB, MORE_ITERS * NMB))
            return {"losses": losses, "weights": {_bare(k): v for k, v in _full_weights(wrapped).items()}}
        finally:
            destroy_megatron_parallel_state()


def _saved_objects(path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = os.path.join(path, "..", os.path.basename(path) + ".pt")
    dcp_to_torch_save(path, target)
    return torch.load(target, weights_only=False)


def _saved_tensors(path) -> dict:
    """The checkpoint's tensors, whole, under our names: ``<name>`` and ``state.<name>.<key>``."""
    flat, out = _saved_objects(path), {}
    for key, value in flat["model"].items():
        out[_bare(key)] = value
    for name, state in flat["optimizer"]["state"].items():
        for sub, value in state.items():
            out[f"state.{_bare(name)}.{sub}"] = value
    return out


def _bare(key: str) -> str:
    """A key without the wrappers' ``module.`` prefixes (Megatron-FSDP's, Float16Module's)."""
    head = "state." if key.startswith("state.") else ""
    return head + re.sub(r"^(module\.)+", "", key[len(head):])


def our_load_worker(rank, world_size, path, strategies, continue_, bf16=False):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from megatron_fsdp_v2.megatron.checkpoint.fsdp_dtensor_format import load_fsdp_dtensor_checkpoint
    from tests.megatron_cpu import destroy_megatron_parallel_state, init_megatron_parallel_state, patch_megatron_for_cpu
    from tests.state_gather import full_optimizer_state

    out = {}
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            for strategy in strategies:
                model, config = _gpt(77, bf16)
                wrapper = FullyShardedDataParallel(
                    config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy), model)
                optimizer = get_optimizer(_opt_config(strategy, bf16), [wrapper])
                load_fsdp_dtensor_checkpoint(path, wrapper, optimizer)
                got = dict(wrapper.state_dict())
                got.update(full_optimizer_state(wrapper, optimizer, wrapper.dp_group))
                result = {"state": {_bare(k): v.clone() for k, v in got.items()
                                    if not k.endswith("_extra_state") and k != "class"}}
                if continue_:
                    result["losses"] = _iterate(wrapper, config, optimizer, _batches(
                        ps.get_data_parallel_rank(), SAVED_ITERS * NMB, MORE_ITERS * NMB))
                    result["weights"] = {k: v.clone() for k, v in wrapper.state_dict().items()
                                         if not k.endswith("_extra_state")}
                out[strategy] = result
        finally:
            destroy_megatron_parallel_state()
    return out


@pytest.fixture(scope="module")
def megatron_fsdp_checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp_dtensor")
    path = str(base / f"iter_{SAVED_ITERS:07d}")        # where Megatron-LM's save_checkpoint puts it
    megatron = run_distributed(megatron_fsdp_save_worker, 2, path, timeout=300, fresh=True)
    (base / "latest_checkpointed_iteration.txt").write_text(str(SAVED_ITERS))
    return path, megatron, _saved_tensors(path)


def _check_equal(saved, got):
    assert {k for k in got if not k.endswith(".step")} <= set(saved), sorted(set(got) - set(saved))[:5]
    unequal = [k for k, v in got.items() if k in saved and not torch.equal(saved[k].to(v.dtype), v)]
    assert unequal == [], unequal[:5]
    assert {float(v) for k, v in got.items() if k.endswith(".step")} == {float(SAVED_ITERS)}
    assert sum(v.numel() for k, v in got.items() if k.endswith(".exp_avg_sq")) > 20000


def test_megatron_fsdp_checkpoint_loads_at_dp2_and_continues(megatron_fsdp_checkpoint):
    path, megatron, saved = megatron_fsdp_checkpoint
    results = run_distributed(our_load_worker, 2, path, STRATEGIES, True, timeout=300)
    for rank, out in enumerate(results):
        for strategy in STRATEGIES:
            _check_equal(saved, out[strategy]["state"])
            torch.testing.assert_close(torch.tensor(out[strategy]["losses"]), torch.tensor(megatron[rank]["losses"]),
                                       rtol=1e-5, atol=1e-6)
            for key, value in megatron[rank]["weights"].items():
                torch.testing.assert_close(out[strategy]["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_megatron_fsdp_checkpoint_loads_at_dp1(megatron_fsdp_checkpoint):
    path, _, saved = megatron_fsdp_checkpoint
    (out,) = run_distributed(our_load_worker, 1, path, ("optim_grads_params", "no_shard"), False, timeout=300)
    for strategy in ("optim_grads_params", "no_shard"):
        _check_equal(saved, out[strategy]["state"])


def test_fused_adam_step_in_param_to_group_meta_is_read(megatron_fsdp_checkpoint):
    path, _, saved = megatron_fsdp_checkpoint
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path + "_fused_adam").read_metadata().state_dict_metadata
    assert not any(k.startswith("optimizer.state.") and k.endswith(".step") for k in keys)
    assert "optimizer.param_to_group_meta.module.module.decoder.layers.0.mlp.linear_fc1.weight.step" in keys
    (out,) = run_distributed(our_load_worker, 1, path + "_fused_adam", ("optim",), False, timeout=300)
    _check_equal(saved, out["optim"]["state"])


# ---------------------------------------------------------------- the way back
def our_save_worker(rank, world_size, path, strategy, bf16=False):
    """Ours: train 2 iterations, save in the fsdp_dtensor layout, train 2 more."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from megatron_fsdp_v2.megatron.checkpoint.fsdp_dtensor_format import save_fsdp_dtensor_checkpoint
    from tests.megatron_cpu import destroy_megatron_parallel_state, init_megatron_parallel_state, patch_megatron_for_cpu

    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            dp_rank = ps.get_data_parallel_rank()
            model, config = _gpt(1234, bf16)
            wrapper = FullyShardedDataParallel(
                config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy), model)
            optimizer = get_optimizer(_opt_config(strategy, bf16), [wrapper])
            _iterate(wrapper, config, optimizer, _batches(dp_rank, 0, SAVED_ITERS * NMB))
            save_fsdp_dtensor_checkpoint(path, wrapper, optimizer, iteration=SAVED_ITERS)
            return _iterate(wrapper, config, optimizer, _batches(dp_rank, SAVED_ITERS * NMB, MORE_ITERS * NMB))
        finally:
            destroy_megatron_parallel_state()


def megatron_fsdp_load_worker(rank, world_size, path):
    """Megatron-FSDP loads it as Megatron-LM's load_checkpoint does for fsdp_dtensor (the state dict of
    ``generate_state_dict(is_loading=True)``, ``preprocess_fsdp_dtensor_state_dict``, DCP's load with
    partial loads allowed, ``load_state_dict``), then trains on."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model
    from megatron.training import checkpointing
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from testing.megatron_fsdp_cpu import fill_empty_optimizer_states, megatron_fsdp_on_cpu
    from tests.megatron_cpu import destroy_megatron_parallel_state, init_megatron_parallel_state, patch_megatron_for_cpu

    with patch_megatron_for_cpu(), megatron_fsdp_on_cpu():
        init_megatron_parallel_state(world_size)
        try:
            wrapped, config, optimizer = _megatron_fsdp(77)
            leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
            for leaf in leaves:
                leaf._init_optimizer_states_with_dummy_values()
            fill_empty_optimizer_states(optimizer)
            kwargs = dict(metadata=checkpointing._build_sharded_state_dict_metadata(ARGS), is_loading=True)
            raw = checkpointing.generate_state_dict(ARGS, unwrap_model([wrapped]), optimizer, None, None,
                                                    optim_sd_kwargs=kwargs, iteration=1)
            state = checkpointing.preprocess_fsdp_dtensor_state_dict(ARGS, dict(raw), unwrap_model(wrapped))
            torch.distributed.checkpoint.load_state_dict(state_dict=state, storage_reader=FileSystemReader(path),
                                                         planner=DefaultLoadPlanner(allow_partial_load=True))
            try:                # load_checkpoint's load_model_state_dict: strict, then not
                wrapped.load_state_dict(raw["model"], strict=True)
            except Exception:
                wrapped.load_state_dict(raw["model"], strict=False)
            optimizer.load_state_dict(raw["optimizer"])
            steps = {float(s["step"]) for leaf in leaves for s in leaf.optimizer.state.values()}
            losses = _iterate(wrapped, config, optimizer, _batches(ps.get_data_parallel_rank(), SAVED_ITERS * NMB,
                                                                   MORE_ITERS * NMB))
            return {"losses": losses, "steps": steps, "iteration": state["iteration"]}
        finally:
            destroy_megatron_parallel_state()


@pytest.mark.parametrize("strategy", ["optim_grads_params"])
def test_megatron_fsdp_loads_our_fsdp_dtensor_checkpoint_and_continues(tmp_path, strategy):
    path = str(tmp_path / "iter_2")
    ours = run_distributed(our_save_worker, 2, path, strategy, timeout=300)
    megatron = run_distributed(megatron_fsdp_load_worker, 2, path, timeout=300, fresh=True)
    args = _saved_objects(path)["args"]            # what Megatron-LM's check_checkpoint_args reads
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 32, 4)
    for rank in range(2):
        assert megatron[rank]["steps"] == {float(SAVED_ITERS)} and megatron[rank]["iteration"] == SAVED_ITERS
        torch.testing.assert_close(torch.tensor(megatron[rank]["losses"]), torch.tensor(ours[rank]),
                                   rtol=1e-5, atol=1e-6)


def _tensor_keys(path) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    return {k for k in FileSystemReader(path).read_metadata().state_dict_metadata
            if k.startswith(("model.", "optimizer.state."))}


def test_bf16_keys_under_float16module(tmp_path):
    """bf16: Megatron-LM wraps the GPT in Float16Module inside Megatron-FSDP, so the optimizer's keys
    carry one more ``module.`` (the model's do not: Float16Module's state dict adds none); we load
    them (fp32 main weights and moments bitwise) and write the same keys."""
    megatron, ours = str(tmp_path / "megatron"), str(tmp_path / "ours")
    run_distributed(megatron_fsdp_save_worker, 2, megatron, True, timeout=300, fresh=True)
    keys = _tensor_keys(megatron)
    assert "model.module.decoder.layers.0.mlp.linear_fc1.weight" in keys
    assert "optimizer.state.module.module.module.decoder.layers.0.mlp.linear_fc1.weight.exp_avg" in keys
    saved = _saved_tensors(megatron)
    for out in run_distributed(our_load_worker, 2, megatron, ("optim_grads_params",), False, True, timeout=300):
        _check_equal(saved, out["optim_grads_params"]["state"])
    run_distributed(our_save_worker, 2, ours, "optim_grads_params", True, timeout=300)
    assert _tensor_keys(ours) == _tensor_keys(megatron)


# ---------------------------------------------------------------- refused
def refusal_worker(rank, world_size, path, overrides, tp=1):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from megatron_fsdp_v2.megatron.checkpoint.fsdp_dtensor_format import load_fsdp_dtensor_checkpoint
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu)

    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size, tensor_model_parallel_size=tp)
        try:
            model, config = build_tiny_gpt(77, vocab=VOCAB, seq=SEQ, tensor_model_parallel_size=tp, **overrides)
            wrapper = FullyShardedDataParallel(
                config, DistributedDataParallelConfig(data_parallel_sharding_strategy="optim"), model)
            try:
                load_fsdp_dtensor_checkpoint(path, wrapper, get_optimizer(_opt_config("optim"), [wrapper]))
            except ValueError as exc:
                return str(exc)
            return None
        finally:
            destroy_megatron_parallel_state()


def test_unsupported_models_are_refused_on_every_rank(megatron_fsdp_checkpoint):
    path, _, _ = megatron_fsdp_checkpoint
    for message in run_distributed(refusal_worker, 2, path, {"gated_linear_unit": True}, timeout=300):
        assert message is not None and "--swiglu (gated_linear_unit)" in message, message
    for message in run_distributed(refusal_worker, 2, path, {"num_layers": 3}, timeout=300):
        assert message is not None and "missing parameters ['decoder.layers.2." in message, message
    for message in run_distributed(refusal_worker, 2, path, {}, 2, timeout=300):
        assert message is not None and "tensor/pipeline-parallel sizes (2, 1) is not supported" in message, message


# ---------------------------------------------------------------- the launcher
def launcher_load_worker(rank, world_size, base, flags):
    """The launcher's ``--load`` (Megatron-LM's ``load_checkpoint``, wrapped) of the fsdp_dtensor
    directory; returns (iteration, our state) or the error."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.training import training
    from megatron.training.global_vars import destroy_global_vars, set_global_variables

    from examples.pretrain_gpt import parse_args, use_fully_sharded_data_parallel
    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu)
    from tests.state_gather import full_optimizer_state
    from tests.unit.test_megatron_adapter import LAUNCHER_ARGS

    with patch_megatron_for_cpu("megatron.training.checkpointing"):
        init_megatron_parallel_state(world_size)
        try:
            set_global_variables(parse_args(LAUNCHER_ARGS + ["--load", base, "--no-load-rng",
                                                             "--use-cpu-initialization"] + flags),
                                 build_tokenizer=False)
            model, config = build_tiny_gpt(77, vocab=VOCAB, seq=SEQ)
            wrapper = FullyShardedDataParallel(
                config, DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads"), model)
            optimizer = get_optimizer(_opt_config("optim_grads"), [wrapper])
            try:
                with use_fully_sharded_data_parallel():
                    iteration, _ = training.load_checkpoint([wrapper], optimizer, None)
            except ValueError as exc:
                return str(exc)
            state = dict(wrapper.state_dict())
            state.update(full_optimizer_state(wrapper, optimizer, wrapper.dp_group))
            return iteration, {k: v.clone() for k, v in state.items() if k != "class"}
        finally:
            destroy_global_vars()
            destroy_megatron_parallel_state()


@pytest.mark.parametrize("flags", [["--ckpt-format", "fsdp_dtensor"], ["--auto-detect-ckpt-format"]])
def test_launcher_load_of_a_megatron_fsdp_checkpoint_resumes_with_optimizer_state(megatron_fsdp_checkpoint, flags):
    path, _, saved = megatron_fsdp_checkpoint
    for iteration, state in run_distributed(launcher_load_worker, 2, os.path.dirname(path), flags, timeout=300):
        assert iteration == SAVED_ITERS
        _check_equal(saved, state)


def test_launcher_refuses_an_fsdp_dtensor_directory_without_the_format_flag(megatron_fsdp_checkpoint):
    path, _, _ = megatron_fsdp_checkpoint
    for message in run_distributed(launcher_load_worker, 2, os.path.dirname(path), [], timeout=300):
        assert isinstance(message, str) and "holds a fsdp_dtensor checkpoint" in message, message
        assert "--auto-detect-ckpt-format" in message, message


def test_launcher_refuses_saving_fsdp_dtensor_where_the_layout_cannot_hold_the_model():
    """--save in fsdp_dtensor: dense GPT layers without --swiglu at tensor- and pipeline-parallel
    size 1 (the launcher's save itself: tests/unit/test_megatron_fsdp_command_line.py)."""
    from examples.pretrain_gpt import check_launcher_args

    args = dict(ckpt_format_fsdp_dtensor=True, save="/ckpt", load="/ckpt", ckpt_format="torch_dist",
                data_parallel_sharding_strategy="optim")
    check_launcher_args(SimpleNamespace(**args))
    for flag, value in (("swiglu", True), ("num_experts", 4), ("tensor_model_parallel_size", 2),
                        ("pipeline_model_parallel_size", 2)):
        with pytest.raises(ValueError, match=r"--ckpt-format fsdp_dtensor --save writes dense GPT layers without "
                                             r"--swiglu at tensor- and pipeline-parallel size 1, got --"):
            check_launcher_args(SimpleNamespace(**args, **{flag: value}))
    check_launcher_args(SimpleNamespace(**dict(args, save=None), swiglu=True))     # --load alone: refused there
