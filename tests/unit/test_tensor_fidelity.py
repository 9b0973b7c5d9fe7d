"""Sharded parameters behave like torch tensors (issue: tensor fidelity).

* Every op a user applies to a sharded parameter or its gradient gives the full tensor's value, or
  the same clear error on every rank: a hypothesis property over op x strategy x dp 2/3/4 x shapes
  laid out so that some ranks hold no rows (row_sharded.py, [Note: ops on row-snapped shards]).
* ``torch.save(model.state_dict())`` / ``torch.load`` work; state-dict values alias the parameters.
* One parameter, one tensor: ``model.head.weight``, ``model.head.parameters()`` and
  ``model.parameters()`` give the tensor the optimizer steps (runtime/param_swap.py).

The property runs inside the workers with a derandomized hypothesis: every rank draws the same
examples in the same order (an op on a sharded tensor is a collective), and records each result
instead of asserting, so no rank stops while the others wait; the test asserts in the parent.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from .dist_utils import run_distributed

SHARDED = [s for s in STRATEGY_NAMES if s != "no_shard"]
WORLDS = (2, 3, 4)

# name -> op; each is applied to the sharded tensor and to the full tensor
OPS = {
    "sum": lambda t: t.sum(), "mean": lambda t: t.mean(), "norm": lambda t: t.norm(),
    "max": lambda t: t.max(), "min": lambda t: t.min(), "amax": lambda t: t.amax(),
    "abs_max": lambda t: t.abs().max(), "std": lambda t: t.std(), "var": lambda t: t.var(),
    "count_nonzero": lambda t: torch.count_nonzero(t > 0), "all": lambda t: (t > -10).all(),
    "any": lambda t: (t > 0.5).any(), "sum_dim0": lambda t: t.sum(0), "mean_last": lambda t: t.mean(-1),
    "max_dim0": lambda t: t.max(0).values, "index0": lambda t: t[0], "index_last": lambda t: t[-1],
    "slice": lambda t: t[1:3], "stride_slice": lambda t: t[::2], "reshape": lambda t: t.reshape(-1),
    "view": lambda t: t.view(-1), "flatten": lambda t: t.flatten(), "t": lambda t: t.t() if t.dim() == 2 else t,
    "affine": lambda t: t * 2 + 1, "tanh": lambda t: torch.tanh(t), "bf16": lambda t: t.to(torch.bfloat16),
    "double": lambda t: t.double(), "minus_full": None,   # t - the full tensor (a plain tensor)
}


class Holder(nn.Module):
    """A leading parameter of ``lead`` elements pushes the row boundaries, so the target's rows
    land on few ranks (with small ``rows``, some ranks hold none of them)."""

    def __init__(self, lead: int, shape: tuple) -> None:
        super().__init__()
        self.lead = nn.Parameter(torch.randn(lead))
        self.target = nn.Parameter(torch.randn(shape))

    def forward(self, x):
        return (self.lead.sum() + (self.target * x).sum()) ** 2


def _value(t):
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(torch.float64) if t.is_floating_point() else t.detach()


def _apply(name, t, full):
    return (t - full) if name == "minus_full" else OPS[name](t)


def _one_case(rank, strategy, lead, shape, name, on_grad):
    torch.manual_seed(lead * 7 + len(shape))
    model = fully_shard(Holder(lead, shape), sharding_strategy=strategy)
    if on_grad:
        model(torch.full(shape, 0.5 + rank)).backward()
    p = dict(model.named_parameters())["target"]
    tensor = p.grad if on_grad else p
    with model.summon_full_params(with_grads=on_grad):
        full = (model.target.grad if on_grad else model.target).detach().clone()
    rows_here = tensor.to_local().shape[0]
    try:
        got = _value(_apply(name, tensor, full))
    except Exception as err:                           # noqa: BLE001 - recorded, asserted by the parent
        return {"error": f"{type(err).__name__}: {err}", "rows_here": rows_here}
    want = _value(_apply(name, full, full))
    return {"got": got, "want": want, "rows_here": rows_here}


def property_worker(rank, world, max_examples):
    records = []

    @settings(derandomize=True, max_examples=max_examples, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy=st.sampled_from(SHARDED), lead=st.integers(1, 200),
           shape=st.one_of(st.tuples(st.integers(1, 5)), st.tuples(st.integers(1, 6), st.integers(1, 9)),
                           st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3))),
           name=st.sampled_from(sorted(OPS)), on_grad=st.booleans())
    def case(strategy, lead, shape, name, on_grad):
        records.append(((strategy, lead, shape, name, on_grad), _one_case(rank, strategy, lead, shape, name, on_grad)))

    case()
    return records


@pytest.mark.parametrize("world", WORLDS)
def test_every_op_gives_the_full_tensors_value_at_every_dp_size(world):
    per_rank = run_distributed(property_worker, world, 60, timeout=600)
    empty_seen = 0
    for index, (key, first) in enumerate(per_rank[0]):
        assert all(r[index][0] == key for r in per_rank), "ranks drew different examples"
        results = [r[index][1] for r in per_rank]
        empty_seen += any(res["rows_here"] == 0 for res in results)
        for rank, res in enumerate(results):
            assert "error" not in res, f"{key} rank {rank}: {res['error']}"
            got, want = res["got"], res["want"]
            assert got.shape == want.shape and got.dtype == want.dtype, (key, got.shape, want.shape)
            if got.is_floating_point():
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True, msg=str(key))
            else:
                assert torch.equal(got, want), key
    assert empty_seen >= 5, f"only {empty_seen} examples had a rank holding 0 rows"


# ---------------------------------------------------------------- refusals and writes
def writes_worker(rank, world):
    out = {}
    for strategy in SHARDED:
        torch.manual_seed(0)
        model = fully_shard(Holder(3, (4, 5)), sharding_strategy=strategy)
        p = model.target
        assert type(p) is DTensor, type(p)             # a plain DTensor Shard(0), as FSDP2's
        with torch.no_grad():
            full = p.full_tensor()
            full[1] = 7.0
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements))   # each rank copies its rows
            p.mul_(2)                                  # elementwise: on every rank's rows
        out[(strategy, "after_writes")] = model.full_state_dict()["target"]
        writes = {"setitem": lambda: p.__setitem__(1, 7.0), "slice_setitem": lambda: p.__setitem__(slice(0, 2), 1.0),
                  "row_zero_": lambda: p[1].zero_(), "row_add_": lambda: p[-1].add_(1.0),
                  "element_setitem": lambda: p.__setitem__((1, 2), 4.0),
                  "plain_copy": lambda: p.copy_(full)}
        for name, write in writes.items():
            try:
                with torch.no_grad():
                    write()
            except (RuntimeError, NotImplementedError) as err:
                out[(strategy, name)] = f"{type(err).__name__}: {err}"
        out[(strategy, "after_refused_writes")] = model.full_state_dict()["target"]
        with torch.no_grad():
            out[(strategy, "row_read")] = p[1].full_tensor()
            own = p[1].clone()
            own.zero_()                                 # a clone is the caller's own tensor
            out[(strategy, "clone_zeroed")] = own.full_tensor()
        try:
            p[0] = 1.0                                  # grad mode on: torch's leaf error, also here
        except RuntimeError as err:
            out[(strategy, "leaf")] = str(err)
    return out


def test_writes_reach_every_ranks_rows_and_other_writes_refuse_on_every_rank():
    """Writes go through DTensor's verbs as on FSDP2's parameters. A write into an index along the
    sharded dimension (DTensor's gathered copy: lost on FSDP2's parameters, silently on torch 2.15 for
    ``p[1] = 7.0`` and on every torch for ``p[1].zero_()``) and a copy from a plain tensor raise the
    same error on every rank, before any collective, so no rank waits alone; the parameter is
    unchanged and reads and clones of its rows are right."""
    per_rank = run_distributed(writes_worker, 3)
    for out in per_rank:
        for strategy in SHARDED:
            got = out[(strategy, "after_writes")]
            assert torch.equal(got[1], torch.full((5,), 14.0)), strategy
            for name in ("setitem", "slice_setitem", "row_zero_", "row_add_", "element_setitem"):
                assert "writing into an indexed piece of a sharded parameter" in out[(strategy, name)], (strategy, name)
            assert "made by an index along dimension 0" in out[(strategy, "setitem")]
            assert "mixed torch.Tensor and DTensor" in out[(strategy, "plain_copy")], out[(strategy, "plain_copy")]
            assert torch.equal(out[(strategy, "after_refused_writes")], got)     # nothing half-written
            assert torch.equal(out[(strategy, "row_read")], got[1])
            assert torch.equal(out[(strategy, "clone_zeroed")], torch.zeros(5))
            assert "in-place operation" in out[(strategy, "leaf")]
    for key in per_rank[0]:
        if key[1] in ("setitem", "slice_setitem", "row_zero_", "row_add_", "element_setitem", "plain_copy"):
            assert len({out[key] for out in per_rank}) == 1, key


def mixing_worker(rank, world):
    """Parameters of two wrappers of different strategies, in one op."""
    torch.manual_seed(0)
    p_model = fully_shard(Holder(3, (5, 4)), sharding_strategy="optim")
    q_model = fully_shard(Holder(11, (5, 4)), sharding_strategy="optim_grads_params")
    p, q = p_model.target, q_model.target
    out = {"placements": (p.placements, q.placements), "rows": (p.to_local().shape[0], q.to_local().shape[0])}
    out["difference"] = (p - q).full_tensor()
    out["want"] = p.full_tensor() - q.full_tensor()
    out["dot_max"] = float((p * q).sum(1).max())
    out["dot_max_want"] = float((p.full_tensor() * q.full_tensor()).sum(1).max())
    return out


def test_parameters_of_different_strategies_mix_as_fsdp2s_do():
    """Every strategy gives torch.chunk's rows (plain DTensors), so a ZeRO-1 parameter and a ZeRO-3
    one combine row by row; at dp 3, 5 rows split 2 / 2 / 1 on both."""
    for rank, out in enumerate(run_distributed(mixing_worker, 3)):
        assert out["rows"] == ((2, 2, 1)[rank],) * 2
        assert torch.equal(out["difference"], out["want"])
        assert out["dot_max"] == out["dot_max_want"]


SCALARS = {"float_sum": lambda t: float(t.sum()), "item_max": lambda t: t.max().item(),
           "item_norm": lambda t: t.norm().item(), "bool_any": lambda t: bool((t > 1.0).any()),
           "float_min_abs": lambda t: float(t.abs().min())}


def scalars_worker(rank, world):
    out = {}
    for strategy in SHARDED:
        torch.manual_seed(0)
        model = fully_shard(Holder(7, (2, 3)), sharding_strategy=strategy)     # 2 rows at dp 3: rank 2 holds none
        p = model.target
        full = p.full_tensor()
        for name, read in SCALARS.items():
            out[(strategy, name)] = (read(p), read(full))
    return out


def test_python_scalars_of_reductions_are_the_full_tensors_on_every_rank():
    """``float(p.sum())`` and ``.item()`` read a partial result (one rank's piece) in torch's DTensor;
    ours make it whole first ([Note: a scalar of a partial result])."""
    for out in run_distributed(scalars_worker, 3):
        for key, (got, want) in out.items():
            assert got == pytest.approx(want, rel=1e-6), key


# ---------------------------------------------------------------- torch.save of state dicts
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 17), nn.Linear(17, 6)) for _ in range(2))
        self.head = nn.Linear(6, 11)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h) * self.scale


def save_worker(rank, world, tmp):
    out = {}
    for strategy in STRATEGY_NAMES:
        for dtensor_params in (True, False):
            torch.manual_seed(0)
            model = fully_shard(Net(), sharding_strategy=strategy, unit_modules=[nn.Sequential],
                                dtensor_params=dtensor_params)
            path = f"{tmp}/{strategy}-{dtensor_params}-{rank}.pt"
            state = model.state_dict()
            torch.save(state, path)
            loaded = torch.load(path, weights_only=False)
            same = all(torch.equal(_local(loaded[k]), _local(v)) for k, v in state.items())
            loaded_shape = tuple(loaded["head.weight"].shape)
            # aliasing: a write into a state-dict value is a write into the parameter
            with torch.no_grad():
                _local(state["head.bias"]).fill_(3.0)
            full_bias = model.full_state_dict()["head.bias"]
            # load_state_dict of the saved (pre-write) file writes into the same storage
            pointers = [_local(v).data_ptr() for v in model.state_dict().values() if _local(v).numel()]
            model.load_state_dict(loaded)
            after = [_local(v).data_ptr() for v in model.state_dict().values() if _local(v).numel()]
            out[(strategy, dtensor_params)] = (same, loaded_shape, float(full_bias.min()), float(full_bias.max()),
                                               pointers == after,
                                               torch.equal(model.full_state_dict()["head.bias"],
                                                           _initial_head_bias()))
    return out


def _initial_head_bias():
    """The head bias Net() starts with under seed 0."""
    torch.manual_seed(0)
    return Net().head.bias.detach()


def _local(value):
    if isinstance(value, DTensor):
        return value.to_local()
    return getattr(value, "local_flat", value)


@pytest.mark.parametrize("world", (2, 3))
def test_torch_save_of_the_state_dict_round_trips_and_values_alias_the_parameters(world, tmp_path):
    for out in run_distributed(save_worker, world, str(tmp_path)):
        for key, (same, shape, low, high, same_storage, restored) in out.items():
            assert same and shape == (11, 6), key
            assert low == high == 3.0, key                  # the write reached every rank's rows
            assert same_storage and restored, key


# ---------------------------------------------------------------- one parameter, one tensor
def one_tensor_worker(rank, world):
    out = {}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        reference_net = Net()
        reference_net.blocks[0].requires_grad_(False)        # torch DDP: frozen before wrapping
        ref = DistributedDataParallel(reference_net)
        torch.manual_seed(0)
        model = fully_shard(Net(), sharding_strategy=strategy, unit_modules=[nn.Sequential])
        named = dict(model.named_parameters())
        out[(strategy, "same")] = (model.head.weight is named["head.weight"]
                                   and [id(p) for p in model.head.parameters()] == [id(named["head.weight"]),
                                                                                    id(named["head.bias"])]
                                   and model.blocks[1][1].weight is named["blocks.1.1.weight"])
        model.blocks[0].requires_grad_(False)               # ours: after wrapping, through the submodule
        out[(strategy, "frozen_flags")] = [n for n, p in model.named_parameters() if not p.requires_grad]
        worst = 0.0
        for net in (ref, model):
            inner = net.module if net is ref else net
            others = [p for n, p in inner.named_parameters() if not n.startswith("head.")]
            opt = torch.optim.AdamW([{"params": inner.head.parameters(), "lr": 3e-2}, {"params": others}], lr=1e-2)
            for step in range(3):
                g = torch.Generator().manual_seed(step * 10 + rank)
                net(torch.randint(0, 11, (3, 4), generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        full = model.full_state_dict()
        for name, want in ref.module.state_dict().items():
            worst = max(worst, float((full[name] - want).abs().max()))
        out[(strategy, "worst")] = worst
        torch.manual_seed(0)
        out[(strategy, "frozen_unchanged")] = torch.equal(full["blocks.0.1.weight"], Net().blocks[0][1].weight)
        out[(strategy, "frozen_grad_none")] = all(p.grad is None for p in model.blocks[0].parameters())
    return out


def test_one_parameter_one_tensor_per_module_groups_and_freezing_match_ddp():
    for out in run_distributed(one_tensor_worker, 2):
        for strategy in STRATEGY_NAMES:
            assert out[(strategy, "same")], strategy
            assert out[(strategy, "frozen_flags")] == [f"blocks.0.{i}.{w}" for i in range(3) for w in ("weight", "bias")]
            assert out[(strategy, "worst")] < 1e-6, (strategy, out[(strategy, "worst")])
            assert out[(strategy, "frozen_unchanged")] and out[(strategy, "frozen_grad_none")], strategy
