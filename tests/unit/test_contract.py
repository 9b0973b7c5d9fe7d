"""The fully_shard contract: forward equality, optimizer-facing params, grad semantics, edge cases."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard
from megatron_fsdp_v2.row_sharded import local_piece

from .dist_utils import run_distributed
from .models import Block, EdgeNet, Tiny, UnevenNet, make_batches, make_token_batches


def _ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _train_edge(model, rank, k):
    """Three AdamW steps of ``k`` token micro-batches each, no_sync on all but the last."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        for i, (x, y) in enumerate(make_token_batches(step, rank, k)):
            with (model.no_sync() if i < k - 1 else contextlib.nullcontext()):
                _ce(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def edge_worker(rank, world_size):
    """EdgeNet (tied, frozen, tiny, 0-d) trains like DDP under every strategy; frozen stays put."""
    report = {}
    k = 2
    torch.manual_seed(0)
    ddp = DistributedDataParallel(EdgeNet())
    _train_edge(ddp, rank, k)
    reference = ddp.module.state_dict()
    torch.manual_seed(0)
    initial = EdgeNet().state_dict()
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        model = fully_shard(EdgeNet(), sharding_strategy=strategy, unit_modules=[Block, Tiny])
        names = [n for n, _ in model.named_parameters()]
        _train_edge(model, rank, k)
        full = model.full_state_dict()
        diffs = {n: (full[n] - reference[n]).abs().max().item() for n in reference}
        frozen_moved = (full["frozen.weight"] - initial["frozen.weight"]).abs().max().item()
        tiny_shard_sizes = [local_piece(m).numel() for n, m in model.named_parameters() if n == "tiny.gain"]
        report[strategy] = (diffs, frozen_moved, names, tiny_shard_sizes, sorted(full))
    return report


@pytest.mark.parametrize("dp_size", [2, 4])
def test_tied_frozen_tiny_and_empty_shards_match_ddp(dp_size):
    reports = run_distributed(edge_worker, dp_size)
    for rank, report in enumerate(reports):
        for strategy, (diffs, frozen_moved, names, tiny_sizes, keys) in report.items():
            assert max(diffs.values()) < 1e-5, (strategy, rank, diffs)
            assert frozen_moved == 0.0
            # original names, tied weight once (named_parameters dedups like torch)
            assert names == ["emb.weight", "frozen.weight", "frozen.bias", "temperature", "tiny.gain",
                             "block.scale", "block.up.weight", "block.up.bias", "block.down.weight",
                             "block.norm.weight", "block.norm.bias"] or sorted(names) == sorted(set(names))
            assert "out.weight" in keys and "emb.weight" in keys
            if strategy != "no_shard":
                # the 1-element unit lives on rank 0 only; other ranks have an empty shard
                assert tiny_sizes == ([1] if rank == 0 else [0])


def semantics_worker(rank, world_size, strategy):
    torch.manual_seed(0)
    plain = UnevenNet()
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    x, y = make_batches(7, rank, 1)[0]
    out = {}
    with torch.no_grad():
        out["forward_equal"] = torch.equal(model(x), plain(x))
    mains = list(model.parameters())
    out["main_dtypes"] = {str(p.dtype) for p in mains}
    out["main_numel"] = sum(local_piece(p).numel() for p in mains)
    out["full_numel"] = sum(p.numel() for p in plain.parameters())
    out["all_leaf"] = all(p.is_leaf and p.requires_grad for p in mains)
    # grads: DP mean of per-rank sum over micro-batches
    batches = make_batches(11, rank, 3)
    for i, (xb, yb) in enumerate(batches):
        with (model.no_sync() if i < 2 else contextlib.nullcontext()):
            ((model(xb) - yb) ** 2).mean().backward()
    model.wait_gradient_reduction()
    model.wait_gradient_reduction()      # idempotent
    grads = {n: local_piece(p.grad).clone() for n, p in model.named_parameters()}
    # reference grad: local sums, averaged over ranks with an explicit all_reduce
    plain.zero_grad()
    for xb, yb in batches:
        ((plain(xb) - yb) ** 2).mean().backward()
    ref = {}
    for n, p in plain.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g)
        ref[n] = (g / world_size).reshape(-1)
    group_of = {}
    for g in model._fsdp_engine.groups:
        for i, names in enumerate(g.all_names):
            group_of[names[0]] = (g, i)
    errs = []
    for n, grad in grads.items():
        g, i = group_of[n]
        if strategy == "no_shard":
            want = ref[n]
        else:
            piece = g.layout.shard_slice(i, rank)
            want = ref[n][piece.param_start:piece.param_end]
        errs.append((grad.reshape(-1) - want).abs().max().item() if want.numel() else 0.0)
    out["grad_err"] = max(errs)
    out["ref_grad_nonzero"] = all(v.abs().sum() > 0 for v in ref.values())
    # zero_grad(set_to_none=False) zeroes, set_to_none=True resets accumulation, model.zero_grad(set_to_none=False) too
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad(set_to_none=False)
    out["zeroed"] = all(float(local_piece(p.grad).abs().sum()) == 0 for p in model.parameters())
    xb, yb = batches[0]
    ((model(xb) - yb) ** 2).mean().backward()
    one = {n: local_piece(p.grad).clone() for n, p in model.named_parameters()}
    opt.zero_grad(set_to_none=True)
    ((model(xb) - yb) ** 2).mean().backward()
    two = {n: local_piece(p.grad).clone() for n, p in model.named_parameters()}
    out["set_to_none_resets"] = all(torch.equal(one[n], two[n]) for n in one)
    model.zero_grad(set_to_none=False)
    out["zero_grad_buffer"] = all(float(local_piece(p.grad).abs().sum()) == 0 for p in model.parameters())
    # updated weights used by the next forward without any other call; unshard(async_op=True) early
    before = model(xb).detach()
    ((model(xb) - yb) ** 2).mean().backward()
    opt.step()
    model.unshard(async_op=True)
    after = model(xb).detach()
    out["forward_sees_update"] = not torch.equal(before, after)
    full = model.full_state_dict()
    plain.load_state_dict(full)
    out["forward_matches_full"] = torch.allclose(plain(xb), after, atol=1e-6)
    return out


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_contract_semantics(strategy):
    results = run_distributed(semantics_worker, 2, strategy)
    total_main = sum(r["main_numel"] for r in results)
    for r in results:
        assert r["forward_equal"]
        assert r["main_dtypes"] == {"torch.float32"}
        assert r["all_leaf"]
        assert r["ref_grad_nonzero"]
        assert r["grad_err"] < 1e-6
        assert r["zeroed"] and r["set_to_none_resets"] and r["zero_grad_buffer"]
        assert r["forward_sees_update"] and r["forward_matches_full"]
    if strategy == "no_shard":
        assert all(r["main_numel"] == r["full_numel"] for r in results)
    else:   # shards tile the model: together the ranks hold every element once
        assert total_main == results[0]["full_numel"]


def fused_optimizer_worker(rank, world_size):
    """Fused AdamW updates parameters without bumping version counters; the refresh must still run."""
    out = {}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block],
                            mixed_precision=None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        x, y = make_batches(1, rank, 1)[0]
        losses = []
        for _ in range(3):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        torch.manual_seed(0)
        plain = UnevenNet()
        plain.load_state_dict(model.full_state_dict())
        with torch.no_grad():
            out[strategy] = (losses, torch.allclose(model(x), plain(x), atol=1e-6))
    return out


def test_fused_optimizer_updates_reach_the_next_forward():
    for result in run_distributed(fused_optimizer_worker, 2):
        for strategy, (losses, same_as_full) in result.items():
            assert losses[0] != losses[1] != losses[2], strategy
            assert same_as_full, strategy


def test_unshard_copies_main_weights_into_model_weights(single_rank_group):
    for strategy in ("no_shard", "optim", "optim_grads"):
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
        group = model._fsdp_engine.groups[1]
        with torch.no_grad():
            group.main_params[0].add_(1.0)         # an update the engine was not told about
        model.unshard()                          # the version counter shows the change
        full = model.full_state_dict()
        assert torch.equal(group.params[0].detach(), full[group.param_names[0]]), strategy
