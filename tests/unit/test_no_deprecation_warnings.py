"""A training step prints no deprecation warning of torch.distributed (2 gloo ranks).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and prints a FutureWarning at every call of the old names: one line per
collective in a user's log. Every strategy is wrapped (wrap-time checks), trained two steps of two
micro-batches (all-reduce, reduce-scatter, all-gather), gathered whole (``full_tensor`` of a
sharded parameter, ``full_state_dict``); hybrid sharding adds its wrap-time group check.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard
from megatron_fsdp_v2.comm import all_gather_single, reduce_scatter_single

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn


def _train(model, rank) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        for x, y in make_batches(step, rank, 2):
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _warnings_worker(rank, world_size):
    out = {}
    own = [dist.new_group([r]) for r in range(world_size)][rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for strategy in STRATEGY_NAMES:
            model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
            _train(model, rank)
            weight = dict(model.named_parameters())["head.weight"]     # the optimizer-facing one
            whole = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
            out[strategy] = (tuple(whole.shape), len(model.full_state_dict()))
        hybrid = fully_shard(UnevenNet(), sharding_strategy="optim", unit_modules=[Block],
                             process_group=(dist.group.WORLD, own))
        _train(hybrid, rank)
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                       if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    return out


def test_training_prints_no_deprecation_warning():
    for out in run_distributed(_warnings_worker, 2):
        assert out["warnings"] == []
        for strategy in STRATEGY_NAMES:
            assert out[strategy] == ((5, 13), 22), strategy     # the step ran and gathered whole tensors


def test_current_collective_names_where_torch_has_them():
    assert all_gather_single is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert reduce_scatter_single is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
