"""Megatron-LM's ``--async-save --use-persistent-ckpt-worker`` through examples/pretrain_gpt.py with
our wrapper (issue 64), on CPU, 2 gloo ranks, Megatron-LM's own training loop and async queue
(megatron-core's ``--async-strategy mcore``; testing/pretrain_gpt_cpu.py forks its worker process):

* ``--ckpt-format torch_dist`` (Megatron-LM's own async path with our ``sharded_state_dict``) and
  ``fsdp_dtensor`` (the launcher's request, megatron/checkpoint/async_request.py): a run saves at
  iterations 2 and 4 through Megatron-LM's queue (two requests scheduled per rank); a second run
  loads iteration 2 (``--load --ckpt-step 2``) and its iteration 3 loss and weights after
  iteration 4 equal the first run's, bitwise;
* fsdp_dtensor: every file is in the checksum manifest, which the workers' digests built (no
  per-rank digest file is left), and each checks;
* torch_dist: Megatron DDP + DistributedOptimizer loads the asynchronous checkpoint with Megatron's
  own calls; re-saved by Megatron, its model and Adam state equal the checkpoint's, bitwise;
* the preload stages a copy of host tensors (on CPU every tensor is one), so the step after the
  save does not reach the files (it did, by timing, on torch 2.11).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402
from tests.unit.test_megatron_fsdp_command_line import MEGATRON_FSDP_FLAGS, MODEL_FLAGS, launcher_worker  # noqa: E402

ASYNC = ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]
FORMATS = {"torch_dist": ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"],
           "fsdp_dtensor": MEGATRON_FSDP_FLAGS}


def _command(ckpt_format: str, *more: str) -> list:
    return FORMATS[ckpt_format] + ["--data-parallel-sharding-strategy", "optim_grads_params"] + MODEL_FLAGS + \
        list(more)


def queued_launcher_worker(rank, world_size, argv):
    """``launcher_worker``, counting the requests handed to Megatron-LM's async queue."""
    from megatron.training import async_utils, checkpointing

    scheduled = []
    original = async_utils.schedule_async_save

    def schedule(request):
        scheduled.append(type(request).__name__)
        return original(request)

    async_utils.schedule_async_save = checkpointing.schedule_async_save = schedule
    try:
        out = launcher_worker(rank, world_size, argv)
    finally:
        async_utils.schedule_async_save = checkpointing.schedule_async_save = original
    return {**out, "scheduled": scheduled}


def megatron_ddp_worker(rank, world_size, path, resaved):
    """Megatron DDP + DistributedOptimizer loads ``path`` as Megatron-LM's load_checkpoint does, and
    re-saves it; which tensors differ between the two directories."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer import get_megatron_optimizer

    from testing.cpu_compat import distributed_optimizer_on_cpu
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, wrap_megatron_ddp)
    from tests.unit.test_megatron_adapter import _opt_config
    from tests.unit.test_megatron_distopt_checkpoint import _megatron_save_fully_reshardable

    with patch_megatron_for_cpu(), distributed_optimizer_on_cpu():
        init_megatron_parallel_state(world_size)
        try:
            model, config = build_tiny_gpt(77, vocab=512, hidden=64, layers=2, heads=4, seq=32)
            ddp = wrap_megatron_ddp(model, config, use_distributed_optimizer=True)
            # the launcher's --lr and Megatron-LM's --min-lr default: what Megatron matches param groups by
            optimizer = get_megatron_optimizer(_opt_config("adam", 1e-3, min_lr=0.0, use_distributed_optimizer=True),
                                               [ddp])
            optimizer.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
            model_sd = model.sharded_state_dict()
            state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=dist_checkpointing.load_content_metadata(path))}
            loaded = dist_checkpointing.load(state, path)
            model.load_state_dict(loaded["model"])
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            again = _megatron_save_fully_reshardable(model, optimizer, *os.path.split(resaved), rank)
            want, got = ({k: v for k, v in dist_checkpointing.load_plain_tensors(d).items()
                          if isinstance(v, torch.Tensor)} for d in (path, again))
        finally:
            destroy_megatron_parallel_state()
    unequal = sorted(set(want) ^ set(got)) + [k for k in want if k in got and not torch.equal(got[k], want[k])]
    return {"unequal": unequal,
            "compared": sum(v.numel() for v in got.values()),
            "steps": {float(s["step"]) for s in optimizer.chained_optimizers[0].optimizer.state.values()}}


@pytest.mark.parametrize("ckpt_format", list(FORMATS))
def test_async_save_through_megatron_lm_loads_back_and_continues_bitwise(tmp_path, ckpt_format):
    save = ["--ckpt-format", ckpt_format, "--save", str(tmp_path), "--save-interval", "2"] + ASYNC
    first = run_distributed(queued_launcher_worker, 2, _command(ckpt_format, *save), timeout=600)
    assert [out["scheduled"] for out in first] == [["AsyncRequest"] * 2] * 2      # iterations 2 and 4, queued
    assert sorted(first[1]["losses"]) == [1, 2, 3, 4]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "4"
    load = ["--ckpt-format", ckpt_format, "--load", str(tmp_path), "--ckpt-step", "2"]
    resumed = run_distributed(launcher_worker, 2, _command(ckpt_format, *load), timeout=600)
    assert sorted(resumed[1]["losses"]) == [3, 4] and resumed[1]["losses"][3] == first[1]["losses"][3]
    for rank in range(2):
        want, got = first[rank]["weights"], resumed[rank]["weights"]
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items()), rank
    saved = tmp_path / "iter_0000002"
    if ckpt_format == "fsdp_dtensor":
        from megatron_fsdp_v2.checkpoint.integrity import read_manifest, verify_file

        manifest = read_manifest(saved)
        assert sorted(manifest) == sorted(n for n in os.listdir(saved) if n.endswith(".distcp") or n == ".metadata")
        assert not [n for n in os.listdir(saved) if n.startswith(".checksums.") and n != ".checksums.json"]
        for name in manifest:
            verify_file(saved, name, manifest)
    else:
        for out in run_distributed(megatron_ddp_worker, 2, str(saved), str(tmp_path / "resaved"), timeout=300):
            assert out["unequal"] == [] and out["compared"] > 100000 and out["steps"] == {2.0}, out


def test_the_launcher_refuses_megatron_lms_default_async_strategy_without_its_package(monkeypatch):
    """Megatron-LM's default ``--async-strategy nvrx`` fails at the first save, after training, when
    nvidia-resiliency-ext is missing: the launcher refuses it before training, naming the flag."""
    import argparse
    import importlib.util

    from examples.pretrain_gpt import check_launcher_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nvidia_resiliency_ext"
                        else real(name, *a))
    args = argparse.Namespace(data_parallel_sharding_strategy="optim_grads", save="/tmp/ckpt", load=None,
                              ckpt_format="torch_dist", async_save=True, use_persistent_ckpt_worker=True,
                              async_strategy="nvrx")
    with pytest.raises(ValueError, match=r"--async-save with --async-strategy nvrx .* needs nvidia-resiliency-ext, "
                                         r"which is not installed; pass --async-strategy mcore"):
        check_launcher_args(args)
    args.async_strategy = "mcore"
    check_launcher_args(args)


def test_the_async_preload_copies_host_tensors_so_a_later_step_does_not_change_the_checkpoint():
    """Megatron's preload hands a host tensor that owns its storage to the worker as it is (shared
    memory through the persistent worker's queue), so the trainer's next in-place step would reach
    the file: ``copy_host_tensors_at_preload`` stages a copy, and keeps the request's other fields."""
    import functools

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_fsdp_v2.megatron.checkpoint.async_request import copy_host_tensors_at_preload

    exp_avg = torch.arange(4.0)
    buckets = [("/ckpt/__0_0.distcp", "__0_0.distcp", ([("meta", b"x")], [("exp_avg", exp_avg)]))]
    preload = functools.partial(FileSystemWriterAsync.preload_tensors, buckets, False)
    finalize = [print]
    request = AsyncRequest(print, [0, buckets, None], finalize, preload_fn=preload)
    assert preload()[0][2][1][0][1] is exp_avg                      # Megatron's own: the trainer's memory
    copied = copy_host_tensors_at_preload(request)
    staged = copied.preload_fn()
    exp_avg.add_(1)                                                  # the next optimizer step, in place
    assert staged[0][2][1][0][1].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert staged[0][2][0] == [("meta", b"x")] and staged[0][:2] == buckets[0][:2]
    assert copied.finalize_fns is finalize and copied.async_fn_args == request.async_fn_args
    assert copy_host_tensors_at_preload(request._replace(preload_fn=None)).preload_fn is None
