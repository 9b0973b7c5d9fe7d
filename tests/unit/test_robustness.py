"""Misuse errors, NaN/Inf detection, global-norm clipping, and no leaks over long runs."""

import contextlib
import gc
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard
from megatron_fsdp_v2.row_sharded import local_piece
from testing.settled import settled
from tests.cpu_live_bytes import live_storages

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn


# ---------------------------------------------------------------- clipping
def clip_worker(rank, world_size):
    out = {}
    for norm_type in (2.0, float("inf")):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(UnevenNet())
        x, y = make_batches(3, rank, 1, batch=8)[0]
        (loss_fn(ddp(x), y) * 50).backward()
        want = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.5, norm_type=norm_type)
        clipped = {n: p.grad.reshape(-1).clone() for n, p in ddp.module.named_parameters()}
        for strategy in STRATEGY_NAMES:
            torch.manual_seed(0)
            model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
            (loss_fn(model(x), y) * 50).backward()
            got = model.clip_grad_norm_(0.5, norm_type=norm_type)
            errs = []
            for g in model._fsdp_engine.groups:
                for i, names in enumerate(g.all_names):
                    grad = local_piece(g.main_params[i].grad).reshape(-1)
                    ref = clipped[names[0]]
                    if g.strategy.optim_sharded:
                        piece = g.layout.shard_slice(i, rank)
                        ref = ref[piece.param_start:piece.param_end]
                    errs.append(float((grad - ref).abs().max()) if ref.numel() else 0.0)
            out[(strategy, norm_type)] = (float(got), float(want), max(errs))
    return out


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_clip_grad_norm_matches_ddp(dp_size):
    for result in run_distributed(clip_worker, dp_size):
        for key, (got, want, err) in result.items():
            assert want > 0.5                       # clipping actually happened
            assert got == pytest.approx(want, rel=1e-6), key
            assert err < 1e-7, key


# ---------------------------------------------------------------- misuse during training
def misuse_worker(rank, world_size):
    msgs = {}
    x, y = make_batches(0, rank, 1)[0]

    def catch(name, fn):
        try:
            fn()
            msgs[name] = None
        except RuntimeError as err:
            msgs[name] = str(err)

    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim", unit_modules=[Block])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        loss_fn(model(x), y).backward()
    catch("step_unreduced", opt.step)
    model.reduce_gradients(async_op=True)
    catch("step_pending", opt.step)
    model.wait_gradient_reduction()
    catch("step_ok", opt.step)

    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block])
    loss = loss_fn(model(x), y)
    loss.backward(retain_graph=True)
    catch("backward_twice", loss.backward)

    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads", unit_modules=[Block])
    with model.no_sync():
        model(x)
    catch("forward_without_backward", lambda: model(x))
    with torch.no_grad():
        catch("eval_forward_ok", lambda: model(x))

    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads", check_for_nan_in_grad=True)
    bad_x = x.clone()
    if rank == 1:
        bad_x[0, 0] = float("nan")
    catch("nan", lambda: loss_fn(model(bad_x), y).backward())
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads")    # off by default
    catch("nan_unchecked", lambda: loss_fn(model(bad_x), y).backward())

    sub = dist.new_group([0])
    try:
        fully_shard(UnevenNet(), sharding_strategy="optim", process_group=sub)
        msgs["non_member"] = None
    except ValueError as err:
        msgs["non_member"] = str(err)
    return msgs


def test_misuse_is_reported_clearly():
    msgs = run_distributed(misuse_worker, 2)
    for rank, m in enumerate(msgs):
        assert m["step_unreduced"].startswith("optimizer.step() called with gradients accumulated inside no_sync() "
                                              "but never reduced")
        assert m["step_pending"].startswith("optimizer.step() called while a gradient reduce is still pending")
        assert m["step_ok"] is None
        assert m["backward_twice"].startswith("backward ran twice through one forward of unit")
        assert m["forward_without_backward"].startswith("forward called again before the backward")
        assert m["eval_forward_ok"] is None
        # the reduce spreads rank 1's NaN to every rank; the error names a parameter and the rank
        assert m["nan"] is not None and f"on data-parallel rank {rank}" in m["nan"]
        assert m["nan"].startswith("NaN in the reduced gradient of parameter '")
        assert m["nan_unchecked"] is None
        if rank == 1:
            assert m["non_member"].startswith("process_group: this process (global rank 1) is not a member")
        else:
            assert m["non_member"] is None


# ---------------------------------------------------------------- long runs
class LongNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(4, 6), Block(4, 6))

    def forward(self, x):
        return self.blocks(x)


def _hook_count(module):
    n = 0
    for m in module.modules():
        n += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
    for m in module.modules():
        for p in m._parameters.values():
            n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return n


def _tensor_bytes():
    """Bytes of every live CPU storage (tests/cpu_live_bytes.py), once two readings agree (a CI run
    counted 32 bytes more at step 100 than at step 2, once: a tensor released a moment late, see
    testing/settled.py)."""
    return settled(lambda: sum(nbytes for nbytes, _ in live_storages().values()))


def long_run_worker(rank, world_size, steps):
    out = {}
    for strategy in STRATEGY_NAMES:
        for allocator in ("storage_freeing", "trace_pool"):
            torch.manual_seed(0)
            model = fully_shard(LongNet(), sharding_strategy=strategy, unit_modules=[Block], allocator=allocator)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(2, 4, generator=g)
            figures = {}
            start = time.perf_counter()
            for step in range(1, steps + 1):
                for i in range(2):
                    with (model.no_sync() if i == 0 else contextlib.nullcontext()):
                        model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if step in (2, steps):
                    figures[step] = (model._fsdp_engine.allocator.live_bytes, model._fsdp_engine.allocator.peak_live_bytes,
                                     _tensor_bytes(), _hook_count(model), model._fsdp_engine.hook_count())
            out[(strategy, allocator)] = (figures, time.perf_counter() - start)
    return out


def test_long_run_does_not_leak():
    steps = 40                                   # a leak per step shows as growth from step 2 to 40
    result = run_distributed(long_run_worker, 2, steps)[0]
    for key, (figures, seconds) in result.items():
        live2, peak2, tensors2, hooks2, engine_hooks2 = figures[2]
        live, peak, tensors, hooks, engine_hooks = figures[steps]
        print(f"{key}: {steps} steps in {seconds:.1f}s; allocator live {live2}->{live} B, peak {peak2}->{peak} B, "
              f"tensor bytes {tensors2}->{tensors} B, hooks {hooks2}->{hooks}")
        assert live == live2 == 0, key
        assert peak == peak2, key
        assert tensors == tensors2, key
        assert hooks == hooks2 and engine_hooks == engine_hooks2, key


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_dropped_model_is_freed(strategy, single_rank_group):
    import weakref
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters())
    x, y = make_batches(0, 0, 1)[0]
    loss_fn(model(x), y).backward()
    opt.step()
    model_ref, engine_ref = weakref.ref(model), weakref.ref(model._fsdp_engine)
    del model, opt
    gc.collect()
    assert model_ref() is None and engine_ref() is None


def several_models_worker(rank, world_size):
    """Six ZeRO-1 models over one group, one optimizer: each step issues six async all-gathers
    there, which every rank must issue in the same order."""
    from megatron_fsdp_v2.runtime import optimizer_hook

    torch.manual_seed(0)
    models = [fully_shard(UnevenNet(), sharding_strategy="optim") for _ in range(6)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    engines = [m._fsdp_engine for m in models]
    order = [engines.index(e) for e in optimizer_hook._engines_of(opt)]
    x, y = make_batches(0, rank, 1)[0]
    for _ in range(2):
        sum(loss_fn(m(x), y) for m in models).backward()
        opt.step()
        opt.zero_grad()
    return order, [m.full_state_dict() for m in models]


def test_one_optimizer_over_several_models_refreshes_them_in_registration_order():
    results = run_distributed(several_models_worker, 2)
    for order, _ in results:
        assert order == list(range(6))
    for got, want in zip(results[1][1], results[0][1]):
        for name, value in want.items():
            assert torch.equal(got[name], value), name
