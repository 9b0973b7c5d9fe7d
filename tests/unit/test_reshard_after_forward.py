"""``reshard_after_forward`` (FSDP2's argument): ``True`` (ours by default: the strategy table's two
gathers per ZeRO-3 unit and micro-batch), ``None`` (FSDP2's default: the root stays gathered from
its forward to the end of its backward) and ``False`` (no unit reshards after forward). Losses are
the same whatever the rule; ``plan`` predicts the bytes, counts and peaks each rule gives."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard, plan

from .dist_utils import run_distributed
from .models import Block, HeadNet, UnevenNet, make_token_batches
from .test_plan import K, MODELS, _measure, _planned

RULES = (True, None, False)
ZERO3 = "optim_grads_params"


# test_plan.py's model with tied weights, a frozen layer and a one-element unit (the other one runs
# in the tests below)
MODEL = "edge"


def _worker(rank, world_size):
    return {(MODEL, rule, allocator): _measure(rank, MODEL, ZERO3, None, allocator, None, rule)
            for rule in RULES for allocator in ("storage_freeing", "trace_pool")}


@functools.lru_cache(maxsize=None)
def _measured():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("rule", [None, False])
def test_each_rule_trains_alike_and_moves_what_plan_says(rule):
    model_name = MODEL
    planned = _planned(2, None, model_name, ZERO3, reshard_after_forward=rule)
    default = _planned(2, None, model_name, ZERO3)
    for rank, results in enumerate(_measured()):
        for allocator in ("storage_freeing", "trace_pool"):
            got, base = results[(model_name, rule, allocator)], results[(model_name, True, allocator)]
            assert got["loss"] == base["loss"], (rank, allocator)           # the same values, bit for bit
            assert got["comm"] == planned.comm, (rank, allocator)
            assert got["persistent"] == base["persistent"], (rank, allocator)
        assert results[(model_name, rule, "storage_freeing")]["peak"] == planned.temporaries["storage_freeing"]
        assert results[(model_name, rule, "trace_pool")]["pool"] == planned.temporaries["trace_pool"]
    gathers, base_gathers = planned.comm["all_gather"], default.comm["all_gather"]
    root_bytes = sum(g.layout.total_numel * g.dtypes.compute.itemsize for g in _root_groups(model_name))
    if rule is None:       # the root is gathered once per micro-batch instead of twice
        assert base_gathers["bytes"] - gathers["bytes"] == K * root_bytes > 0
    else:                  # every unit once per micro-batch: half the default's gathers
        assert 2 * gathers["count"] == base_gathers["count"] and 2 * gathers["bytes"] == base_gathers["bytes"]


def _root_groups(model_name):
    """The root unit's groups as fully_shard lays them out at 2 CPU ranks."""
    from megatron_fsdp_v2.group.layout import default_alignment
    from megatron_fsdp_v2.plan.groups import planned_units
    from megatron_fsdp_v2.strategy import get_strategy

    model_fn, units, _ = MODELS[model_name]
    with torch.device("meta"):
        model = model_fn()
    return planned_units(model, units, None, 2, default_alignment(torch.device("cpu")),
                         per_parameter=get_strategy(ZERO3).shards_each_parameter)[0].groups


def _kept_worker(rank, world_size):
    """ZeRO-3, ``reshard_after_forward=False``: which units hold gathered weights after an evaluation
    forward, after a training forward, and after its backward."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=ZERO3, unit_modules=[Block], reshard_after_forward=False)
    engine = model._fsdp_engine
    x = torch.randn(3, 7)

    def gathered():
        return [unit.is_unsharded for unit in engine.units]
    with torch.no_grad():
        model(x)
    after_eval = gathered()
    loss = model(x).square().mean()
    after_forward = gathered()
    loss.backward()
    return after_eval, after_forward, gathered()


def test_units_kept_after_forward_are_resharded_by_backward_and_after_evaluation():
    for after_eval, after_forward, after_backward in run_distributed(_kept_worker, 2):
        assert after_eval == [False] * len(after_eval)
        assert after_forward == [True] * len(after_forward) and len(after_forward) > 2
        assert after_backward == [False] * len(after_backward)


@pytest.mark.parametrize("value", [2, "auto", 0.5])
def test_a_bad_rule_is_refused_naming_the_argument(value, single_rank_group):
    with pytest.raises(TypeError, match=r"reshard_after_forward must be True, False or None \(FSDP2's default: "
                                        rf"every unit but the root\), got {value!r}\."):
        fully_shard(nn.Linear(2, 2), sharding_strategy=ZERO3, reshard_after_forward=value)


def _nested_worker(rank, world_size, block_rule, root_rule):
    """Blocks wrapped first with ``block_rule``, then the model with ``root_rule`` (FSDP2's nesting):
    which units hold gathered weights between the forward and the backward."""
    torch.manual_seed(0)
    model = UnevenNet()
    for block in model.blocks:
        fully_shard(block, sharding_strategy=ZERO3, reshard_after_forward=block_rule)
    fully_shard(model, sharding_strategy=ZERO3, reshard_after_forward=root_rule)
    loss = model(torch.randn(3, 7)).square().mean()
    kept = {unit.fqn: unit.is_unsharded for unit in model._fsdp_engine.units}
    loss.backward()
    return kept


@pytest.mark.parametrize("block_rule,root_rule,kept_root,kept_blocks", [
    (None, None, True, False),      # FSDP2's defaults: a block is not the root once the model is wrapped
    (False, True, False, True),     # each call keeps its own rule
    (True, False, True, False),
])
def test_nested_calls_keep_their_own_rule(block_rule, root_rule, kept_root, kept_blocks):
    for kept in run_distributed(_nested_worker, 2, block_rule, root_rule):
        assert kept == {"": kept_root, "blocks.0": kept_blocks, "blocks.1": kept_blocks, "blocks.2": kept_blocks}


def _stale_worker(rank, world_size, rule):
    """A training forward no backward follows (its output dropped), an optimizer step, then the next
    forward: a unit kept gathered since the dropped forward must show the stepped weights."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=ZERO3, unit_modules=[Block], reshard_after_forward=rule)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 7)
    model(x).square().mean().backward()
    model(x)                                   # e.g. a metric computed with grad enabled
    opt.step()
    return model(x).detach()


def test_a_step_after_a_forward_without_backward_gives_kept_units_the_new_weights():
    for rule in (None, False):
        for want, got in zip(run_distributed(_stale_worker, 2, True), run_distributed(_stale_worker, 2, rule)):
            assert torch.equal(want, got), rule


def _root_heavy_worker(rank, world_size, rule):
    """ZeRO-3 on a model whose root outweighs its unit: the allocator's peak over the second step."""
    torch.manual_seed(0)
    model = fully_shard(HeadNet(), sharding_strategy=ZERO3, unit_modules=[Block], reshard_after_forward=rule,
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    alloc = model._fsdp_engine.allocator
    for step in range(2):
        alloc.reset_peak()
        tokens, target = make_token_batches(step, rank, 1, vocab=96)[0]
        logits = model(tokens)
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return alloc.peak_live_bytes


@pytest.mark.parametrize("rule", [True, None])
def test_the_root_reshards_before_its_gradients_reduce(rule):
    """As FSDP2's post-backward: the root's weights are freed once its gradients are complete, so
    its bf16 weights never meet its fp32 reduce input. The peak is then the root's gather (the
    rank-major buffer and the natural one, bf16 each), or its reduce input: both twice the root's
    bf16 bytes. Were the weights kept through the reduce, it would be three times."""
    with torch.device("meta"):
        planned = plan(HeadNet(), ZERO3, world_size=2, unit_modules=[Block], optimizer="adamw", micro_batches=1,
                       device="cpu", reshard_after_forward=rule,
                       mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))[ZERO3]
    root_bf16_bytes = (96 * 8 * 2) * 2
    for peak in run_distributed(_root_heavy_worker, 2, rule):
        assert peak == planned.temporaries["storage_freeing"] == 2 * root_bf16_bytes


class _FrozenInsideRoot(nn.Module):
    """The root's trainable weights (``head``) get their gradients first in backward; the root's
    frozen ``mid`` is used between two units, so its backward, later, reads ``mid``'s weight."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Block(6, 5)
        self.mid = nn.Linear(6, 6)
        self.mid.requires_grad_(False)
        self.second = Block(6, 5)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.second(torch.tanh(self.mid(self.first(x)))))


def _frozen_root_worker(rank, world_size, strategy):
    torch.manual_seed(0)
    model = fully_shard(_FrozenInsideRoot(), sharding_strategy=strategy, unit_modules=[Block])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model.reset_comm_stats()
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    first = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
             for p in model.first.parameters()]
    return losses, first, model.comm_stats()["all_gather"]


def test_the_root_frozen_weights_stay_gathered_through_backward():
    """The root's trainable group reshards once its gradients are complete; its frozen group stays
    gathered to the end of backward, where ``mid``'s backward still reads it: no second gather (the
    plan's count) and the same training as no_shard."""
    with torch.device("meta"):
        planned = plan(_FrozenInsideRoot(), ZERO3, world_size=2, unit_modules=[Block], optimizer="sgd",
                       micro_batches=1, device="cpu")[ZERO3]
    want = run_distributed(_frozen_root_worker, 2, "no_shard")
    got = run_distributed(_frozen_root_worker, 2, ZERO3)
    for (want_losses, want_first, _), (got_losses, got_first, gathers) in zip(want, got):
        assert gathers == planned.comm["all_gather"]
        assert gathers["count"] == 8          # forward and backward: the root's 2 groups and 2 units
        assert got_losses == pytest.approx(want_losses, rel=1e-6, abs=1e-7)
        for a, b in zip(want_first, got_first):
            torch.testing.assert_close(b.reshape(a.shape), a, rtol=1e-5, atol=1e-6)   # (a 0-d weight shows as [1])
