"""Freezing after wrapping reduces only what requires grad ([Note: reducing what requires grad]).

``requires_grad_(False)`` on the weights of a wrapped model, biases left trainable: the next backward
reduces what the same model frozen *before* wrapping reduces (the same bytes and calls, every
strategy, however the wrap-time layout spread the trainable rows over the ranks: an uneven
reduce-scatter, see group/trainable_pack.py), the weights after each step are
bitwise those of the model frozen before wrapping, frozen parameters keep ``.grad`` None, and
unfreezing brings the whole reduction back, training as a torch reference does.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard
from megatron_fsdp_v2.group.layout import build_layout

from .dist_utils import run_distributed
from .models import Block, UnevenNet

K = 2            # micro-batches per step, the first under no_sync()
FROZEN_STEPS = 2  # steps with the weights frozen, then as many unfrozen


class Layer(nn.Module):
    """A unit whose biases fall evenly on two ranks: [up.w 128 | up.b 16 | down.w 128 | down.b 8],
    shards of 140, so rank 0 holds 12 bias elements (up.b[:12]) and rank 1 the other 12."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class EvenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(8, 5, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


MODELS = {"even": (EvenNet, Layer, 8), "uneven": (UnevenNet, Block, 7)}


def is_weight(name: str) -> bool:
    return name.endswith("weight")


def batches(step: int, rank: int, width: int):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return [(torch.randn(4, width, generator=g), torch.randn(4, 5, generator=g)) for _ in range(K)]


def set_weights_trainable(model, trainable: bool) -> None:
    for name, param in model.named_parameters():
        if is_weight(name):
            param.requires_grad_(trainable)


def run_step(model, opt, step, rank, width, reduce_grads=None, no_sync_first=True, set_to_none=True):
    """One step of K micro-batches; returns the gradient reduces of its backwards by kind."""
    if hasattr(model, "reset_comm_stats"):
        model.reset_comm_stats()
    for i, (x, y) in enumerate(batches(step, rank, width)):
        use_no_sync = no_sync_first and i < K - 1 and hasattr(model, "no_sync")
        sync = model.no_sync() if use_no_sync else contextlib.nullcontext()
        with sync:
            ((model(x) - y) ** 2).mean().backward()
    if reduce_grads is not None:
        reduce_grads(model)
    reduced = None
    if hasattr(model, "comm_stats"):
        stats = model.comm_stats()
        reduced = {kind: (stats[kind]["count"], stats[kind]["bytes"]) for kind in ("reduce_scatter", "all_reduce")}
        if "across_replicas" in stats:
            reduced["across_replicas"] = (stats["across_replicas"]["all_reduce"]["count"],
                                          stats["across_replicas"]["all_reduce"]["bytes"])
    grads_none = [name for name, p in model.named_parameters() if p.grad is None]
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return reduced, grads_none


def wrapped(model_cls, unit, strategy, freeze_before: bool, process_group=None):
    torch.manual_seed(0)
    net = model_cls()
    if freeze_before:
        set_weights_trainable(net, False)
    model = fully_shard(net, sharding_strategy=strategy, unit_modules=[unit], process_group=process_group)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def torch_reference(rank, world_size, model_cls, width, weights_trainable):
    """Plain torch on every rank, gradients averaged by hand, the weights trainable or frozen per
    step as ``weights_trainable`` says (AdamW skips a parameter whose .grad is None, as on ours)."""
    torch.manual_seed(0)
    net = model_cls()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)

    def average(model):
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
    for step, trainable in enumerate(weights_trainable):
        set_weights_trainable(net, trainable)
        run_step(net, opt, step, rank, width, reduce_grads=average)
    return {n: p.detach().clone() for n, p in net.state_dict().items()}


def freeze_worker(rank, world_size, strategy, model_name):
    model_cls, unit, width = MODELS[model_name]
    out = {}
    before, before_opt = wrapped(model_cls, unit, strategy, freeze_before=True)
    after, after_opt = wrapped(model_cls, unit, strategy, freeze_before=False)
    full, full_opt = wrapped(model_cls, unit, strategy, freeze_before=False)
    out["full"] = run_step(full, full_opt, 0, rank, width)[0]
    set_weights_trainable(after, False)                      # after wrapping, before its first step
    for step in range(FROZEN_STEPS):
        out[("before", step)] = run_step(before, before_opt, step, rank, width)
        out[("after", step)] = run_step(after, after_opt, step, rank, width)
        frozen_main = [m.grad is None for g in after._fsdp_engine.groups
                       for m, keep in zip(g.main_params, g.trainable) if not keep]
        out[("frozen_main_grads_none", step)] = all(frozen_main) and len(frozen_main) > 0
    out["same_as_before"] = max(float((a - b).abs().max()) for a, b in
                                zip(after.full_state_dict().values(), before.full_state_dict().values()))
    set_weights_trainable(after, True)                       # unfreeze: the whole reduction again
    for step in range(FROZEN_STEPS, 2 * FROZEN_STEPS):
        out[("unfrozen", step)] = run_step(after, after_opt, step, rank, width)
    reference = torch_reference(rank, world_size, model_cls, width, [False] * FROZEN_STEPS + [True] * FROZEN_STEPS)
    state = after.full_state_dict()
    out["vs_torch"] = max(float((state[n] - reference[n]).abs().max()) for n in reference)
    return out


# Gradient reduces of one step (K = 2 micro-batches) at dp 2, fp32: {kind: (calls, bytes)}.
# no_shard / optim reduce once a step, optim_grads / optim_grads_params every micro-batch.
# "even": per Layer 280 elements (1,120 B), 24 of them biases (96 B; frozen before wrapping they
# form a group of 24, and each rank holds 12 of the 24 in the wrap-time layout, so the pack is
# 2 x 12). The root (head.weight only) is wholly frozen: no reduce. "uneven" (UnevenNet, weights
# frozen): the biases, LayerNorm biases and 0-d scales left trainable are spread unevenly over the
# wrap-time shards (an equal-chunk reduce-scatter would cover 2 x max_r T_r = 872 B); the uneven
# reduce-scatter moves the 680 B the model frozen before wrapping moves, as the all-reduce does
# (ZeRO-1/2/3: 712 B, their frozen-before layout padding each parameter to two torch.chunk pieces).
def expected(strategy, model_name, frozen):
    per_microbatch = strategy in ("optim_grads", "optim_grads_params")
    kind = "all_reduce" if strategy == "no_shard" else "reduce_scatter"
    if model_name == "even":
        calls, nbytes = (2, 192) if frozen else (3, 2 * 1120 + 4 * 48)
    else:
        calls = 4                       # the root group [proj | head | offset] keeps proj.bias, offset
        # ZeRO-1/2/3 pad each parameter to dp pieces of torch.chunk rows (group/layout.py, [Note: per-parameter
        # shards]); no_shard all-reduces the unsharded layout
        per_parameter = strategy != "no_shard"
        nbytes = (712 if per_parameter else 680) if frozen else (13728 if per_parameter else 12992)
    rounds = K if per_microbatch else 1
    result = {"reduce_scatter": (0, 0), "all_reduce": (0, 0)}
    result[kind] = (calls * rounds, nbytes * rounds)
    return result


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize("model_name", ["even", "uneven"])
def test_freezing_after_wrap_reduces_what_requires_grad(strategy, model_name):
    results = run_distributed(freeze_worker, 2, strategy, model_name)
    for rank, out in enumerate(results):
        assert out["full"] == expected(strategy, model_name, frozen=False), rank
        for step in range(FROZEN_STEPS):
            before_bytes, before_none = out[("before", step)]
            after_bytes, after_none = out[("after", step)]
            assert after_bytes == expected(strategy, model_name, frozen=True), (rank, step, after_bytes)
            assert after_bytes == before_bytes, (rank, step)           # as frozen before wrapping
            assert after_none == before_none and all(is_weight(n) for n in after_none) and after_none
            assert out[("frozen_main_grads_none", step)]
        assert out["same_as_before"] == 0.0, rank
        for step in range(FROZEN_STEPS, 2 * FROZEN_STEPS):
            reduced, grads_none = out[("unfrozen", step)]
            assert reduced == expected(strategy, model_name, frozen=False), (rank, step)
            assert grads_none == []
        assert out["vs_torch"] < 1e-5, (rank, out["vs_torch"])


def kept_grads_worker(rank, world_size):
    """``zero_grad(set_to_none=False)`` and two synchronized backwards a step, the weights trained,
    frozen for two steps, trained again: as torch (a frozen weight's .grad None must not read as
    the optimizer having dropped the gradients, which would discard the first backward's)."""
    schedule = [True, False, False, True]
    reference = torch_reference(rank, world_size, UnevenNet, 7, schedule)
    out = {}
    for strategy in STRATEGY_NAMES:
        model, opt = wrapped(UnevenNet, Block, strategy, freeze_before=False)
        for step, trainable in enumerate(schedule):
            set_weights_trainable(model, trainable)
            run_step(model, opt, step, rank, 7, no_sync_first=False, set_to_none=False)
        state = model.full_state_dict()
        out[strategy] = max(float((state[n] - reference[n]).abs().max()) for n in reference)
    return out


def test_kept_grads_and_synchronized_backwards_train_as_torch():
    for out in run_distributed(kept_grads_worker, 2):
        assert all(diff < 1e-5 for diff in out.values()), out


def hybrid_worker(rank, world_size):
    """2 replicas x 2 shards, EvenNet, every strategy: the model frozen after wrapping moves the bytes
    of the model frozen before wrapping inside the shard group and across the replicas, and trains
    bitwise like it."""
    outer, inner = _hybrid_groups()
    out = {}
    for strategy in STRATEGY_NAMES:
        before, before_opt = wrapped(EvenNet, Layer, strategy, True, (outer, inner))
        after, after_opt = wrapped(EvenNet, Layer, strategy, False, (outer, inner))
        set_weights_trainable(after, False)
        for step in range(FROZEN_STEPS):
            out[(strategy, step)] = (run_step(before, before_opt, step, rank, 8)[0],
                                     run_step(after, after_opt, step, rank, 8)[0])
        out[(strategy, "diff")] = max(float((a - b).abs().max()) for a, b in
                                      zip(after.full_state_dict().values(), before.full_state_dict().values()))
    return out


def _hybrid_groups():
    """(outer, inner) at 4 ranks: inner {0, 1} {2, 3}, outer {0, 2} {1, 3} (every rank makes every group)."""
    rank = dist.get_rank()
    inners = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    outers = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return outers[rank % 2], inners[rank // 2]


def test_hybrid_sharding_freezing_after_wrap_moves_the_bytes_of_freezing_before():
    for out in run_distributed(hybrid_worker, 4):
        for strategy in STRATEGY_NAMES:
            for step in range(FROZEN_STEPS):
                before, after = out[(strategy, step)]
                assert after == before, (strategy, step)
                # one outer all-reduce per trainable group: DDP all 24 packed biases, else its chunk of 12
                assert after["across_replicas"] == (2, 2 * 4 * (24 if strategy == "no_shard" else 12)), strategy
            assert out[(strategy, "diff")] == 0.0, strategy


def test_pack_layout():
    """The all-reduce pack is the trainable-only layout itself; the reduce-scatter pack gives chunk
    r exactly rank r's trainable pieces (T_r long, the last also the trainable-only layout's
    padding), the input as long as that layout."""
    from megatron_fsdp_v2.group.trainable_pack import trainable_pack

    shapes = [(16, 8), (16,), (8, 16), (8,)]
    layout = build_layout(shapes, 2)
    trainable = (False, True, False, True)
    ar = trainable_pack(layout, trainable, False, 0)
    sub = build_layout([(16,), (8,)], 2)
    assert (ar.numel, [m.packed for m in ar.moves]) == (sub.total_numel, list(sub.offsets)) == (24, [0, 16])
    assert ar.own == ((0, 128, 16), (16, 272, 8))
    rs = [trainable_pack(layout, trainable, True, r) for r in range(2)]
    assert rs[0].numel == 24 and rs[0].chunk == 12 and rs[0].splits == rs[1].splits == (12, 12)
    assert rs[0].moves == rs[1].moves
    assert [tuple(m) for m in rs[0].moves] == [(1, 0, 12, 0), (1, 12, 16, 12), (3, 0, 8, 16)]
    assert rs[0].own == ((0, 128, 12),) and rs[1].own == ((0, 0, 4), (4, 132, 8))
    # uneven: rank 0 holds the first bias and two rows of (3, 4), rank 1 the rest; the biases
    # left trainable are 7 elements on rank 0 and 3 on rank 1
    layout = build_layout([(7,), (3, 4), (2, 4), (3,)], 2)
    assert [[layout.shard_slice(i, r).numel for i in range(4)] for r in range(2)] == [[7, 8, 0, 0], [0, 4, 8, 3]]
    rs = [trainable_pack(layout, (True, False, False, True), True, r) for r in range(2)]
    assert build_layout([(7,), (3,)], 2).total_numel == rs[0].numel == 10
    assert rs[0].splits == rs[1].splits == (7, 3) and [r.chunk for r in rs] == [7, 3]
    assert rs[0].own == ((0, 0, 7),) and rs[1].own == ((0, 12, 3),)
    # the trainable-only layout [7 | (2, 4)] pads to 2 x 8: the last chunk ends in its one zero
    rs = [trainable_pack(layout, (True, False, True, False), True, r) for r in range(2)]
    assert build_layout([(7,), (2, 4)], 2).total_numel == rs[0].numel == 16
    assert rs[0].splits == (7, 9) and rs[1].chunk == 9
    assert trainable_pack(layout, (True,) * 4, True, 0) is None
    assert trainable_pack(layout, (False,) * 4, True, 0) is None
