"""Megatron's distributed checkpoints (``megatron.core.dist_checkpointing``, what Megatron-LM's
``--ckpt-format torch_dist`` writes) with ``FullyShardedDataParallel`` and ``get_optimizer``'s
Adam (``DistributedOptimizer`` on its ``use_megatron_fsdp`` path), on a tiny GPTModel, CPU, gloo.

* Save at dp 2 after 2 iterations for every strategy; in new processes load every checkpoint into
  every strategy at dp 2, and into other strategies at dp 1 and dp 4: weights and Adam state
  (moments and step, gathered to full tensors) equal the saved ones bitwise.
* Same strategy and dp: 2 more iterations after the load equal the continuous run bitwise.
* Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint`` (megatron.training.checkpointing)
  round-trip the wrapper and optimizer at dp 2 into another strategy.
* Checkpoints interchange with Megatron's own DDP (same keys: layers stacked under one key).
* ``megatron_fsdp_v2.megatron.save_checkpoint`` / ``load_checkpoint`` (the core's DCP format) take the wrapper and
  Megatron's optimizer; the core's own functions refuse them, naming the Megatron ones.
* Errors: a checkpoint of another model names the mis-shaped key (Megatron's check); a foreign optimizer dict names
  the format key; pipeline offsets are rejected.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SAVED_ITERS, MORE_ITERS, NMB, MBS, SEQ, VOCAB = 2, 2, 2, 2, 16, 64
DATA_SEED = 300
#: ``optim``'s checkpoint in our own optimizer layout, which save_dist_checkpoint wrote by default
#: before fully_reshardable: read, no longer written
EARLIER = "optim_in_our_earlier_layout"


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


def _model_and_optimizer(strategy, hidden=32, bf16=False):
    from megatron_fsdp_v2.megatron import get_optimizer
    from tests.megatron_cpu import build_tiny_gpt
    from tests.unit.test_megatron_adapter import LR_ADAM, _opt_config

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron_fsdp_v2.megatron import FullyShardedDataParallel

    model, config = build_tiny_gpt(1234, vocab=VOCAB, seq=SEQ, hidden=hidden, bf16=bf16)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    wrapper = FullyShardedDataParallel(config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy),
                                       model)
    return wrapper, config, get_optimizer(_opt_config("adam", LR_ADAM, bf16=bf16), [wrapper])


def _train(wrapper, config, optimizer, batches, iters):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.megatron_cpu import forward_step_func

    config.no_sync_func, config.finalize_model_grads_func = wrapper.no_sync, finalize_model_grads
    for it in range(iters):
        wrapper.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step_func,
                                    data_iterator=iter(batches[it * NMB:(it + 1) * NMB]), model=[wrapper],
                                    num_microbatches=NMB, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok
    config.no_sync_func = config.finalize_model_grads_func = None


def _full_state(wrapper, optimizer):
    """{"model": full weights, "optimizer": {state.name.key: full tensor}} gathered from every rank."""
    from tests.state_gather import full_optimizer_state

    return {"model": {k: v.clone() for k, v in wrapper.state_dict().items()},
            "optimizer": full_optimizer_state(wrapper, optimizer, wrapper.dp_group)}


@contextlib.contextmanager
def _megatron_on_cpu(world_size, rank, iters, *extra_modules):
    """Megatron patched for CPU, its parallel state for ``world_size`` ranks; yields this rank's batches."""
    from tests.megatron_cpu import (destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, synthetic_batches)

    with patch_megatron_for_cpu(*extra_modules):
        init_megatron_parallel_state(world_size)
        try:
            yield synthetic_batches(DATA_SEED + rank, iters * NMB, MBS, SEQ, VOCAB)
        finally:
            destroy_megatron_parallel_state()


def _save(wrapper, optimizer, path):
    from megatron_fsdp_v2.megatron import save_dist_checkpoint

    save_dist_checkpoint(path, wrapper, optimizer)


def _load(wrapper, optimizer, path):
    from megatron_fsdp_v2.megatron import load_dist_checkpoint

    load_dist_checkpoint(path, wrapper, optimizer)


def _error_cases(base):
    from megatron.core import dist_checkpointing

    errors = {}
    wrapper, _, optimizer = _model_and_optimizer("optim_grads", hidden=48)
    try:
        _load(wrapper, optimizer, os.path.join(base, "optim_grads"))
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        errors["other_model"] = f"{type(exc).__name__}: {exc}"
    wrapper, _, optimizer = _model_and_optimizer("optim_grads")
    try:
        optimizer.load_state_dict({"optimizer": {}, "param_state": {}})
    except ValueError as exc:
        errors["foreign_optimizer"] = str(exc)
    try:
        wrapper.sharded_state_dict(sharded_offsets=((0, 0, 2),))
    except ValueError as exc:
        errors["offsets"] = str(exc)
    loaded = dist_checkpointing.load({"model": wrapper.sharded_state_dict()}, os.path.join(base, "optim_grads"))
    errors["loads_model_only"] = sorted(wrapper.load_state_dict(loaded["model"]).missing_keys)
    full = wrapper.state_dict()
    full.pop("decoder.final_layernorm.bias")       # a small tensor, possibly in one rank's shard only
    try:
        wrapper.load_state_dict(full)
    except ValueError as exc:                      # on every rank (none may go on into a collective)
        errors["missing_full_key"] = str(exc)
    # a bit flipped in a shard file: save_dist_checkpoint's manifest catches it, on every rank
    source, flipped = os.path.join(base, "optim_grads"), os.path.join(base, "optim_grads_flipped")
    if torch.distributed.get_rank() == 0:
        shutil.copytree(source, flipped)
        shard = os.path.join(flipped, "__1_0.distcp")
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    torch.distributed.barrier()
    try:
        _load(wrapper, optimizer, flipped)
        errors["flipped"] = None
    except ValueError as exc:
        errors["flipped"] = f"{type(exc).__name__}: {exc}"
    return errors


def _loads_in_place(base):
    """(state tensors the optimizer holds after a load, of them the buffers dist_checkpointing
    loaded into): equal when the load installs them without a copy."""
    from megatron.core import dist_checkpointing

    from megatron_fsdp_v2.megatron import read_optimizer_layout
    from megatron_fsdp_v2.megatron.checkpoint.distopt_format import REQUESTS

    wrapper, _, optimizer = _model_and_optimizer("optim")
    model_sd = wrapper.sharded_state_dict()
    read_optimizer_layout(optimizer, os.path.join(base, "optim"))
    template = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
    targets = {box.data.data_ptr() for entry in template["optimizer"][REQUESTS].values() if isinstance(entry, dict)
               for box in entry.values()}
    loaded = dist_checkpointing.load(template, os.path.join(base, "optim"))
    optimizer.load_state_dict(loaded["optimizer"])
    held = [t.data_ptr() for state in optimizer.optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() > 0]
    return len(held), sum(ptr in targets for ptr in held)


def save_worker(rank, world_size, base):
    import megatron_fsdp_v2
    import megatron_fsdp_v2.megatron
    from tests.megatron_cpu import writing_our_earlier_optimizer_layout

    out = {}
    with _megatron_on_cpu(world_size, rank, SAVED_ITERS + MORE_ITERS) as batches:
        for strategy in STRATEGIES:
            wrapper, config, optimizer = _model_and_optimizer(strategy)
            _train(wrapper, config, optimizer, batches, SAVED_ITERS)
            _save(wrapper, optimizer, os.path.join(base, strategy))
            if strategy == "optim":         # as save_dist_checkpoint wrote it before fully_reshardable
                with writing_our_earlier_optimizer_layout(optimizer):
                    _save(wrapper, optimizer, os.path.join(base, EARLIER))
            if strategy == "optim_grads":   # the core's DCP format through the adapter's unwrapping helpers
                with pytest.raises(TypeError, match="megatron_fsdp_v2.megatron.save_checkpoint"):
                    megatron_fsdp_v2.save_checkpoint(os.path.join(base, "refused"), wrapper, optimizer)
                with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got"):
                    megatron_fsdp_v2.save_checkpoint(os.path.join(base, "refused"), wrapper.module, optimizer)
                megatron_fsdp_v2.megatron.save_checkpoint(os.path.join(base, "core_dcp"), wrapper, optimizer)
            saved = _full_state(wrapper, optimizer)
            _train(wrapper, config, optimizer, batches[SAVED_ITERS * NMB:], MORE_ITERS)
            out[strategy] = {"saved": saved, "continuous": _full_state(wrapper, optimizer)}
    out[EARLIER] = out["optim"]
    return out


def load_worker(rank, world_size, base, pairs, resume, errors):
    import megatron_fsdp_v2.megatron

    out = {}
    with _megatron_on_cpu(world_size, rank, SAVED_ITERS + MORE_ITERS) as batches:
        for saved, target in pairs:
            wrapper, config, optimizer = _model_and_optimizer(target)
            _load(wrapper, optimizer, os.path.join(base, saved))
            result = {"loaded": _full_state(wrapper, optimizer)}
            if resume and saved == target:
                _train(wrapper, config, optimizer, batches[SAVED_ITERS * NMB:], MORE_ITERS)
                result["resumed"] = _full_state(wrapper, optimizer)
            out[(saved, target)] = result
        if errors:
            out["errors"] = _error_cases(base)
            wrapper, _, optimizer = _model_and_optimizer("optim_grads_params")
            megatron_fsdp_v2.megatron.load_checkpoint(os.path.join(base, "core_dcp"), wrapper, optimizer)
            out["core_dcp"] = _full_state(wrapper, optimizer)
            out["in_place"] = _loads_in_place(base)
    return out


def megatron_lm_worker(rank, world_size, base, saved_strategy, loaded_strategy, bf16):
    """Megatron-LM's save_checkpoint / load_checkpoint (torch_dist) with our wrapper and optimizer."""
    from megatron.training import checkpointing
    from megatron.training.global_vars import destroy_global_vars, set_global_variables

    from examples.pretrain_gpt import parse_args
    from tests.unit.test_megatron_adapter import LAUNCHER_ARGS

    out = {}
    with _megatron_on_cpu(world_size, rank, SAVED_ITERS, "megatron.training.checkpointing") as batches:
        args = parse_args(LAUNCHER_ARGS + ["--save", base, "--load", base, "--save-interval", "2", "--no-save-rng",
                                           "--no-load-rng", "--use-cpu-initialization"])
        set_global_variables(args, build_tokenizer=False)
        # save_checkpoint reads the CUDA RNG state even with --no-save-rng (then drops it): CPU only.
        original_get_rng_state, checkpointing.get_rng_state = checkpointing.get_rng_state, lambda *a, **k: None
        try:
            wrapper, config, optimizer = _model_and_optimizer(saved_strategy, bf16=bf16)
            _train(wrapper, config, optimizer, batches, SAVED_ITERS)
            checkpointing.save_checkpoint(SAVED_ITERS, [wrapper], optimizer, None, 0)
            out["saved"] = _full_state(wrapper, optimizer)
            out["files"] = sorted(os.listdir(os.path.join(base, f"iter_{SAVED_ITERS:07d}")))
            wrapper, config, optimizer = _model_and_optimizer(loaded_strategy, bf16=bf16)
            out["fresh"] = _full_state(wrapper, optimizer)["model"]
            iteration, _ = checkpointing.load_checkpoint([wrapper], optimizer, None)
            out["iteration"] = iteration
            out["loaded"] = _full_state(wrapper, optimizer)
        finally:
            checkpointing.get_rng_state = original_get_rng_state
            destroy_global_vars()
    return out


def interop_worker(rank, world_size, base, bf16):
    """Megatron's own DDP checkpoint -> our wrapper, and ours -> Megatron's DDP (model state).
    bf16: Megatron DDP saves bf16 weights, we save fp32 main weights; loads cast (compared in bf16)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from tests.megatron_cpu import build_tiny_gpt, wrap_megatron_ddp

    def megatron_ddp(seed):
        model, config = build_tiny_gpt(seed, vocab=VOCAB, seq=SEQ, bf16=bf16)
        if bf16:
            from megatron.core.transformer.module import Float16Module

            return model, wrap_megatron_ddp(Float16Module(config, model), config)
        return model, wrap_megatron_ddp(model, config)

    def weights(state):
        dtype = torch.bfloat16 if bf16 else torch.float32
        return {k: v.detach().to(dtype) for k, v in state.items() if not k.endswith("._extra_state")}

    def fresh_dir(name):
        path = os.path.join(base, name)
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        return path

    out = {}
    with _megatron_on_cpu(world_size, rank, 0):
        model, ddp = megatron_ddp(7)
        want = weights(model.state_dict())
        path = fresh_dir("megatron_ddp")
        # as Megatron-LM's save_checkpoint does: the unwrapped model's sharded_state_dict
        dist_checkpointing.save({"model": model.sharded_state_dict()}, path)
        out["megatron_keys"] = sorted(dist_checkpointing.load_tensors_metadata(path))
        for strategy in STRATEGIES:
            wrapper, _, _ = _model_and_optimizer(strategy, bf16=bf16)
            loaded = dist_checkpointing.load({"model": wrapper.sharded_state_dict()}, path)
            wrapper.load_state_dict(loaded["model"])
            got = weights(wrapper.state_dict())
            out[("from_megatron_ddp", strategy)] = sorted(k for k in want if not torch.equal(got[k], want[k]))
            path_ours = fresh_dir(f"ours_{strategy}")
            dist_checkpointing.save({"model": wrapper.sharded_state_dict()}, path_ours)
            out[("our_keys", strategy)] = sorted(dist_checkpointing.load_tensors_metadata(path_ours))
            model, ddp = megatron_ddp(8)
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path_ours)
            ddp.load_state_dict(loaded["model"])
            back = weights(model.state_dict())
            out[("to_megatron_ddp", strategy)] = sorted(k for k in want if not torch.equal(back[k], got[k]))
    return out


def hyperparameters_worker(rank, world_size, base):
    """Hyperparameters a loop of one's own changed (no Megatron scheduler) before the default save:
    what a fresh optimizer holds after the load, per param group."""
    from megatron_fsdp_v2.megatron import load_dist_checkpoint, save_dist_checkpoint

    with _megatron_on_cpu(world_size, rank, 0):
        wrapper, _, optimizer = _model_and_optimizer("optim_grads")
        for i, group in enumerate(optimizer.optimizer.param_groups):
            group.update(lr=0.0123 * (i + 1), weight_decay=0.5 + i, betas=(0.8, 0.95 - 0.01 * i), eps=1e-6)
        want = [dict(g) for g in optimizer.optimizer.param_groups]
        save_dist_checkpoint(os.path.join(base, "hyperparameters"), wrapper, optimizer)
        wrapper, _, optimizer = _model_and_optimizer("no_shard")
        load_dist_checkpoint(os.path.join(base, "hyperparameters"), wrapper, optimizer)
        keys = ("lr", "weight_decay", "betas", "eps")
        return [{k: g[k] for k in keys} for g in want], [{k: g[k] for k in keys} for g in optimizer.optimizer.param_groups]


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("megatron_dist_ckpt"))
    for strategy in STRATEGIES:
        os.makedirs(os.path.join(base, strategy))
    saved = run_distributed(save_worker, 2, base, timeout=300)
    return base, saved


def _assert_equal_states(got, want, what):
    for part in ("model", "optimizer"):
        assert sorted(got[part]) == sorted(want[part]), (what, part)
        for key in want[part]:
            assert torch.equal(got[part][key], want[part][key]), (what, part, key)


def test_saved_state_is_complete(checkpoints):
    _, saved = checkpoints
    state = saved[0]["optim_grads_params"]["saved"]
    # every parameter has Adam's three entries; step counts the saved iterations
    params = state["model"].keys()
    for name in params:
        assert {f"state.{name}.exp_avg", f"state.{name}.exp_avg_sq", f"state.{name}.step"} <= state["optimizer"].keys()
        assert state["optimizer"][f"state.{name}.step"].item() == SAVED_ITERS
    moments = [state["optimizer"][f"state.{n}.exp_avg"] for n in params]
    assert sum(int(m.count_nonzero()) for m in moments) > 0.9 * sum(m.numel() for m in moments)


def test_every_strategy_pair_at_dp2_and_resume_is_bitwise(checkpoints):
    base, saved = checkpoints
    pairs = [(s, t) for s in STRATEGIES + (EARLIER,) for t in STRATEGIES]
    # new processes (not the pool that ran save_worker): everything must come from the checkpoint
    results = run_distributed(load_worker, 2, base, pairs, True, True, timeout=300, fresh=True)
    for rank, out in enumerate(results):
        for saved_strategy, target in pairs:
            want = saved[rank][saved_strategy]
            _assert_equal_states(out[(saved_strategy, target)]["loaded"], want["saved"],
                                 f"{saved_strategy} -> {target} rank {rank}")
            if saved_strategy == target:
                _assert_equal_states(out[(saved_strategy, target)]["resumed"], want["continuous"],
                                     f"resume {saved_strategy} rank {rank}")
    errors = results[0]["errors"]
    assert "Global shape mismatch" in errors["other_model"] and "(64, 48)" in errors["other_model"]
    assert "embedding.word_embeddings.weight" in errors["other_model"]
    assert "megatron_fsdp_v2_format" in errors["foreign_optimizer"]
    assert "sharded_offsets" in errors["offsets"] and "((0, 0, 2),)" in errors["offsets"]
    assert errors["loads_model_only"] == []
    for out in results:
        assert "missing keys ['decoder.final_layernorm.bias']" in out["errors"]["missing_full_key"]
        assert out["errors"]["flipped"].startswith("CheckpointCorruptError: ")
        assert "optim_grads_flipped/__1_0.distcp' is truncated or corrupt (found on rank" in out["errors"]["flipped"]
        held, loaded_into = out["in_place"]
        assert held > 0 and loaded_into == held, out["in_place"]
    for rank, out in enumerate(results):   # save_checkpoint(path, wrapper, megatron_optimizer), ZeRO-2 -> ZeRO-3
        _assert_equal_states(out["core_dcp"], saved[rank]["optim_grads"]["saved"], f"core DCP helpers rank {rank}")


@pytest.mark.parametrize("world_size,shift", [(1, 1), (4, 2)])
def test_load_at_other_dp_sizes(checkpoints, world_size, shift):
    base, saved = checkpoints
    pairs = [(s, STRATEGIES[(i + shift) % 4]) for i, s in enumerate(STRATEGIES)]
    results = run_distributed(load_worker, world_size, base, pairs, False, False, timeout=300)
    for rank, out in enumerate(results):
        for saved_strategy, target in pairs:
            _assert_equal_states(out[(saved_strategy, target)]["loaded"], saved[0][saved_strategy]["saved"],
                                 f"dp2 {saved_strategy} -> dp{world_size} {target} rank {rank}")


@pytest.mark.parametrize("saved,loaded,bf16", [("optim_grads_params", "optim", True), ("no_shard", "optim_grads", False)])
def test_megatron_lm_save_and_load_checkpoint(tmp_path, saved, loaded, bf16):
    """bf16 wraps the model in Float16Module: save_checkpoint's unwrap_model reaches the GPTModel
    below it, whose sharded_state_dict the wrapper routes to its own."""
    results = run_distributed(megatron_lm_worker, 2, str(tmp_path), saved, loaded, bf16, timeout=300)
    for out in results:
        assert out["iteration"] == SAVED_ITERS
        assert not any(torch.equal(out["fresh"][k], out["saved"]["model"][k]) for k in out["fresh"]
                       if k.endswith("linear_fc1.weight"))
        assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]  # one file per rank
        _assert_equal_states(out["loaded"], out["saved"], "Megatron-LM save_checkpoint -> load_checkpoint")


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dcp"])
def test_launcher_rejects_other_checkpoint_formats(ckpt_format):
    import argparse

    from examples.pretrain_gpt import check_launcher_args

    args = argparse.Namespace(data_parallel_sharding_strategy="optim_grads", save="/tmp/ckpt", load=None,
                              ckpt_format=ckpt_format)
    with pytest.raises(ValueError, match=f"--ckpt-format must be torch_dist or fsdp_dtensor with --save / --load.*"
                                         f"got '{ckpt_format}'"):
        check_launcher_args(args)
    args.ckpt_format = "torch_dist"
    check_launcher_args(args)
    args.ckpt_format, args.save = ckpt_format, None   # no checkpoints: any format is fine
    check_launcher_args(args)


def test_flat_ranges_become_box_sharded_tensors_and_back():
    from megatron_fsdp_v2.checkpoint.dcp_format import FlatRangeShard
    from megatron_fsdp_v2.megatron.checkpoint.dist_checkpoint import from_loaded, to_sharded

    full = torch.arange(15.0).view(3, 5)
    shard = FlatRangeShard((3, 5), full.reshape(-1)[3:12].clone(), 3)
    boxes = to_sharded("w", shard, dp_rank=1)
    assert [(b.global_offset, b.local_shape, b.replica_id, b.axis_fragmentations) for b in boxes.values()] == [
        ((0, 3), (1, 2), (0, 0, 0), None), ((1, 0), (1, 5), (0, 0, 0), None), ((2, 0), (1, 2), (0, 0, 0), None)]
    assert all(torch.equal(b.data, full[b.global_slice()]) for b in boxes.values())
    back = from_loaded("w", shard, {k: b.data.clone() for k, b in boxes.items()})
    assert (back.flat_start, back.flat_end) == (3, 12) and torch.equal(back.local_flat, shard.local_flat)
    assert from_loaded("w", shard, {k: b.data for k, b in boxes.items()}) is shard   # loaded in place: no copy
    # a 0-d parameter travels as shape (1,); a rank without a box saves nothing for it
    scalar = to_sharded("s", FlatRangeShard((), torch.tensor([2.5]), 0), dp_rank=0)
    assert [(b.global_shape, b.global_offset, b.local_shape) for b in scalar.values()] == [((1,), (0,), (1,))]
    assert to_sharded("s", FlatRangeShard((), torch.empty(0), 1), dp_rank=1) == {}
    # replicated tensors: one ShardedTensor, written by data-parallel rank 0 of tensor-parallel rank 0 only
    # (Megatron's replica ids: (0, tensor-parallel rank, data-parallel rank), main when all are 0)
    replicated = to_sharded("b", torch.ones(4), dp_rank=3)
    assert (replicated.global_shape, replicated.replica_id) == ((4,), (0, 0, 3))
    assert to_sharded("b", torch.ones(4), dp_rank=0, tp_rank=1).replica_id == (0, 1, 0)
    # a tensor-parallel slice (rows 4..7 of 8) at its offset; the boxes of its flat range too
    from megatron_fsdp_v2.megatron.checkpoint.dist_checkpoint import Placement

    half = Placement("w", tensor_offsets=(4, 0), tensor_shape=(8, 5), replica_id=(0, 0, 2))
    whole = to_sharded("w", torch.ones(4, 5), dp_rank=1, placement=half)
    assert (whole.global_shape, whole.global_offset, whole.axis_fragmentations, whole.replica_id) == \
        ((8, 5), (4, 0), (2, 1), (0, 0, 1))
    sliced = to_sharded("w", FlatRangeShard((4, 5), torch.ones(7), 3), dp_rank=1, placement=half)
    assert [(b.global_shape, b.global_offset, b.replica_id) for b in sliced.values()] == [
        ((8, 5), (4, 3), (0, 0, 0)), ((8, 5), (5, 0), (0, 0, 0))]
    with pytest.raises(ValueError, match=r"w: expected this rank's 3 boxes .*got a tensor of shape \(15,\)"):
        from_loaded("w", shard, torch.zeros(15))
    with pytest.raises(ValueError, match=r"w: the loaded boxes hold 3 elements, this rank owns 9"):
        from_loaded("w", shard, {"box0": torch.zeros(1), "box1": torch.zeros(1), "box2": torch.zeros(1)})


@pytest.mark.parametrize("bf16", [False, True])
def test_checkpoints_interchange_with_megatron_ddp(tmp_path, bf16):
    """Same keys as Megatron's DDP (layers stacked under decoder.layers.*): a Megatron DDP
    checkpoint loads into every strategy, and every strategy's loads into Megatron's DDP."""
    results = run_distributed(interop_worker, 2, str(tmp_path), bf16, timeout=300)
    for out in results:
        assert "decoder.layers.mlp.linear_fc1.weight" in out["megatron_keys"]
        for strategy in STRATEGIES:
            assert out[("our_keys", strategy)] == out["megatron_keys"], strategy
            assert out[("from_megatron_ddp", strategy)] == [], strategy
            assert out[("to_megatron_ddp", strategy)] == [], strategy


def test_layout_falls_back_to_parameter_names(caplog):
    from megatron_fsdp_v2.megatron.checkpoint.dist_checkpoint import megatron_layout, model_sharded_state_dict

    class Broken(torch.nn.Linear):
        def sharded_state_dict(self, *args, **kwargs):
            raise RuntimeError("no parallel state")

    assert megatron_layout(torch.nn.Linear(2, 2)) == ({}, {})
    with caplog.at_level("WARNING"):
        assert megatron_layout(Broken(2, 2)) == ({}, {})
    assert "Broken.sharded_state_dict() failed (RuntimeError: no parallel state)" in caplog.text
    sharded = model_sharded_state_dict({"weight": torch.ones(2, 2)}, dp_rank=0)
    assert sharded["weight"].key == "weight" and sharded["weight"].global_shape == (2, 2)


def test_default_save_restores_the_hyperparameters(tmp_path):
    """save_dist_checkpoint's default layout (fully_reshardable) keeps each param group's
    hyperparameters, as our earlier layout did and Megatron's DistributedOptimizer does."""
    for want, got in run_distributed(hyperparameters_worker, 2, str(tmp_path), timeout=300):
        assert len(want) == 2 and got == want
