"""make_graphed_step on CPU, where no CUDA graph exists: its refusals name the option, its warm-up
steps (the capture-safe schedule: ZeRO-1/2's refresh landed inside the step) train bitwise like
plain steps for every strategy and allocator, the capture itself is refused naming the device, and
the watch sees every change a replay could not ([Note: changes a graph cannot see]). Replay against
eager, bit for bit, runs on the GPU: tests/functional/test_cuda_graph.py."""

import contextlib

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard, make_graphed_step
from megatron_fsdp_v2.comm import COLLECTIVES
from megatron_fsdp_v2.graphs.watch import CaptureWatch
from megatron_fsdp_v2.optim import Muon

from .dist_utils import run_distributed
from .models import Block, UnevenNet

STEPS = 4          # 3 warm-up (graph path) steps, then the capture's refusal


def _build(strategy: str, allocator: str = "storage_freeing", **options):
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], allocator=allocator,
                        **options)
    # (AdamW(capturable=True) refuses CPU parameters; SGD with momentum keeps state like it)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.1)
    return model, optimizer


def _step_fn(model, optimizer, set_to_none: bool = False):
    """Two micro-batches (the first under no_sync), clipping, the step, zeroing in place."""
    def step(inputs, targets):
        losses = []
        for k in range(2):
            sync = model.no_sync() if k == 0 else contextlib.nullcontext()
            with sync:
                loss = nn.functional.mse_loss(model(inputs[k]), targets[k]) / 2
                loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        return torch.stack(losses).sum()
    return step


def _batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(2, 4, 7, generator=g), torch.randn(2, 4, 5, generator=g)) for _ in range(STEPS)]


def _full_weights(model) -> list:
    return [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _warmup_equals_plain(rank, world, strategy, allocator):
    batches = _batches(rank)
    model, optimizer = _build(strategy, allocator)
    plain = [_step_fn(model, optimizer)(*batch) for batch in batches[:STEPS - 1]]
    plain_weights = _full_weights(model)
    plain_in_flight = _refresh_in_flight(model)
    model, optimizer = _build(strategy, allocator)
    graphed = make_graphed_step(_step_fn(model, optimizer), model, optimizer, warmup_steps=STEPS - 1)
    warm = [graphed(*batch).clone() for batch in batches[:STEPS - 1]]
    warm_in_flight = _refresh_in_flight(model)
    with pytest.raises(RuntimeError, match=r"needs the model on a CUDA device, got cpu"):
        graphed(*batches[-1])
    return ([float(a) for a in plain] == [float(b) for b in warm],
            all(torch.equal(a, b) for a, b in zip(plain_weights, _full_weights(model))),
            float(plain[-1]) != float(plain[0]), plain_in_flight, warm_in_flight)


def _refresh_in_flight(model) -> bool:
    """A weight refresh issued by the last step and not yet waited for (it would cross a graph's edge)."""
    return any(group.pending_refresh is not None for group in model._fsdp_engine.groups)


@pytest.mark.parametrize("allocator", ["storage_freeing", "trace_pool"])
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_warmup_steps_train_bitwise_like_plain_steps(strategy, allocator):
    for losses_equal, weights_equal, trained, plain_in_flight, warm_in_flight in run_distributed(
            _warmup_equals_plain, 2, strategy, allocator):
        assert losses_equal and weights_equal and trained
        # capture-safe: ZeRO-1/2's refresh lands within the step (the default schedule leaves it in flight)
        assert not warm_in_flight
        assert plain_in_flight == (strategy in ("optim", "optim_grads"))


def _refusals(rank, world):
    messages = []
    model, optimizer = _build("optim_grads_params", check_for_nan_in_grad=True)
    for call in (lambda: make_graphed_step(lambda: None, model, optimizer),
                 lambda: make_graphed_step(lambda: None, model, torch.optim.AdamW(model.parameters(), capturable=False)),
                 lambda: make_graphed_step(lambda: None, model, Muon(model.parameters())),
                 lambda: make_graphed_step(lambda: None, nn.Linear(2, 2), optimizer),
                 lambda: make_graphed_step(lambda: None, model, optimizer, warmup_steps=0)):
        with pytest.raises((ValueError, TypeError)) as raised:
            call()
        messages.append(str(raised.value))
    model, optimizer = _build("optim")
    graphed = make_graphed_step(_step_fn(model, optimizer, set_to_none=True), model, optimizer)
    batch = _batches(rank)[0]
    with pytest.raises(ValueError) as raised:
        graphed(*batch)
    messages.append(str(raised.value))
    with pytest.raises(ValueError) as raised:
        graphed(batch[0][:, :2], batch[1])
    messages.append(str(raised.value))
    return messages


def test_refusals_name_the_option_on_every_rank():
    for messages in run_distributed(_refusals, 2):
        nan, capturable, muon, unwrapped, warmup, set_to_none, shape = messages
        assert "megatron_fsdp_v2.optim.Muon" in muon and "cannot be captured" in muon
        assert "check_for_nan_in_grad=True" in nan
        assert "capturable=False" in capturable and "capturable=True" in capturable
        assert "model[0] (Linear) is not wrapped" in unwrapped
        assert "warmup_steps must be an int >= 1" in warmup and "got 0" in warmup
        assert "zero_grad(set_to_none=False)" in set_to_none
        assert "input 0 must keep shape (2, 4, 7)" in shape and "got (2, 2, 7)" in shape


def test_the_watch_names_each_change_a_replay_cannot_see():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    lr = torch.tensor(0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    watch = CaptureWatch([model], [optimizer])
    assert watch.changed() is None
    lr.fill_(0.05)                                   # a tensor lr changed in place: the graph reads it
    assert watch.changed() is None
    seen = []
    for change in (lambda: optimizer.param_groups[0].__setitem__("weight_decay", 0.5),
                   lambda: model[0].weight.requires_grad_(False),
                   lambda: setattr(model[1].bias, "grad", None),
                   lambda: optimizer.load_state_dict(optimizer.state_dict())):
        change()
        seen.append(watch.changed())
        watch.record()
    assert seen == ["an optimizer hyperparameter held as a Python number changed (e.g. param_groups[i]['lr'])",
                    "a parameter's requires_grad changed",
                    "a parameter's .grad was replaced or set to None outside the step",
                    "the optimizer's state was loaded (load_state_dict)"]
    watch.close()


def test_unused_parameter_is_refused_naming_it():
    for message in run_distributed(_unused, 2):
        assert "parameter 'spare.weight' got no gradient in the step" in message


def _unused(rank, world):
    torch.manual_seed(0)
    net = UnevenNet()
    net.spare = nn.Linear(2, 2)                      # never called
    model = fully_shard(net, sharding_strategy="no_shard", unit_modules=[Block])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    graphed = make_graphed_step(_step_fn(model, optimizer), model, optimizer)
    with pytest.raises(ValueError) as raised:
        graphed(*_batches(rank)[0])
    return str(raised.value)


def _float8_rebinding(rank, world, strategy):
    """torchao tensorwise float8 (emulated) with its scale precomputed in the step: which tensor
    attributes one eager step rebinds, and that carrying them back keeps training exact."""
    float8 = pytest.importorskip("torchao.float8")
    from megatron_fsdp_v2 import MixedPrecisionPolicy
    from megatron_fsdp_v2.graphs.rebound import carry_rebound, tensor_attributes

    from .test_float8 import Block as Float8Block
    from .test_float8 import Net

    def build():
        torch.manual_seed(0)
        net = Net()
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        float8.convert_to_float8_training(net, config=config, module_filter_fn=lambda m, fqn: fqn != "head")
        model = fully_shard(net, sharding_strategy=strategy, unit_modules=[Float8Block],
                            mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)).bfloat16()

    def train(carry: bool) -> tuple:
        model, optimizer = build()
        rebound, losses = [], []
        for _ in range(4):
            before = tensor_attributes([model], [model._fsdp_engine])
            loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            float8.precompute_float8_dynamic_scale_for_fsdp(model)
            rebound.append(sorted({a.name for a in before if getattr(a.holder, a.name) is not a.tensor}))
            if carry:
                carry_rebound(before)
                assert all(getattr(a.holder, a.name) is a.tensor for a in before)
            losses.append(float(loss))
        return losses, rebound
    plain, rebound = train(carry=False)
    carried, _ = train(carry=True)
    return plain, carried, rebound


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_float8_scales_a_step_rebinds_are_carried_back_exactly(strategy):
    """[Note: attributes a step rebinds]: the scale attributes torchao binds anew each step are
    found (the compute weight's ``_scale``, bound at each cast or gather; with sharded weights also
    precompute's ``_precomputed_scale``), and copying the new values into the old tensors trains
    exactly as binding the new ones does."""
    for plain, carried, rebound in run_distributed(_float8_rebinding, 2, strategy):
        assert carried == plain
        assert plain[-1] < plain[0]
        expected = ["_scale"] if strategy == "no_shard" else ["_precomputed_scale", "_scale"]
        assert rebound[1:] == [expected] * 3, rebound


def test_a_rebinding_to_another_shape_is_refused_naming_it():
    from megatron_fsdp_v2.graphs.rebound import TensorAttribute, carry_rebound

    holder = torch.zeros(3)
    holder._scale = torch.ones(())
    before = [TensorAttribute(holder, "_scale", holder._scale)]
    holder._scale = torch.full((), 2.0)
    assert carry_rebound(before) == 1 and holder._scale is before[0].tensor and float(holder._scale) == 2.0
    holder._scale = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"bound Tensor._scale to a new tensor of \(2,\) torch.float32 on cpu, "
                                           r"where the captured kernels read one of \(\) torch.float32"):
        carry_rebound(before)


class _NothingToReplay:
    """Stands in for the CUDA graph a CPU can not capture: replaying it runs nothing, so only the
    counting of a replay is left to see."""

    def replay(self) -> None:
        pass


def _replayed_counts(rank, world):
    model, optimizer = _build("optim_grads_params")
    graphed = make_graphed_step(_step_fn(model, optimizer), model, optimizer, warmup_steps=1)
    graphed(*_batches(rank)[0])                        # the warm-up: static inputs exist
    model.reset_comm_stats()
    before = graphed._comm_snapshot()
    graphed._eager_step()                              # as the capture runs the step once
    graphed._comm_counts = graphed._comm_delta(before)
    one_step = model.comm_stats()
    model.reset_comm_stats()
    graphed.graph = _NothingToReplay()
    graphed._replay()
    graphed._replay()
    return one_step, model.comm_stats()


def test_each_replay_advances_comm_stats_by_the_captured_step_dtypes_included():
    """make_graphed_step's replay counts what the captured step counted, per collective: calls,
    bytes and bytes by dtype (docs/cuda_graphs.md: comm_stats() reads what an eager step would)."""
    for one_step, replayed in run_distributed(_replayed_counts, 2):
        assert one_step["all_gather"]["count"] > 0 and one_step["reduce_scatter"]["count"] > 0, one_step
        assert one_step["bytes_by_dtype"]["all_gather"] == {"torch.float32": one_step["all_gather"]["bytes"]}
        twice = {name: {"count": 2 * one_step[name]["count"], "bytes": 2 * one_step[name]["bytes"]}
                 for name in COLLECTIVES}
        assert {name: replayed[name] for name in COLLECTIVES} == twice, (one_step, replayed)
        assert replayed["bytes_by_dtype"] == {name: {dtype: 2 * n for dtype, n in split.items()}
                                              for name, split in one_step["bytes_by_dtype"].items()}
