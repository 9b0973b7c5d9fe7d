"""``plan`` equals what the engine holds and counts: persistent_bytes(), the optimizer's state,
comm_stats() of one step and each allocator's peak, at dp 1, 2, 4 and HSDP 2x2, every strategy,
two models (one distributed call per world size runs every combination of it)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard, plan
from megatron_fsdp_v2.plan import NoPlanFitsError
from megatron_fsdp_v2.row_sharded import local_piece

from .dist_utils import run_distributed
from .models import Block, EdgeNet, Tiny, UnevenNet, make_batches, make_token_batches

K = 2
MODELS = {
    "uneven": (UnevenNet, [Block], make_batches),
    "edge": (EdgeNet, [Block, Tiny], make_token_batches),    # tied weights, a frozen layer, a 1-element unit
}
SHAPES = {1: [None], 2: [None], 4: [None, (2, 2)]}


def _loss(out, target):
    if out.dim() == 3:       # EdgeNet's logits
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return ((out - target) ** 2).mean()


def _groups(world: int, inner_size: int):
    rank, inner, outer = dist.get_rank(), None, None
    for start in range(0, world, inner_size):
        group = dist.new_group(list(range(start, start + inner_size)))
        inner = group if start <= rank < start + inner_size else inner
    for position in range(inner_size):
        group = dist.new_group(list(range(position, world, inner_size)))
        outer = group if rank % inner_size == position else outer
    return outer, inner


def _measure(rank, model_name, strategy, shape, allocator, process_group, reshard_after_forward=True):
    """Step 2 (the first steady one: forward order known, pool planned) of K micro-batches: what the
    engine holds and counts, and the last loss."""
    model_fn, units, batches = MODELS[model_name]
    torch.manual_seed(0)
    model = fully_shard(model_fn(), sharding_strategy=strategy, unit_modules=units, allocator=allocator,
                        process_group=process_group, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    alloc = model._fsdp_engine.allocator
    for step in range(2):
        model.reset_comm_stats()
        alloc.reset_peak()
        for i, (x, y) in enumerate(batches(step, rank, K)):
            with model.no_sync() if i < K - 1 else contextlib.nullcontext():
                loss = _loss(model(x), y)
                loss.backward()
        opt.step()
        if step == 1:
            state = sum(local_piece(t).numel() * t.element_size() for s in opt.state.values()
                        for key, t in s.items() if key != "step")
            out = {"persistent": model.persistent_bytes(), "optimizer_state": state, "comm": model.comm_stats(),
                   "peak": alloc.peak_live_bytes, "pool": getattr(alloc, "pool_bytes", None), "loss": loss.item()}
        opt.zero_grad()
    return out


def _worker(rank, world_size):
    results = {}
    for shape in SHAPES[world_size]:
        group = None if shape is None else _groups(world_size, shape[1])
        for model_name in MODELS:
            for strategy in STRATEGY_NAMES:
                for allocator in ("storage_freeing", "trace_pool"):
                    results[(model_name, strategy, shape, allocator)] = _measure(
                        rank, model_name, strategy, shape, allocator, group)
    return results


@functools.lru_cache(maxsize=None)
def _measured(world_size: int):
    return run_distributed(_worker, world_size)


CASES = [(w, shape, m, s) for w in SHAPES for shape in SHAPES[w] for m in MODELS for s in STRATEGY_NAMES]


def _planned(world_size, shape, model_name, strategy, reshard_after_forward=True):
    model_fn, units, _ = MODELS[model_name]
    with torch.device("meta"):
        model = model_fn()
    return plan(model, strategy, world_size=world_size, hybrid_shape=shape, unit_modules=units,
                optimizer="adamw", micro_batches=K, device="cpu", reshard_after_forward=reshard_after_forward)[strategy]


@pytest.mark.parametrize("world_size,shape,model_name,strategy", CASES,
                         ids=[f"dp{w}-{'x'.join(map(str, sh)) if sh else 'flat'}-{m}-{s}" for w, sh, m, s in CASES])
def test_plan_equals_what_the_engine_holds_and_counts(world_size, shape, model_name, strategy):
    planned = _planned(world_size, shape, model_name, strategy)
    per_rank = _measured(world_size)
    for rank, results in enumerate(per_rank):
        inner_rank = rank % (shape[1] if shape else world_size)
        want = planned.ranks[inner_rank]
        for allocator in ("storage_freeing", "trace_pool"):
            got = results[(model_name, strategy, shape, allocator)]
            assert {k: got["persistent"][k] for k in ("model_weights", "main_weights", "grads")} == \
                   {k: want[k] for k in ("model_weights", "main_weights", "grads")}, (rank, allocator)
            assert got["optimizer_state"] == want["optimizer_state"], (rank, allocator)
            assert got["comm"] == planned.comm, (rank, allocator)
        assert results[(model_name, strategy, shape, "storage_freeing")]["peak"] == \
               planned.temporaries["storage_freeing"], rank
        assert results[(model_name, strategy, shape, "trace_pool")]["pool"] == planned.temporaries["trace_pool"], rank


# -- sharding_strategy="auto" ------------------------------------------------------------------

def _auto_worker(rank, world_size, budgets):
    """fully_shard(sharding_strategy="auto") with a per-rank budget: the strategy, the log, or the error."""
    import logging

    from megatron_fsdp_v2 import AutoStrategy

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("megatron_fsdp_v2")
    logger.addHandler(handler)
    saved_level = logger.level
    logger.setLevel(logging.WARNING)     # Python's default: the choice must show without any logging set up
    try:
        model = fully_shard(UnevenNet(), sharding_strategy="auto", unit_modules=[Block],
                            auto_strategy=AutoStrategy(budget_bytes=budgets[rank], optimizer="adamw", micro_batches=K))
        return model.sharding_strategy.name, records
    except NoPlanFitsError as error:
        return f"error: {error}", records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)


def _uneven_plan(budget=None):
    with torch.device("meta"):
        model = UnevenNet()
    return plan(model, world_size=2, unit_modules=[Block], optimizer="adamw", micro_batches=K, device="cpu",
                budget_bytes=budget)


def test_auto_takes_the_fewest_bytes_that_fit_the_smallest_ranks_budget():
    planned = _uneven_plan()
    peaks = {c.strategy: c.peak_bytes for c in planned.candidates}
    # only ZeRO-3 fits rank 1's budget; rank 0 alone would have room for everything
    tight = peaks["optim_grads_params"] + 1
    assert all(peak > tight for name, peak in peaks.items() if name != "optim_grads_params")
    results = run_distributed(_auto_worker, 2, [10 ** 9, tight])
    assert [name for name, _ in results] == ["optim_grads_params"] * 2
    assert "chose optim_grads_params" in results[0][1][0] and "runner-up: none fits" in results[0][1][0]
    assert results[1][1] == []          # logged once, by rank 0
    # with room for all: the fewest bytes sent. On this toy ZeRO-1's torch.chunk pieces pad its
    # buffers well over PADDING_TIE beyond DDP's one buffer (few rows per parameter), so DDP wins;
    # on LLM shapes they tie and ZeRO-1's smaller peak wins (test_auto_ties_bytes_within_padding)
    roomy = run_distributed(_auto_worker, 2, [10 ** 9, 10 ** 9])
    chosen = _uneven_plan(10 ** 9)
    assert [name for name, _ in roomy] == [chosen.chosen.strategy] * 2 == ["no_shard"] * 2
    assert f"runner-up: {chosen.runner_up.name}" in roomy[0][1][0]


@pytest.mark.parametrize("first_rank", [True, False])
def test_auto_announces_its_choice_and_runner_up_on_the_first_rank_only(caplog, first_rank):
    """At Python's default level (WARNING): one line on rank 0 naming the chosen strategy and the
    runner-up; nothing on the other ranks."""
    import logging

    from megatron_fsdp_v2.plan.resolve import announce_choice

    planned = _uneven_plan(10 ** 9)
    assert logging.getLogger("megatron_fsdp_v2").getEffectiveLevel() <= logging.WARNING
    with caplog.at_level(logging.WARNING, logger="megatron_fsdp_v2"):
        announce_choice(planned.chosen, planned.runner_up, 10 ** 9, first_rank)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if not first_rank:
        assert messages == []
        return
    assert len(messages) == 1, messages
    assert f"sharding_strategy='auto' chose {planned.chosen.name} (" in messages[0]
    assert f"runner-up: {planned.runner_up.name} (" in messages[0]


def test_auto_ties_bytes_within_padding_and_takes_the_smaller_peak():
    """Bytes within PADDING_TIE of the fewest tie (the layouts' padding differs), then the smaller
    planned peak wins; beyond it, fewer bytes win whatever the peak."""
    from types import SimpleNamespace

    from megatron_fsdp_v2.plan.auto import PADDING_TIE, choose

    def candidate(name, moved, fit):
        return SimpleNamespace(name=name, strategy=name, moved_bytes=moved, fit_bytes=fit)
    ddp, zero1 = candidate("no_shard", 1000, 900), candidate("optim", int(1000 * (1 + PADDING_TIE / 2)), 500)
    assert [c.name for c in choose([ddp, zero1], 10 ** 6)] == ["optim", "no_shard"]
    zero1_far = candidate("optim", int(1000 * (1 + 2 * PADDING_TIE)), 500)
    assert [c.name for c in choose([ddp, zero1_far], 10 ** 6)] == ["no_shard", "optim"]


def test_auto_with_no_fit_raises_on_every_rank_naming_the_smallest_plan():
    smallest = min(_uneven_plan().candidates, key=lambda c: c.peak_bytes)
    results = run_distributed(_auto_worker, 2, [1000, 1000])
    for message, _ in results:
        assert message.startswith("error: budget_bytes: no sharding plan fits 1000 B")
        assert f"the smallest is {smallest.name} at" in message and f"({smallest.peak_bytes} bytes" in message


def test_plan_chooses_with_a_budget_and_its_table_has_every_strategy():
    planned = _uneven_plan(10 ** 9)
    table = str(planned)
    assert [line.split()[0] for line in table.splitlines()[2:6]] == list(STRATEGY_NAMES)
    assert "budget 953.67 MiB: chosen no_shard, runner-up optim" in table
    with pytest.raises(NoPlanFitsError, match="the smallest is optim_grads_params"):
        _uneven_plan(1000)


@pytest.mark.parametrize("kwargs,message", [
    ({"world_size": 0}, "world_size must be a positive int, got 0"),
    ({"world_size": 4, "hybrid_shape": (2, 3)}, r"hybrid_shape \(2, 3\) must multiply to world_size=4"),
    ({"optimizer": "lion"}, "optimizer must be one of .*'adam'.* got 'lion'"),
    ({"micro_batches": 0}, "micro_batches must be a positive int, got 0"),
    ({"strategies": "zero3"}, "strategies must be one of"),
])
def test_plan_rejects_bad_arguments_naming_them(kwargs, message):
    with torch.device("meta"):
        model = UnevenNet()
    with pytest.raises((ValueError, TypeError), match=message):
        plan(model, **kwargs)


def test_auto_strategy_without_auto_is_refused():
    from megatron_fsdp_v2 import AutoStrategy

    with pytest.raises(ValueError, match="auto_strategy is used with sharding_strategy='auto' only, got "
                                         "sharding_strategy='optim'"):
        fully_shard(UnevenNet(), sharding_strategy="optim", auto_strategy=AutoStrategy(budget_bytes=1))
    with pytest.raises(ValueError, match="AutoStrategy.optimizer must be one of"):
        AutoStrategy(optimizer="lamb")
