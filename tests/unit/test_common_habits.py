"""Common training habits that once gave silently wrong results (each reproduced on 2 gloo ranks).

One distributed run per world size collects every case for every strategy (a case that raises
records its error text), and the test functions below assert on those results: a failing case
names itself instead of taking the others down.
"""

from __future__ import annotations

import dataclasses
import traceback
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, MixedPrecisionPolicy, fully_shard, summon_full_params
from megatron_fsdp_v2.row_sharded import local_piece

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn


def _max_diff(full: dict, reference: dict) -> float:
    return max(float((full[name] - want).abs().max()) for name, want in reference.items())


def _ddp_state(model: nn.Module) -> dict:
    return {n: t.detach().clone() for n, t in model.module.state_dict().items()}


def _train_adamw(model: nn.Module, rank: int, steps: int, micro_batches: int) -> None:
    """AdamW(lr=1e-2) steps, each after the backwards of ``micro_batches`` batches of make_batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        for x, y in make_batches(step, rank, micro_batches):
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()


# ---------------------------------------------------------------- item 1: backward twice before step
def backward_twice(rank, strategy):
    """nn.Linear(1, 2) of ones, input rank + 1, two backwards: DDP's grad is 3.0 everywhere."""
    out = {}
    model = nn.Linear(1, 2, bias=False)
    nn.init.ones_(model.weight)
    model = fully_shard(model, sharding_strategy=strategy)
    x = torch.full((1, 1), float(rank + 1))
    for _ in range(2):
        model(x).sum().backward()
    out["grads"] = torch.cat([local_piece(p.grad).reshape(-1) for p in model.parameters()]).tolist()
    if strategy != "optim_grads_params":       # ZeRO-3 frees the weights a second backward needs
        model.zero_grad()
        y = model(x).sum()
        y.backward(retain_graph=True)
        y.backward()
        out["retain_graph_grads"] = torch.cat([local_piece(p.grad).reshape(-1) for p in model.parameters()]).tolist()
    # five AdamW steps of two backwards each, against DDP
    torch.manual_seed(0)
    ddp = DistributedDataParallel(UnevenNet())
    torch.manual_seed(0)
    ours = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    for model_ in (ddp, ours):
        _train_adamw(model_, rank, steps=5, micro_batches=2)
    out["adamw_diff"] = _max_diff(ours.full_state_dict(), _ddp_state(ddp))
    return out


# ---------------------------------------------------------------- item 2: two optimizers, one step
def two_optimizers(rank, strategy):
    """AdamW on the weights, SGD on the biases: both refresh ZeRO-1/2's weights before the forward."""
    def split(named):
        named = list(named)
        return [p for n, p in named if not n.endswith("bias")], [p for n, p in named if n.endswith("bias")]

    torch.manual_seed(0)
    ddp = DistributedDataParallel(UnevenNet(width=64, hidden=256))
    torch.manual_seed(0)
    ours = fully_shard(UnevenNet(width=64, hidden=256), sharding_strategy=strategy, unit_modules=[Block])
    diffs = []
    for model_, named in ((ddp, ddp.module.named_parameters()), (ours, ours.named_parameters())):
        weights, biases = split(named)
        opts = [torch.optim.AdamW(weights, lr=1e-2), torch.optim.SGD(biases, lr=0.1)]
        for step in range(30):
            x, y = make_batches(step, rank, 1)[0]
            loss_fn(model_(x), y).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            if model_ is ours:
                diffs.append(_max_diff(ours.full_state_dict(), _ddp_reference_at[step]))
            else:
                _ddp_reference_at[step] = _ddp_state(ddp)
    return {"max_diff": max(diffs)}


_ddp_reference_at: dict = {}


# ---------------------------------------------------------------- item 3: unused parameters
class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.sometimes = nn.Linear(4, 4)

    def forward(self, x, use_sometimes: bool = False):
        h = self.used(x)
        return self.sometimes(h) if use_sometimes else h


def unused_params(rank, strategy):
    out = {}
    torch.manual_seed(0)
    model = fully_shard(WithUnused(), sharding_strategy=strategy)
    before = model.full_state_dict()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(2, 4)
        model(x).sum().backward()
        out.setdefault("none", []).append(
            {n: p.grad is None for n, p in model.named_parameters() if n.startswith("unused")})
        opt.step()
        opt.zero_grad()
    after = model.full_state_dict()
    out["unused_moved"] = max(float((after[n] - before[n]).abs().max()) for n in after if n.startswith("unused"))
    out["used_moved"] = float((after["used.weight"] - before["used.weight"]).abs().max())
    # used on rank 1 only: every rank gets the DDP mean (find_unused_parameters=True), nobody None
    torch.manual_seed(0)
    ddp = DistributedDataParallel(WithUnused(), find_unused_parameters=True)
    torch.manual_seed(0)
    ours = fully_shard(WithUnused(), sharding_strategy=strategy)
    x = torch.randn(2, 4)
    for m in (ddp, ours):
        m(x, use_sometimes=(rank == 1)).sum().backward()
    ddp_grad = ddp.module.sometimes.weight.grad.reshape(-1)
    group = next(g for g in ours._fsdp_engine.groups if "sometimes.weight" in g.param_names)
    index = group.param_names.index("sometimes.weight")
    if group.strategy.optim_sharded:
        piece = group.layout.shard_slice(index, rank)
        ddp_grad = ddp_grad[piece.param_start:piece.param_end]
    grad = local_piece(group.main_params[index].grad)
    # a rank whose piece is empty has nothing to step: None or empty are both fine there
    out["partial_grad_ok"] = grad is not None or ddp_grad.numel() == 0
    out["partial_diff"] = float((grad.reshape(-1) - ddp_grad).abs().max()) if grad is not None and grad.numel() else 0.0
    out["partial_piece_numel"] = ddp_grad.numel()
    return out


# ---------------------------------------------------------------- item 4: units returning dataclasses
@dataclasses.dataclass
class Inner:
    hidden: torch.Tensor


@dataclasses.dataclass
class BlockOutput:
    inner: Inner
    aux: float


class Holder:
    """A custom container that pytree does not know."""

    def __init__(self, hidden):
        self.hidden = hidden


class DataclassBlock(nn.Module):
    def __init__(self, width, kind):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.kind = kind

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.kind == "dataclass":
            return BlockOutput(Inner(h), 1.0)
        return Holder(h)


class DataclassNet(nn.Module):
    def __init__(self, kind, width=6):
        super().__init__()
        self.blocks = nn.ModuleList(DataclassBlock(width, kind) for _ in range(3))
        self.head = nn.Linear(width, 2)
        self.kind = kind

    def forward(self, x):
        for block in self.blocks:
            out = block(x)
            x = out.inner.hidden if self.kind == "dataclass" else out.hidden
        return self.head(x)


def dataclass_outputs(rank, strategy):
    out = {}
    for kind in ("dataclass", "holder"):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(DataclassNet(kind))
        torch.manual_seed(0)
        ours = fully_shard(DataclassNet(kind), sharding_strategy=strategy, unit_modules=[DataclassBlock])
        for m in (ddp, ours):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for step in range(3):
                torch.manual_seed(step * 10 + rank)
                m(torch.randn(3, 6)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        out[kind] = _max_diff(ours.full_state_dict(), _ddp_state(ddp))
    return out


# ---------------------------------------------------------------- item 5: FSDP2-style nested wrapping
def nested_wrapping(rank, strategy):
    out = {}
    torch.manual_seed(0)
    ddp = DistributedDataParallel(UnevenNet())
    torch.manual_seed(0)
    model = UnevenNet()
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    out["units"] = len(model._fsdp_engine.units)
    out["local_numel"] = sum(local_piece(p).numel() for p in model.parameters())
    for m in (ddp, model):
        _train_adamw(m, rank, steps=3, micro_batches=1)
    out["diff"] = _max_diff(model.full_state_dict(), _ddp_state(ddp))
    # a different strategy for the parent is refused, naming the submodule
    inner = UnevenNet()
    fully_shard(inner.blocks[0], sharding_strategy=strategy)
    other = "no_shard" if strategy != "no_shard" else "optim"
    try:
        fully_shard(inner, sharding_strategy=other)
        out["mixed_error"] = None
    except ValueError as err:
        out["mixed_error"] = str(err)
    return out


# ---------------------------------------------------------------- item 6: optimizer built before wrapping
def optimizer_before_wrap(rank, strategy):
    model = UnevenNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model, sharding_strategy=strategy, unit_modules=[Block])
    x, y = make_batches(0, rank, 1)[0]
    loss_fn(model(x), y).backward()
    try:
        opt.step()
        return None
    except RuntimeError as err:
        return str(err)


# ---------------------------------------------------------------- item 7: freezing after wrapping
def freeze_after_wrap(rank, strategy):
    out = {}
    torch.manual_seed(0)
    ref_model = UnevenNet()
    ref_model.proj.requires_grad_(False)
    ddp = DistributedDataParallel(ref_model)
    for how in ("named_parameters", "module_attribute"):
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
        before = model.full_state_dict()
        if how == "named_parameters":
            for name, p in model.named_parameters():
                if name.startswith("proj."):
                    p.requires_grad_(False)
        else:
            model.proj.weight.requires_grad_(False)
            model.proj.bias.requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for x, y in make_batches(step, rank, 1):
                loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        after = model.full_state_dict()
        out[how] = max(float((after[n] - before[n]).abs().max()) for n in ("proj.weight", "proj.bias"))
        out[how + "_requires_grad"] = (model.proj.weight.requires_grad,
                                       [p.requires_grad for n, p in model.named_parameters() if n.startswith("proj.")])
        out[how + "_state"] = after
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for x, y in make_batches(step, rank, 1):
            loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["ddp_diff"] = _max_diff(out.pop("named_parameters_state"), _ddp_state(ddp))
    out.pop("module_attribute_state")
    # unfreezing a parameter frozen at wrap time is refused
    frozen = UnevenNet()
    frozen.proj.requires_grad_(False)
    model = fully_shard(frozen, sharding_strategy=strategy)
    model.proj.weight.requires_grad_(True)
    try:
        model(make_batches(0, rank, 1)[0][0])
        out["unfreeze_error"] = None
    except ValueError as err:
        out["unfreeze_error"] = str(err)
    return out


# ---------------------------------------------------------------- item 8: buffers and BatchNorm
class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.bn(self.lin(x)))


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(x)


class BNBlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.norm = BNBlock()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


def batchnorm(rank, strategy):
    out = {}
    for broadcast in (True, False):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(BNNet(), broadcast_buffers=broadcast)
        torch.manual_seed(0)
        ours = fully_shard(BNNet(), sharding_strategy=strategy, broadcast_buffers=broadcast)
        for m in (ddp, ours):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for step in range(3):
                torch.manual_seed(100 * step + rank)
                m(torch.randn(8, 5) * (rank + 1)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        out[broadcast] = {
            "running_mean_diff": float((ours.bn.running_mean - ddp.module.bn.running_mean).abs().max()),
            "weights_diff": _max_diff(ours.full_state_dict(), _ddp_state(ddp)),
            "running_mean": ours.bn.running_mean.clone(),
        }
    # bf16 compute: BatchNorm's parameters stay fp32 by default ...
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = fully_shard(BNNet(), sharding_strategy=strategy, mixed_precision=bf16)
    y = model(torch.randn(8, 5, dtype=torch.bfloat16))
    y.float().pow(2).mean().backward()
    out["bf16_default"] = (str(y.dtype), [g.dtypes.compute for g in model._fsdp_engine.groups])
    # ... or a per-unit policy: a nested call keeps the norm unit in fp32 with the exception off
    torch.manual_seed(0)
    net = BNBlockNet()
    fully_shard(net.norm, sharding_strategy=strategy)
    no_exception = MixedPrecisionPolicy(param_dtype=torch.bfloat16, full_precision_modules=())
    fully_shard(net, sharding_strategy=strategy, mixed_precision=no_exception)
    y = net(torch.randn(8, 5, dtype=torch.bfloat16))
    y.float().pow(2).mean().backward()
    out["bf16_per_unit"] = sorted((g.name, str(g.dtypes.compute)) for g in net._fsdp_engine.groups)
    try:
        torch.manual_seed(0)
        bad = fully_shard(BNNet(), sharding_strategy=strategy, mixed_precision=no_exception)
        bad(torch.randn(8, 5, dtype=torch.bfloat16)).float().sum().backward()
        out["bf16_no_exception_error"] = None
    except RuntimeError as err:
        out["bf16_no_exception_error"] = str(err)
    return out


# ---------------------------------------------------------------- item 9: summon_full_params
def summon(rank, strategy):
    out = {}
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    full = model.full_state_dict()
    out["outside_shape"] = tuple(model.head.weight.shape)
    out["outside_is_optimizer_tensor"] = model.head.weight is dict(model.named_parameters())["head.weight"]
    with model.summon_full_params():
        out["inside_shape"] = tuple(model.head.weight.shape)
        out["inside_diff"] = float((model.head.weight - full["head.weight"]).abs().max())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["norm"] = float(model.blocks[0].up.weight.norm())      # no graph: torch's scalar warning stays away
        out["inside_warnings"] = [str(w.message) for w in caught]
        out["inside_grad_mode"] = torch.is_grad_enabled()
        model.head.weight.mul_(0.5)                                    # in place, no torch.no_grad() needed
    out["after_grad_mode"] = torch.is_grad_enabled()
    out["writeback_diff"] = float((model.full_state_dict()["head.weight"] - 0.5 * full["head.weight"]).abs().max())
    with summon_full_params(model, writeback=False):
        model.head.weight.zero_()
    out["discard_diff"] = float((model.full_state_dict()["head.weight"] - 0.5 * full["head.weight"]).abs().max())
    out["want_norm"] = float(full["blocks.0.up.weight"].norm())
    # the forward after a writeback computes with the written weights
    x = make_batches(0, rank, 1)[0][0]
    torch.manual_seed(0)
    ref = UnevenNet()
    ref.load_state_dict({k: v for k, v in model.full_state_dict().items()})
    out["forward_diff"] = float((model(x) - ref(x)).abs().max())
    # FSDP1's options: full gradients, rank 0 only, CPU copies
    x, y = make_batches(0, rank, 1)[0]
    torch.manual_seed(0)
    ddp = DistributedDataParallel(UnevenNet())
    loss_fn(ddp(x), y).backward()
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    loss_fn(model(x), y).backward()
    want = dict(ddp.module.named_parameters())
    with model.summon_full_params(writeback=False, with_grads=True, offload_to_cpu=True):
        out["with_grads_diff"] = max(float((p.grad - want[n].grad).abs().max())
                                     for n, p in nn.Module.named_parameters(model))
        out["offloaded_device"] = str(model.head.weight.device)
    with model.summon_full_params(writeback=False, rank0_only=True):
        out["rank0_only_shape"] = tuple(model.head.weight.shape)
    try:
        with model.summon_full_params(rank0_only=True):
            pass
        out["rank0_writeback_error"] = None
    except ValueError as err:
        out["rank0_writeback_error"] = str(err)
    return out


# ---------------------------------------------------------------- item 10: torch.compile
def compiled(rank, strategy):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(UnevenNet())
    torch.manual_seed(0)
    ours = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    runner = torch.compile(ours)
    for m, call in ((ddp, ddp), (ours, runner)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(3):
            for x, y in make_batches(step, rank, 1):
                loss_fn(call(x), y).backward()
            opt.step()
            opt.zero_grad()
    return _max_diff(ours.full_state_dict(), _ddp_state(ddp))


CASES = {
    "backward_twice": backward_twice,
    "two_optimizers": two_optimizers,
    "unused_params": unused_params,
    "dataclass_outputs": dataclass_outputs,
    "nested_wrapping": nested_wrapping,
    "optimizer_before_wrap": optimizer_before_wrap,
    "freeze_after_wrap": freeze_after_wrap,
    "batchnorm": batchnorm,
    "summon": summon,
}


def habits_worker(rank, world_size, cases):
    results = {}
    for case in cases:
        for strategy in STRATEGY_NAMES:
            try:
                results[(case, strategy)] = ("ok", CASES[case](rank, strategy))
            except Exception:  # noqa: BLE001 - reported per case
                results[(case, strategy)] = ("error", traceback.format_exc())
    return results


def compile_worker(rank, world_size):
    results = {}
    for strategy in STRATEGY_NAMES:
        try:
            results[strategy] = ("ok", compiled(rank, strategy))
        except Exception:  # noqa: BLE001
            results[strategy] = ("error", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def habits():
    return run_distributed(habits_worker, 2, list(CASES), timeout=600)


def _ok(results, case, strategy):
    status, value = results[(case, strategy)]
    assert status == "ok", f"{case} / {strategy} raised:\n{value}"
    return value


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_backward_twice_before_step_accumulates_like_ddp(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "backward_twice", strategy)
        assert out["grads"] and all(g == pytest.approx(3.0) for g in out["grads"]), out["grads"]
        if strategy != "optim_grads_params":
            assert all(g == pytest.approx(3.0) for g in out["retain_graph_grads"]), out["retain_graph_grads"]
        assert out["adamw_diff"] < 1e-5


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_two_optimizers_before_the_next_forward_see_fresh_weights(habits, strategy):
    for rank_results in habits:
        assert _ok(rank_results, "two_optimizers", strategy)["max_diff"] < 1e-5


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_unused_parameter_keeps_grad_none(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "unused_params", strategy)
        assert all(all(step.values()) and step for step in out["none"]), out["none"]
        assert out["unused_moved"] == 0.0            # AdamW neither decayed nor moved it
        assert out["used_moved"] > 1e-3
        assert out["partial_grad_ok"] and out["partial_diff"] < 1e-6


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_units_returning_dataclasses_and_custom_containers_train(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "dataclass_outputs", strategy)
        assert out["dataclass"] < 1e-6 and out["holder"] < 1e-6, out


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_nested_fully_shard_calls_compose(habits, strategy):
    numels = []
    for rank_results in habits:
        out = _ok(rank_results, "nested_wrapping", strategy)
        assert out["units"] == 4                      # root + the three wrapped blocks
        assert out["diff"] < 1e-5
        assert "submodule 'blocks.0' was wrapped with" in out["mixed_error"]
        numels.append(out["local_numel"])
    total = sum(p.numel() for p in UnevenNet().parameters())
    assert (sum(numels) if strategy != "no_shard" else numels[0]) == total


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_optimizer_built_before_wrapping_raises_at_step(habits, strategy):
    for rank_results in habits:
        message = _ok(rank_results, "optimizer_before_wrap", strategy)
        assert message is not None and "Build the optimizer after fully_shard" in message
        assert "'offset'" in message                 # the first parameter the optimizer holds


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_freezing_after_wrapping_is_honoured(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "freeze_after_wrap", strategy)
        assert out["named_parameters"] == 0.0 and out["module_attribute"] == 0.0
        assert out["named_parameters_requires_grad"] == (False, [False, False])
        assert out["module_attribute_requires_grad"] == (False, [False, False])
        assert out["ddp_diff"] < 1e-5
        assert "'proj.weight' was frozen when fully_shard wrapped it" in out["unfreeze_error"]


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_buffers_broadcast_like_ddp_and_batchnorm_under_bf16(habits, strategy):
    r0, r1 = (_ok(r, "batchnorm", strategy) for r in habits)
    for out in (r0, r1):
        assert out[True]["running_mean_diff"] < 1e-6 and out[True]["weights_diff"] < 1e-5
        assert out[False]["running_mean_diff"] < 1e-6 and out[False]["weights_diff"] < 1e-5
        assert torch.float32 in out["bf16_default"][1] and torch.bfloat16 in out["bf16_default"][1]
        assert ("norm/float32/grad", "torch.float32") in out["bf16_per_unit"]
        assert "expected scalar type" in out["bf16_no_exception_error"]
    # the switch matters: rank 1's statistics depend on it (and equal DDP's either way, above)
    assert not torch.equal(r1[True]["running_mean"], r1[False]["running_mean"])


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_summon_full_params_gathers_and_writes_back_with_grad_mode_off(habits, strategy):
    for rank, rank_results in enumerate(habits):
        out = _ok(rank_results, "summon", strategy)
        # between steps the module holds the tensor the optimizer steps (original shape, every strategy)
        assert out["outside_shape"] == (5, 13) and out["outside_is_optimizer_tensor"]
        assert out["inside_shape"] == (5, 13) and out["inside_diff"] == 0.0
        assert out["norm"] == pytest.approx(out["want_norm"]) and out["norm"] > 0
        assert out["inside_warnings"] == [] and out["inside_grad_mode"] is False and out["after_grad_mode"] is True
        assert out["writeback_diff"] == 0.0 and out["discard_diff"] == 0.0
        assert out["forward_diff"] < 1e-6
        assert out["with_grads_diff"] < 1e-6 and out["offloaded_device"] == "cpu"
        assert out["rank0_only_shape"] == ((5, 13) if rank == 0 else out["outside_shape"])
        assert "rank0_only=True needs writeback=False" in out["rank0_writeback_error"]


def test_torch_compile_of_the_whole_model_trains_like_ddp():
    for rank_results in run_distributed(compile_worker, 2, timeout=600):
        for strategy, (status, value) in rank_results.items():
            assert status == "ok", f"{strategy}:\n{value}"
            assert value < 1e-5, strategy
