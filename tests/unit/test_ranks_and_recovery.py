"""Ranks that disagree fail fast and clearly; replicas start equal; a failed backward is recoverable.

One distributed run per case family collects results for every strategy; the tests assert on them.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, MixedPrecisionPolicy, fully_shard

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn


def _error_of(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        return str(err)
    return None


# ---------------------------------------------------------------- settings that differ between ranks
def disagreeing_settings_worker(rank, world_size):
    out = {}
    strategies = ("optim", "optim_grads")
    out["strategy"] = _error_of(lambda: fully_shard(UnevenNet(), sharding_strategy=strategies[rank]))
    out["units"] = _error_of(lambda: fully_shard(UnevenNet(), sharding_strategy="optim",
                                                 unit_modules=[Block] if rank == 0 else None))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if rank == 1 else None
    out["mixed_precision"] = _error_of(lambda: fully_shard(UnevenNet(), sharding_strategy="optim",
                                                           mixed_precision=policy))
    out["allocator"] = _error_of(lambda: fully_shard(UnevenNet(), sharding_strategy="optim_grads_params",
                                                     allocator=("storage_freeing", "trace_pool")[rank]))
    out["agree"] = _error_of(lambda: fully_shard(UnevenNet(), sharding_strategy="optim"))
    return out


def test_settings_that_differ_between_ranks_raise_on_every_rank_naming_them():
    for rank, out in enumerate(run_distributed(disagreeing_settings_worker, 2)):
        assert out["strategy"] == (
            "fully_shard: sharding_strategy differs between data-parallel ranks (rank 0: optim; rank 1: "
            "optim_grads). Every rank must wrap the same model with the same settings."), rank
        assert "units differs between data-parallel ranks (rank 0: <root>,blocks.0,blocks.1,blocks.2; " \
               "rank 1: <root>)" in out["units"]
        assert "mixed_precision differs between data-parallel ranks (rank 0: None; rank 1: " \
               "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in out["mixed_precision"]
        assert "allocator differs between data-parallel ranks (rank 0: StorageFreeingBucketAllocator; " \
               "rank 1: TracePoolAllocator)" in out["allocator"]
        assert out["agree"] is None


# rank-dependent control flow (a unit skipped on one rank): tests/unit/test_rank_divergence.py


# ---------------------------------------------------------------- replicas that start apart
def start_apart_worker(rank, world_size):
    out = {}
    torch.manual_seed(0)
    rank0_initial = UnevenNet().state_dict()
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(rank)                      # every rank builds different weights
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
        full = model.full_state_dict()
        out[strategy] = max(float((full[n] - rank0_initial[n]).abs().max()) for n in rank0_initial)
    return out


def test_every_strategy_starts_from_rank_0s_weights():
    for out in run_distributed(start_apart_worker, 2):
        for strategy, diff in out.items():
            assert diff == 0.0, strategy


# ---------------------------------------------------------------- recovery after an exception in backward
class Tripwire(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (a data problem found in backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if Tripwire.armed:
            raise FloatingPointError("tripwire: bad batch")
        return grad


class TripNet(UnevenNet):
    def forward(self, x):
        h = self.proj(x)
        for index, block in enumerate(self.blocks):
            h = block(Tripwire.apply(h) if index == 1 else h)
        return self.head(h) + self.offset


def _train(model, opt, rank, steps, bad_step=None, recover="optimizer", k=2):
    for step in steps:
        try:
            for i, (x, y) in enumerate(make_batches(step, rank, k)):
                Tripwire.armed = step == bad_step and i == k - 1
                with (model.no_sync() if i < k - 1 else contextlib.nullcontext()):
                    loss_fn(model(x), y).backward()
        except FloatingPointError:
            Tripwire.armed = False
            if recover == "reset_iteration":
                model.reset_iteration()
            elif recover == "module_zero_grad":
                model.zero_grad()
            else:
                opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()


def recovery_worker(rank, world_size):
    out = {}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        clean = fully_shard(TripNet(), sharding_strategy=strategy, unit_modules=[Block])
        opt = torch.optim.AdamW(clean.parameters(), lr=1e-2)
        _train(clean, opt, rank, [0, 2, 3])
        want = clean.full_state_dict()
        for recover in ("optimizer", "reset_iteration", "module_zero_grad"):
            try:
                torch.manual_seed(0)
                model = fully_shard(TripNet(), sharding_strategy=strategy, unit_modules=[Block])
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                _train(model, opt, rank, [0, 1, 2, 3], bad_step=1, recover=recover)
                got = model.full_state_dict()
                out[(strategy, recover)] = max(float((got[n] - want[n]).abs().max()) for n in want)
            except Exception:  # noqa: BLE001
                out[(strategy, recover)] = traceback.format_exc()
    return out


def test_training_goes_on_after_an_exception_in_backward_as_if_the_batch_was_skipped():
    for out in run_distributed(recovery_worker, 2):
        for key, diff in out.items():
            assert isinstance(diff, float), f"{key}:\n{diff}"
            assert diff == 0.0, key
