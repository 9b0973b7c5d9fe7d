"""Persistent bytes per rank follow the formula in docs/design.md; ZeRO-3 keeps only shards; the
gradient buffers live only as long as the optimizer's ``.grad`` views (``zero_grad(set_to_none=True)``
frees them, as FSDP2 does) unless ``persistent_grads=True``."""

import math

import pytest
import torch

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from tests.design_sizes import design_persistent_bytes

from .dist_utils import run_distributed
from .models import Block, UnevenNet
from .scenarios import sharded_run


def memory_worker(rank, world_size):
    out = {}
    for strategy in STRATEGY_NAMES:
        # zero_grad(set_to_none=False): the .grad views (hence the buffers) stay
        model, _ = sharded_run(rank, strategy, steps=2, k=2, opt_name="adamw", zero_grad_to_none=False)
        groups = model._fsdp_engine.groups
        unit_numels = [g.layout.total_numel for g in groups]      # padded by the layout
        zero3_model_params_empty = all(p.numel() == 0 for g in groups for p in g.params)
        out[strategy] = (model.persistent_bytes(), unit_numels, model._fsdp_engine.allocator.live_bytes,
                         zero3_model_params_empty)
        model.zero_grad(set_to_none=True)
        out[strategy] += (model.persistent_bytes()["grads"],)
    return out


def formula(strategy, unit_numels, dp, compute=4, main=4, grad=4):
    """docs/design.md: bytes a rank keeps between steps (P = a group's buffer, padded by the layout)."""
    padded = unit_numels
    return design_persistent_bytes(strategy, padded, dp, compute, main, grad, aliased=compute == main)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_persistent_bytes_follow_the_formula(dp_size):
    results = run_distributed(memory_worker, dp_size)
    for strategy, (persistent, unit_numels, live_temporaries, params_empty, grads_after_set_to_none) in (
            (s, r[s]) for r in results for s in STRATEGY_NAMES):
        assert grads_after_set_to_none == 0, strategy     # freed with the optimizer's .grad views
        want = formula(strategy, unit_numels, dp_size)
        assert {k: persistent[k] for k in want} == want
        assert persistent["total"] == sum(want.values())
        assert live_temporaries == 0           # nothing temporary survives a step
        if strategy == "optim_grads_params":
            assert params_empty                 # ZeRO-3 keeps only shards between steps


def persistent_grads_worker(rank, world_size):
    from .scenarios import loss_fn, make_batches

    out = {}
    for persistent in (False, True):
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                            persistent_grads=persistent)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = make_batches(0, rank, 1)[0]
        loss_fn(model(x), y).backward()
        after_backward = model.persistent_bytes()["grads"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[persistent] = (after_backward, model.persistent_bytes()["grads"])
    return out


def test_zero_grad_set_to_none_frees_the_grad_shard_unless_persistent_grads():
    for result in run_distributed(persistent_grads_worker, 2):
        held, freed = result[False]
        assert held > 0 and freed == 0
        assert result[True] == (held, held)
