"""torchao float8 training through FSDP2's all-gather extension protocol, on CPU (emulated float8).

The recipe of issue 47: ``convert_to_float8_training(..., enable_fsdp_float8_all_gather=True)``,
then ``fully_shard``, then ``precompute_float8_dynamic_scale_for_fsdp(model)`` after each step.
Every strategy must train as torch DDP and FSDP2 do with the same conversion; before the protocol
the float8 layers computed with their own stale copy of the weights (loss 0.415 after 6 steps where
DDP reaches 0.081 on the model below).

torchao's rowwise recipes (``Float8LinearConfig.from_recipe_name("rowwise")`` and
``"rowwise_with_gw_hp"``, the ones torchtitan recommends) keep plain high-precision weights: they
cast inside each matmul, so every strategy gathers the weights in their own dtype, never in float8,
and trains as torch DDP does with the same conversion, eager and compiled.
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard
from tests.unit.dist_utils import run_distributed

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install '.[float8]')")

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
ROWWISE = ["rowwise", "rowwise_with_gw_hp"]
WIDTH = 32


class Block(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


def float8_config(recipe: str = "tensorwise"):
    """Emulated float8 (CPU): ``"tensorwise"`` with float8 all-gather (issue 47's recipe), or one of
    torchao's named recipes as they come, ``emulate`` set on the frozen config."""
    if recipe == "tensorwise":
        return torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    return dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def float8_net(seed: int = 0, convert: bool = True, recipe: str = "tensorwise") -> Net:
    torch.manual_seed(seed)
    model = Net()
    if convert:
        torchao_float8.convert_to_float8_training(model, config=float8_config(recipe),
                                                  module_filter_fn=lambda m, fqn: fqn != "head")
    return model


def wrap(model: Net, system: str, bf16: bool):
    if system == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else TorchPolicy()
        for block in model.blocks:
            torch_fully_shard(block, mp_policy=policy)
        return torch_fully_shard(model, mp_policy=policy)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    return fully_shard(model, sharding_strategy=system, unit_modules=[Block], mixed_precision=policy)


def train_worker(rank, world_size, system, steps, bf16=False, precompute=True, recipe="tensorwise"):
    """The losses (averaged over ranks) and, for ours, the dtypes its all-gathers carried."""
    model = wrap(float8_net(recipe=recipe), system, bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, 1, generator=g)
    if bf16:
        x = x.bfloat16()                     # FSDP2's policy casts forward inputs; ours leaves them to the model
    losses = []
    for _ in range(steps):
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:                       # (rowwise: no float8 weight, nothing to precompute)
            torchao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    gathered = model.comm_stats()["bytes_by_dtype"].get("all_gather", {}) if system not in ("ddp", "fsdp2") else None
    return losses, gathered


def _losses(system, world_size=2, steps=8, bf16=False, precompute=True, recipe="tensorwise"):
    return run_distributed(train_worker, world_size, system, steps, bf16, precompute, recipe)[0][0]


@pytest.fixture(scope="module")
def reference_losses():
    return {"ddp": _losses("ddp"), "fsdp2": _losses("fsdp2")}


@functools.lru_cache(maxsize=None)
def _ddp_losses(recipe: str) -> list:
    return _losses("ddp", recipe=recipe)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_like_ddp_and_fsdp2(strategy, reference_losses):
    ours = _losses(strategy)
    assert reference_losses["ddp"] == pytest.approx(reference_losses["fsdp2"], abs=1e-5)
    assert ours == pytest.approx(reference_losses["fsdp2"], abs=1e-4), (strategy, ours, reference_losses["fsdp2"])
    assert ours[-1] < 0.5 * ours[0]          # it trains (the stale-copy bug stayed near 0.4)


@pytest.mark.parametrize("recipe", ROWWISE)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rowwise_recipes_train_like_ddp_and_gather_no_float8(strategy, recipe):
    """torchao's rowwise recipes, every strategy: DDP's losses with the same conversion bit for bit
    (0.019 / 0.028 from the tensorwise conversion's within 8 steps), and every all-gather carries
    the fp32 weights (the sharded strategies gather; no_shard does not)."""
    (losses, gathered), _ = run_distributed(train_worker, 2, strategy, 8, False, True, recipe)
    assert losses == _ddp_losses(recipe), (losses, _ddp_losses(recipe))
    assert losses[-1] < 0.5 * losses[0], losses
    assert list(gathered) == ([] if strategy == "no_shard" else ["torch.float32"]), gathered


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_uneven_rows_and_dynamic_scales(strategy):
    """dp 3: 64 and 32 rows split 22/22/20 and 11/11/10 (ours pads the last pieces' float8 rows;
    FSDP2 gathers torchao's unpadded pieces and gloo aborts on the size mismatch); without the
    precomputed scales every gather reduces the amax itself."""
    ddp = _losses("ddp", world_size=3, steps=5, precompute=False)
    ours = _losses(strategy, world_size=3, steps=5, precompute=False)
    assert ours == pytest.approx(ddp, abs=1e-4)


def collectives_worker(rank, world_size, strategy, precompute):
    """One step after a first: every collective dispatched (c10d's, and the functional ones torchao's
    amax all-reduce uses), against what comm_stats() counts."""
    from tests.comm_counter import EveryCollectiveCounter

    model = wrap(float8_net(), strategy, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, WIDTH), torch.randn(16, 1)
    counter = EveryCollectiveCounter()
    for step in range(2):
        model.reset_comm_stats()
        counter.calls.clear()
        with counter:
            (model(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                torchao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
    seen = counter.summary()
    stats = model.comm_stats()
    return {name: (seen.get(name, (0, 0))[0], stats[name]["count"]) for name in ("all_reduce", "all_gather")}


@pytest.mark.parametrize("strategy,world_size,precompute", [("no_shard", 2, False), ("no_shard", 2, True),
                                                             ("optim_grads_params", 1, False)])
def test_whole_weights_cast_without_an_amax_all_reduce(strategy, world_size, precompute):
    """no_shard (and a group of one rank) holds whole weights, which torchao's precompute does not
    reach: their dynamic scale is computed here, so the only collectives are those comm_stats()
    counts (before: one amax all-reduce per float8 weight per step, uncounted). The losses stay
    DDP's (test_every_strategy_trains_like_ddp_and_fsdp2)."""
    for rank, counts in enumerate(run_distributed(collectives_worker, world_size, strategy, precompute)):
        assert counts["all_reduce"][0] == counts["all_reduce"][1], (rank, counts)
        assert counts["all_gather"] == (0, 0) or strategy != "no_shard", (rank, counts)


@pytest.mark.parametrize("recipe", ["tensorwise"] + ROWWISE)
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_bf16_compute_trains_like_fsdp2(strategy, recipe):
    """bf16 compute: FSDP2's losses with the same conversion (rowwise: bit for bit, both gather bf16)."""
    fsdp2 = _losses("fsdp2", steps=6, bf16=True, recipe=recipe)
    ours = _losses(strategy, steps=6, bf16=True, recipe=recipe)
    assert ours == pytest.approx(fsdp2, abs=1e-3 if recipe == "tensorwise" else 0, rel=0), (ours, fsdp2)


# ---------------------------------------------------------------- what the module holds, what moves
def holdings_worker(rank, world_size, strategy, convert, recipe="tensorwise"):
    model = wrap(float8_net(convert=convert, recipe=recipe), strategy, bf16=True)
    weight = model.blocks[0].fc1.weight                   # between steps: the main parameter
    local = weight._local_tensor if hasattr(weight, "_local_tensor") else weight
    seen = {}
    hook = model.blocks[0].fc1.register_forward_pre_hook(lambda m, args: seen.update(
        kind=type(m.weight).__name__, data_dtype=getattr(m.weight, "_data", m.weight).dtype,
        shape=tuple(m.weight.shape), dtype=m.weight.dtype))
    model.reset_comm_stats()
    model(torch.randn(4, WIDTH, dtype=torch.bfloat16)).float().sum().backward()
    hook.remove()
    stats = model.comm_stats()
    return {"main": type(local).__name__, "main_dtype": local.dtype, **seen,
            "gather_bytes": stats["all_gather"]["bytes"], "scales": stats.get("gather_scales"),
            "gathered": stats["bytes_by_dtype"]["all_gather"]}


@functools.lru_cache(maxsize=None)
def _holdings(strategy: str, convert: bool, recipe: str = "tensorwise") -> dict:
    return run_distributed(holdings_worker, 2, strategy, convert, recipe)[0]


@pytest.mark.parametrize("strategy", ["optim_grads_params"])
def test_zero3_gathers_float8_bytes(strategy):
    """ZeRO-3 at dp 2: the float8 layers' weights travel as one byte per element where bf16 moves
    two, everything else alike; forward sees torchao's float8 tensor of the original shape, the
    optimizer steps fp32 main shards held in torchao's weight class."""
    fp8, bf16 = _holdings(strategy, True), _holdings(strategy, False)
    assert (fp8["main"], fp8["main_dtype"]) == ("WeightWithDynamicFloat8CastTensor", torch.float32)
    assert (fp8["kind"], fp8["data_dtype"], fp8["dtype"]) == ("Float8TrainingTensor", torch.float8_e4m3fn, torch.bfloat16)
    assert fp8["shape"] == bf16["shape"] == (2 * WIDTH, WIDTH)
    block_weights_bf16 = 2 * (2 * WIDTH * WIDTH) * 2      # fc1 + fc2 weights of one block in bf16
    gathers = 2 * 3                                       # each block: in forward, again in backward
    assert bf16["gather_bytes"] - fp8["gather_bytes"] == gathers * block_weights_bf16 // 2, (bf16, fp8)
    # one fp32 scale per float8 weight per gather; none without float8
    assert fp8["scales"] == {"count": gathers * 2, "bytes": gathers * 2 * 4} and bf16["scales"] is None
    # comm_stats() says what travelled: the float8 weights' bytes (gathered as uint8) as float8
    float8_bytes = gathers * block_weights_bf16 // 2
    assert fp8["gathered"] == {"torch.float8_e4m3fn": float8_bytes,
                               "torch.bfloat16": fp8["gather_bytes"] - float8_bytes}, fp8["gathered"]
    assert bf16["gathered"] == {"torch.bfloat16": bf16["gather_bytes"]}, bf16["gathered"]


@pytest.mark.parametrize("recipe", ROWWISE)
def test_rowwise_recipes_gather_the_bf16_weights(recipe):
    """ZeRO-3 at dp 2, bf16 compute: a rowwise recipe's weights are plain parameters, gathered in the
    param_dtype exactly as an unconverted model's (same bytes, all bf16, no float8 scale); forward
    sees the bf16 weight and torchao casts it inside the matmul."""
    rowwise, bf16 = _holdings("optim_grads_params", True, recipe), _holdings("optim_grads_params", False)
    assert (rowwise["main"], rowwise["main_dtype"]) == (bf16["main"], torch.float32), rowwise
    assert (rowwise["kind"], rowwise["dtype"], rowwise["shape"]) == (bf16["kind"], torch.bfloat16, (2 * WIDTH, WIDTH))
    assert rowwise["gather_bytes"] == bf16["gather_bytes"] > 0
    assert rowwise["gathered"] == {"torch.bfloat16": bf16["gather_bytes"]}, rowwise["gathered"]
    assert rowwise["scales"] is None


def meta_worker(rank, world_size, strategy):
    """The same float8 model built eagerly and on meta, wrapped and trained 3 steps."""
    out = {}
    for where in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(where):
            model = Net()
        config = torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        torchao_float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "head")
        model = fully_shard(model, sharding_strategy=strategy, unit_modules=[Block])
        weights = model.full_state_dict()
        classes = sorted({g.name.rsplit("/", 1)[-1] for g in model._fsdp_engine.groups if g.extension is not None})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, 1, generator=g)
        losses = []
        for _ in range(3):
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torchao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
            losses.append(loss.item())
        out[where] = (weights, classes, losses)
    return out


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_a_float8_model_built_on_meta_keeps_its_class_and_the_eager_weights(strategy):
    """wrap/meta_init.py's placeholders keep a protocol tensor's class: before, a float8 model built
    on meta lost torchao's weight class at the wrap and gathered bf16."""
    for rank, out in enumerate(run_distributed(meta_worker, 2, strategy)):
        (eager, eager_classes, eager_losses), (meta, meta_classes, meta_losses) = out["cpu"], out["meta"]
        assert meta_classes == eager_classes == ["WeightWithDynamicFloat8CastTensor"], (rank, meta_classes)
        assert sorted(meta) == sorted(eager)
        assert all(torch.equal(meta[name], eager[name]) for name in eager), rank
        assert meta_losses == eager_losses, (rank, meta_losses, eager_losses)


# ---------------------------------------------------------------- refusals
class OpaqueTensor(torch.Tensor):
    """A tensor subclass with no all-gather protocol."""


def refused_worker(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(OpaqueTensor))
    try:
        fully_shard(model, sharding_strategy="optim_grads_params")
    except TypeError as error:
        return str(error)
    return None


def test_unknown_tensor_subclass_is_refused_on_every_rank():
    for message in run_distributed(refused_worker, 2):
        assert message is not None
        assert message.startswith("module: parameter '0.weight' is a tests.unit.test_float8.OpaqueTensor, a tensor "
                                  "subclass that fully_shard can not shard"), message


# ---------------------------------------------------------------- torch.compile
def compile_worker(rank, world_size, strategy, convert, where, steps, recipe="tensorwise"):
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = float8_net(convert=convert, recipe=recipe)
    if where == "block":                  # torchtitan's recipe: compile each block, then shard
        for block in model.blocks:
            block.compile(backend="aot_eager")
    model = wrap(model, strategy, bf16=False)
    if where == "model":                  # or compile the wrapped model
        model.compile(backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, 1, generator=g)
    losses, breaks = [], []
    for _ in range(steps):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
        breaks.append(sum(counters["graph_break"].values()))
    return losses, breaks


@pytest.mark.parametrize("strategy,convert,where,recipe", [("optim_grads_params", True, "block", "tensorwise"),
                                                           ("optim_grads", True, "block", "tensorwise"),
                                                           ("optim", True, "model", "tensorwise"),
                                                           ("no_shard", True, "model", "tensorwise"),
                                                           ("no_shard", False, "block", "tensorwise"),
                                                           ("optim_grads_params", True, "block", "rowwise"),
                                                           ("optim_grads", True, "block", "rowwise_with_gw_hp"),
                                                           ("optim", True, "model", "rowwise"),
                                                           ("no_shard", True, "block", "rowwise_with_gw_hp")])
def test_compiled_training_equals_eager(strategy, convert, where, recipe):
    """Compiled per block before wrapping, or as a whole after: the losses of eager, and no graph
    break after the first step (ours breaks only at its unit hooks, which run eagerly)."""
    eager = run_distributed(train_worker, 2, strategy, 5, False, True, recipe)[0][0] if convert else None
    losses, breaks = run_distributed(compile_worker, 2, strategy, convert, where, 5, recipe)[0]
    if convert:
        assert losses == pytest.approx(eager, abs=1e-5)
    assert losses[-1] < 0.5 * losses[0]
    assert breaks[-1] == breaks[0], breaks


def offload_refused_worker(rank, world_size):
    from megatron_fsdp_v2 import OffloadPolicy
    try:
        fully_shard(float8_net(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                    offload=OffloadPolicy(fraction=1.0))
    except ValueError as error:
        return str(error)
    return None


def test_offloading_float8_weights_is_refused_on_every_rank():
    for message in run_distributed(offload_refused_worker, 2):
        assert message is not None and message.startswith("offload: parameter '"), message
        assert "WeightWithDynamicFloat8CastTensor that gathers itself" in message and "allowed:" in message


def checkpoint_worker(rank, world_size, path, save_strategy, load_strategy):
    """Train 3 steps, save; a fresh model of another strategy loads it and must hold the same
    weights; both continue one step to the same loss."""
    from megatron_fsdp_v2 import load_checkpoint, save_checkpoint
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, WIDTH, generator=g), torch.randn(16, 1, generator=g)

    def step(model, opt):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
        return loss.item()

    model = wrap(float8_net(), save_strategy, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        step(model, opt)
    save_checkpoint(path, model, opt)
    saved = model.full_state_dict()
    loaded = wrap(float8_net(seed=1), load_strategy, bf16=False)
    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    load_checkpoint(path, loaded, opt2)
    torchao_float8.precompute_float8_dynamic_scale_for_fsdp(loaded)
    same = all(torch.equal(saved[k], v) for k, v in loaded.full_state_dict().items())
    return same, step(model, opt), step(loaded, opt2)


@pytest.mark.parametrize("save_strategy,load_strategy", [("optim_grads_params", "optim"), ("no_shard", "optim_grads")])
def test_checkpoint_round_trip_across_strategies(tmp_path, save_strategy, load_strategy):
    for same, continued, resumed in run_distributed(checkpoint_worker, 2, str(tmp_path / "ckpt"), save_strategy,
                                                    load_strategy):
        assert same
        assert resumed == pytest.approx(continued, abs=1e-6)


def summon_worker(rank, world_size, strategy):
    model = wrap(float8_net(), strategy, bf16=False)
    full = model.full_state_dict()["blocks.0.fc1.weight"]
    with model.summon_full_params():
        weight = model.blocks[0].fc1.weight
        seen = (type(weight).__name__, torch.equal(weight.detach(), full))
        weight.data.mul_(2)
    written = torch.equal(model.full_state_dict()["blocks.0.fc1.weight"], 2 * full)
    return seen, written, type(model.blocks[0].fc1.weight).__name__


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_summon_full_params_puts_plain_full_weights_and_writes_back(strategy):
    """A float8 weight can not take ``.data =``: the full fp32 weight stands in as a plain
    parameter while summoned, its edits are written back, the main parameter returns after."""
    seen, written, after = run_distributed(summon_worker, 2, strategy)[0]
    assert seen == ("Parameter", True) and written
    assert after == ("WeightWithDynamicFloat8CastTensor" if strategy == "no_shard" else "DTensor"), after


def dtensor_param_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    model = nn.Sequential(nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0)]))
    try:
        fully_shard(model, sharding_strategy="optim_grads_params")
    except TypeError as error:
        return str(error)
    return None


def test_a_dtensor_parameter_is_refused_on_every_rank():
    for message in run_distributed(dtensor_param_worker, 2):
        assert message is not None and message.startswith(
            "module: parameter '0.weight' is already a DTensor (placements (Shard(dim=0),)"), message
