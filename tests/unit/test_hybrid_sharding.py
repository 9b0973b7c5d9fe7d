"""Hybrid sharding (HSDP): ``fully_shard(..., process_group=(outer, inner))`` or a 2-D DeviceMesh.

CPU gloo at 4 ranks (2 replicas x 2 shards) and 8 ranks (2 x 4), every strategy inside:
* training matches torch DDP over the whole world (3 steps of k=2 micro-batches, the first inside
  ``no_sync()``, AdamW), to rtol 1e-5;
* the shard group carries the strategy table's collectives, the outer group exactly one all-reduce
  of this rank's reduced gradients per group and step (the shard's bytes; DDP: all of them), also
  when ZeRO-2/3 reduce-scatter every micro-batch;
* a second synchronized backward before ``step()`` stays exact (averaging replicated gradients
  again changes nothing; at 2x2);
* an optimizer step with gradients still to be averaged across replicas is refused;
* outer groups that do not link equal inner ranks are refused on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn

STEPS, K = 3, 2


def _hybrid_groups(world: int, shard_size: int):
    """(outer, inner) groups of this rank: inner = consecutive ranks, outer = same position."""
    rank = dist.get_rank()
    inner = outer = None
    for start in range(0, world, shard_size):              # every rank creates every group, in order
        group = dist.new_group(list(range(start, start + shard_size)))
        if start <= rank < start + shard_size:
            inner = group
    for position in range(shard_size):
        group = dist.new_group(list(range(position, world, shard_size)))
        if rank % shard_size == position:
            outer = group
    return outer, inner


def _train(model, optimizer, rank, twice=False):
    for step in range(STEPS):
        batches = make_batches(step, rank, K)
        for i, (x, y) in enumerate(batches):
            if i < K - 1:
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            else:
                loss_fn(model(x), y).backward()
                if twice:                                   # a second synchronized backward before step()
                    loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def ddp_reference_and_groups(rank, world, shard_size, use_mesh, twice=False):
    """torch DDP's weights after ``_train`` over the whole world, and the hybrid groups to compare
    with: an (outer, inner) pair or a 2-D mesh (replicate, shard)."""
    torch.manual_seed(0)
    reference = DistributedDataParallel(UnevenNet())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    _train(reference, ref_opt, rank, twice=twice)
    want = {n: p.detach().clone() for n, p in reference.module.state_dict().items()}
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        return want, init_device_mesh("cpu", (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
    return want, _hybrid_groups(world, shard_size)


def parity_worker(rank, world, shard_size, use_mesh):
    want, groups = ddp_reference_and_groups(rank, world, shard_size, use_mesh)
    _train_twice = {}
    out = {}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(rank)          # other weights on every rank: wrapping must start from rank 0's
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], process_group=groups)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.reset_comm_stats()
        _train(model, optimizer, rank)
        stats = model.comm_stats()
        grad_groups = [g for g in model._fsdp_engine.groups if g.requires_grad]
        # the reduced gradients each rank holds (its shard; DDP: all), fp32; the buffers themselves
        # were freed by zero_grad(set_to_none=True)
        shard_bytes = sum((g.layout.shard_numel if g.strategy.optim_sharded else g.layout.total_numel) * 4
                          for g in grad_groups)
        out[strategy] = (model.full_state_dict(), stats, len(grad_groups), shard_bytes)
    if use_mesh or world > 4:            # the second-backward schedule once (2x2 groups) keeps CI short
        return want, out, None
    torch.manual_seed(0)
    reference = DistributedDataParallel(UnevenNet())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    _train(reference, ref_opt, rank, twice=True)
    _train_twice["want"] = {n: p.detach().clone() for n, p in reference.module.state_dict().items()}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], process_group=groups)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        _train(model, optimizer, rank, twice=True)
        _train_twice[strategy] = model.full_state_dict()
    return want, out, _train_twice


@pytest.mark.parametrize("world,shard_size,use_mesh", [(4, 2, False), (4, 2, True), (8, 4, False)],
                         ids=["2x2_groups", "2x2_mesh", "2x4_groups"])
def test_hybrid_sharding_matches_ddp_over_the_world(world, shard_size, use_mesh):
    results = run_distributed(parity_worker, world, shard_size, use_mesh, timeout=600)
    table = {"no_shard": ("all_reduce", 1), "optim": ("reduce_scatter", 1), "optim_grads": ("reduce_scatter", K),
             "optim_grads_params": ("reduce_scatter", K)}
    for rank, (want, out, twice) in enumerate(results):
        for strategy, (state, stats, grad_groups, shard_bytes) in out.items():
            what = (world, shard_size, rank, strategy)
            for name, value in want.items():
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"{what} {name}")
                if twice is not None:
                    torch.testing.assert_close(twice[strategy][name], twice["want"][name], rtol=1e-5, atol=1e-6,
                                               msg=f"{what} twice {name}")
            across = stats["across_replicas"]
            assert across["all_reduce"] == {"count": STEPS * grad_groups, "bytes": STEPS * shard_bytes}, what
            assert across["total_bytes"] == STEPS * shard_bytes, what
            kind, per_step = table[strategy]
            assert stats[kind]["count"] == STEPS * per_step * grad_groups, (what, stats)


def refusals_worker(rank, world):
    outer, inner = _hybrid_groups(world, 2)
    out = {}
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads", process_group=(outer, inner))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_batches(0, rank, 1)[0]
    with model.no_sync():
        loss_fn(model(x), y).backward()
    try:
        optimizer.step()
        out["step"] = None
    except RuntimeError as err:
        out["step"] = str(err)
    model.wait_gradient_reduction()
    optimizer.step()                                      # now the gradients are final
    # outer groups linking different inner ranks: {0, 3} and {1, 2}
    crossed = [dist.new_group(r) for r in ([0, 3], [1, 2])][0 if rank in (0, 3) else 1]
    try:
        fully_shard(UnevenNet(), sharding_strategy="optim", process_group=(crossed, inner))
        out["crossed"] = None
    except ValueError as err:
        out["crossed"] = str(err)
    try:
        fully_shard(UnevenNet(), sharding_strategy="optim", process_group=(outer, inner, inner))
        out["triple"] = None
    except TypeError as err:
        out["triple"] = str(err)
    return out


def test_hybrid_sharding_refuses_unaveraged_steps_and_crossed_groups():
    for out in run_distributed(refusals_worker, 4):
        assert out["step"].startswith("optimizer.step() called with gradients accumulated inside no_sync() but "
                                      "never reduced")
        assert "every outer group must link the ranks with the same rank in their inner groups" in out["crossed"]
        assert out["triple"].startswith("process_group: a hybrid-sharding pair must be (outer replicate group, "
                                        "inner shard group)")


def checkpoint_worker(rank, world, root, save, layout, strategy, outer_sharding="no_shard"):
    """Save after 2 steps (or load) with ``save_checkpoint`` at ``layout``: "<replicas>x<shards>"
    (hybrid) or "flat"; ``outer_sharding``: fully_shard's ``outer_sharding_strategy`` (HFSDP: "optim")."""
    from megatron_fsdp_v2 import load_checkpoint, save_checkpoint
    from tests.state_gather import full_optimizer_state

    groups = _hybrid_groups(world, int(layout.split("x")[1])) if "x" in layout else None
    torch.manual_seed(0 if save else 5)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], process_group=groups,
                        outer_sharding_strategy=outer_sharding)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if save:
        _train(model, optimizer, rank)
        save_checkpoint(f"{root}/ckpt", model, optimizer)
    else:
        load_checkpoint(f"{root}/ckpt", model, optimizer)
    # HSDP's shards repeat across replicas (sum within the inner group); HFSDP's are disjoint over the world
    group = None if (groups is None or outer_sharding == "optim") else groups[1]
    return model.full_state_dict(), full_optimizer_state(model, optimizer, group)


def test_hybrid_checkpoints_load_flat_and_hybrid(tmp_path):
    """Saved at 2 replicas x 2 shards (ZeRO-3), loaded at 4 flat ranks (ZeRO-2), at 2 x 2 (ZeRO-1),
    at 4 x 1 and 1 x 4 (ZeRO-3) and on 1 rank (DDP), bitwise on weights and optimizer state (replicas write their
    identical shards once)."""
    saved = run_distributed(checkpoint_worker, 4, str(tmp_path), True, "2x2", "optim_grads_params")
    for world, layout, strategy in ((4, "flat", "optim_grads"), (4, "2x2", "optim"), (4, "4x1", "optim_grads_params"),
                                    (4, "1x4", "optim_grads_params"), (1, "flat", "no_shard")):
        loaded = run_distributed(checkpoint_worker, world, str(tmp_path), False, layout, strategy)
        for rank, (weights, optimizer) in enumerate(loaded):
            for name, want in saved[0][0].items():
                assert torch.equal(weights[name], want), (layout, rank, name)
            for key, want in saved[0][1].items():
                assert torch.equal(optimizer[key], want), (layout, rank, key)
