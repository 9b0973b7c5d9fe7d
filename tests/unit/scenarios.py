"""Worker functions (run on every rank by ``run_distributed``) shared by the CPU tests."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from .models import Block, UnevenNet, make_batches


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(name)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def train(model, optimizer, rank, steps, k, no_sync=True, seed_offset=0):
    """Standard loop: k micro-batches per step, ``no_sync`` for all but the last."""
    for step in range(steps):
        batches = make_batches(step + seed_offset, rank, k)
        for i, (x, y) in enumerate(batches):
            ctx = model.no_sync() if (no_sync and i < k - 1) else contextlib.nullcontext()
            with ctx:
                loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def ddp_reference(rank, steps, k, opt_name, model_fn=UnevenNet):
    torch.manual_seed(0)
    ref = DistributedDataParallel(model_fn())
    opt = make_optimizer(opt_name, ref.parameters())
    train(ref, opt, rank, steps, k)
    return {n: p.detach().clone() for n, p in ref.module.state_dict().items()}


def sharded_run(rank, strategy, steps, k, opt_name, allocator="storage_freeing", model_fn=UnevenNet,
                zero_grad_to_none=True):
    torch.manual_seed(0)
    model = fully_shard(model_fn(), sharding_strategy=strategy, unit_modules=[Block], allocator=allocator)
    opt = make_optimizer(opt_name, model.parameters())
    for step in range(steps):
        for i, (x, y) in enumerate(make_batches(step, rank, k)):
            with (model.no_sync() if i < k - 1 else contextlib.nullcontext()):
                loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=zero_grad_to_none)
    return model, opt


def parity_worker(rank, world_size, strategies=STRATEGY_NAMES, ks=(1, 3), optimizers=("sgd", "adamw"), steps=5):
    """Max deviation of every strategy's full weights from torch DDP, per (strategy, k, optimizer)."""
    report = {}
    for k in ks:
        for opt_name in optimizers:
            reference = ddp_reference(rank, steps, k, opt_name)
            for strategy in strategies:
                model, _ = sharded_run(rank, strategy, steps, k, opt_name,
                                       zero_grad_to_none=(k == 1))
                full = model.full_state_dict()
                atol = 1e-6 if opt_name == "sgd" else 1e-5
                failures = []
                for name, want in reference.items():
                    got = full[name]
                    if not torch.allclose(got, want, rtol=1e-5, atol=atol):
                        failures.append(f"{name}: max abs diff {(got - want).abs().max().item():.3g}")
                moved = max((full[n] - p).abs().max().item() for n, p in _initial_state().items())
                report[(strategy, k, opt_name)] = (failures, moved)
    return report


def _initial_state():
    torch.manual_seed(0)
    return UnevenNet().state_dict()
