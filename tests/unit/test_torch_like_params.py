"""Parameters that behave like torch's (issue: torch-like parameters), on CPU gloo at dp 1, 2, 3, 4.

* Shapes: every optimizer-facing parameter keeps its original dimensions (0-d ones become ``[1]``,
  sharded over the group like 1-d ones); with the sharded strategies it is a DTensor ``Shard(0)``
  whose local piece is this rank's rows ``[rows_here, *shape[1:]]``, the pieces summing to the rows.
  ``dtensor_params=False``: plain tensors of those local shapes.
* Common habits against torch DDP over 4 steps: parameter groups by ``p.ndim >= 2`` (weight decay
  only on matrices), ``torch.nn.utils.clip_grad_norm_`` with norm types 2, 1 and inf (the returned
  norm equals DDP's on every rank, and at dp 3 and 4 some rank holds an empty piece), and the
  optimizers SGD (momentum), Adam, AdamW in foreach and fused forms.
* ``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict`` / ``get_optimizer_state_dict``
  (sharded and full) and the ``set_*`` functions; ``dcp.save`` at one dp size and strategy,
  ``dcp.load`` at others, bitwise.
* Interop with torch's FSDP2 both ways: a checkpoint of FSDP2 at dp 2 loads into ours at dp 3 and
  ours at dp 3 into FSDP2 at dp 2; both then train on identically to the model that never moved.
"""

from __future__ import annotations

import math
import pathlib
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from .dist_utils import run_distributed
from .models import Block, UnevenNet

WORLDS = (1, 2, 3, 4)
GLOBAL_BATCH = 12           # divisible by every dp size here: each rank takes an equal slice


def _batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _loss(model, step, rank, world):
    x, y = _batch(step, rank, world)
    return ((model(x) - y) ** 2).mean()


def _by_ndim(params, decay=0.1):
    """The nanoGPT / HF rule: weight decay where ``p.ndim >= 2``."""
    params = list(params)
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


OPTIMIZERS = {
    "sgd_foreach": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, foreach=True),
    "sgd_fused": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, fused=True),
    "adam_foreach": lambda groups: torch.optim.Adam(groups, lr=1e-2, foreach=True),
    "adamw_foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
    "adamw_fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
}


def _train(model, opt, rank, world, steps, norm_type, params=None, max_norm=0.3):
    """``steps`` steps of: loss, backward, torch's clip_grad_norm_, step, zero_grad; the norms."""
    norms = []
    params = list(model.parameters()) if params is None else params
    for step in range(steps):
        _loss(model, step, rank, world).backward()
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        norms.append(float(total.full_tensor() if isinstance(total, DTensor) else total))
        opt.step()
        opt.zero_grad()
    return norms


def _ddp_run(rank, world, opt_name, norm_type, steps):
    torch.manual_seed(0)
    ref = DistributedDataParallel(UnevenNet())
    opt = OPTIMIZERS[opt_name](_by_ndim(ref.parameters()))
    norms = _train(ref, opt, rank, world, steps, norm_type)
    return norms, {n: p.detach().clone() for n, p in ref.module.state_dict().items()}


def _ours_run(rank, world, strategy, opt_name, norm_type, steps):
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    opt = OPTIMIZERS[opt_name](_by_ndim(model.parameters()))
    empty_pieces = sum(1 for p in model.parameters() if isinstance(p, DTensor) and p.to_local().numel() == 0)
    norms = _train(model, opt, rank, world, steps, norm_type)
    return norms, model.full_state_dict(), empty_pieces


def shapes_worker(rank, world):
    out = {}
    original = {n: tuple(p.shape) for n, p in UnevenNet().named_parameters()}
    for dtensor_params in (True, False):
        for strategy in STRATEGY_NAMES:
            model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block],
                                dtensor_params=dtensor_params)
            rows = {}
            for name, p in model.named_parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                count = torch.tensor([local.shape[0] if local.dim() else 1])
                dist.all_reduce(count)
                rows[name] = (type(p).__name__, isinstance(p, DTensor), p.ndim, tuple(p.shape), tuple(local.shape),
                              int(count), isinstance(p, nn.Parameter))
            out[(dtensor_params, strategy)] = rows
    return original, out


def habits_worker(rank, world, steps=4):
    """{(case, strategy): (our norms, DDP norms, max weight difference, empty pieces here)}."""
    report = {}
    cases = [("adamw_foreach", norm) for norm in (2.0, 1.0, math.inf)]
    cases += [(opt, 2.0) for opt in OPTIMIZERS if opt != "adamw_foreach"]
    for opt_name, norm_type in cases:
        ddp_norms, reference = _ddp_run(rank, world, opt_name, norm_type, steps)
        for strategy in STRATEGY_NAMES:
            norms, full, empty = _ours_run(rank, world, strategy, opt_name, norm_type, steps)
            worst = max((full[n] - w).abs().max().item() for n, w in reference.items())
            report[(opt_name, norm_type, strategy)] = (norms, ddp_norms, worst, empty)
    return report


@pytest.fixture(scope="module", params=WORLDS, ids=[f"dp{w}" for w in WORLDS])
def habits(request):
    return request.param, run_distributed(habits_worker, request.param, timeout=600)


@pytest.mark.parametrize("world", WORLDS)
def test_parameters_keep_their_dimensions_and_hold_whole_rows(world):
    results = run_distributed(shapes_worker, world)
    original, _ = results[0]
    for rank, (_, out) in enumerate(results):
        for (dtensor_params, strategy), rows in out.items():
            assert list(rows) == list(original)
            for name, (kind, is_dtensor, ndim, shape, local, total_rows, is_param) in rows.items():
                want = original[name] or (1,)
                assert is_param, (name, kind)
                if strategy == "no_shard":
                    assert not is_dtensor and shape == original[name] and local == original[name]
                    continue
                assert is_dtensor == dtensor_params, (strategy, name, kind)
                assert ndim == len(want) and local[1:] == want[1:], (strategy, name, shape, local)
                assert total_rows == want[0], (strategy, name, total_rows)
                if dtensor_params:
                    assert shape == want and kind == "DTensor"          # plain, torch.chunk rows
                else:
                    assert shape == local


def test_weight_decay_by_ndim_clip_and_optimizers_match_ddp(habits):
    world, results = habits
    for rank, report in enumerate(results):
        for (opt_name, norm_type, strategy), (norms, ddp_norms, worst, _) in report.items():
            what = (world, rank, opt_name, norm_type, strategy)
            assert norms == pytest.approx(ddp_norms, rel=1e-5), what
            assert worst < 2e-5, what


@pytest.mark.parametrize("world", [3, 4])
def test_infinity_norm_with_empty_local_pieces(world):
    """torch's clip raises for the infinity norm of an empty tensor; ours must not (FSDP2 does)."""
    results = run_distributed(habits_worker, world, 2, timeout=600)
    empties = [report[("adamw_foreach", math.inf, "optim_grads_params")][3] for report in results]
    assert sum(empties) > 0                     # some rank really holds an empty piece
    for report in results:
        norms, ddp_norms, worst, _ = report[("adamw_foreach", math.inf, "optim_grads_params")]
        assert norms == pytest.approx(ddp_norms, rel=1e-6) and worst < 2e-5


# ---------------------------------------------------------------- torch.distributed.checkpoint
class DenseBlock(nn.Module):
    def __init__(self, width=13, hidden=37):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(width, hidden), nn.Linear(hidden, width, bias=False), nn.LayerNorm(width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class DenseNet(nn.Module):
    """UnevenNet without its 0-d parameters: their state-dict values are FlatRangeShards, which
    get_model_state_dict's full_state_dict option does not gather (README; use full_state_dict())."""

    def __init__(self):
        super().__init__()
        self.proj, self.blocks, self.head = nn.Linear(7, 13), nn.ModuleList(DenseBlock() for _ in range(3)), \
            nn.Linear(13, 5, bias=False)

    def forward(self, x):
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _snapshot_full(model, opt):
    full = StateDictOptions(full_state_dict=True)
    return get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)


def _flat_optimizer(osd):
    return {f"{fqn}.{k}": v for fqn, state in osd["state"].items() for k, v in state.items()}


def _plain(model_sd, optim_sd):
    return ({k: v.detach().clone() for k, v in model_sd.items()},
            {k: v.detach().clone() for k, v in _flat_optimizer(optim_sd).items()})


def dcp_save_worker(rank, world, root, strategies):
    out = {}
    for strategy in strategies:
        torch.manual_seed(0)
        model = fully_shard(DenseNet(), sharding_strategy=strategy, unit_modules=[DenseBlock])
        opt = torch.optim.AdamW(_by_ndim(model.parameters()), lr=1e-2)
        _train(model, opt, rank, world, 2, 2.0)
        msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
        sharded = [k for k, v in msd.items() if isinstance(v, DTensor)]
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{strategy}_dp{world}")
        full_model, full_optim = _snapshot_full(model, opt)
        out[strategy] = (_plain(full_model, full_optim), model.full_state_dict(), sharded)
    return out


def dcp_load_worker(rank, world, root, pairs):
    out = {}
    for saved, strategy in pairs:
        torch.manual_seed(1)                     # other initial weights: everything must come from the file
        model = fully_shard(DenseNet(), sharding_strategy=strategy, unit_modules=[DenseBlock])
        opt = torch.optim.AdamW(_by_ndim(model.parameters()), lr=1e-2)
        msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{saved}")
        set_model_state_dict(model, msd)
        set_optimizer_state_dict(model, opt, osd)
        full_model, full_optim = _snapshot_full(model, opt)
        out[(saved, strategy)] = (_plain(full_model, full_optim), model.full_state_dict())
    return out


def full_set_worker(rank, world, strategy):
    """set_model_state_dict / set_optimizer_state_dict from full (plain) state dicts."""
    torch.manual_seed(0)
    model = fully_shard(DenseNet(), sharding_strategy=strategy, unit_modules=[DenseBlock])
    opt = torch.optim.AdamW(_by_ndim(model.parameters()), lr=1e-2)
    _train(model, opt, rank, world, 2, 2.0)
    full_model, full_optim = _snapshot_full(model, opt)
    torch.manual_seed(1)
    other = fully_shard(DenseNet(), sharding_strategy=strategy, unit_modules=[DenseBlock])
    other_opt = torch.optim.AdamW(_by_ndim(other.parameters()), lr=1e-2)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(other, full_model, options=full)
    set_optimizer_state_dict(other, other_opt, full_optim, options=full)
    return _plain(*_snapshot_full(model, opt)), _plain(*_snapshot_full(other, other_opt))


def _assert_equal(got: dict, want: dict, what):
    assert sorted(got) == sorted(want), what
    for key in want:
        assert torch.equal(got[key], want[key]), (what, key)


def test_dcp_state_dicts_reshard_across_dp_sizes_and_strategies(tmp_path):
    saved_at = {2: ("optim_grads_params", "optim"), 3: ("optim_grads",)}
    saved = {}
    for world, strategies in saved_at.items():
        results = run_distributed(dcp_save_worker, world, str(tmp_path), strategies)
        for strategy in strategies:
            (full, full_weights, sharded) = results[0][strategy]
            assert sharded, "get_model_state_dict gave no DTensor values"
            _assert_equal(full[0], full_weights, ("full model state dict", strategy))
            for other in results[1:]:
                _assert_equal(other[strategy][0][0], full[0], ("ranks agree", strategy))
                _assert_equal(other[strategy][0][1], full[1], ("ranks agree", strategy))
            saved[f"{strategy}_dp{world}"] = full
    loads = {1: [("optim_grads_params_dp2", "optim")],
             3: [("optim_grads_params_dp2", "optim_grads_params"), ("optim_dp2", "no_shard")],
             4: [("optim_grads_dp3", "optim_grads_params"), ("optim_dp2", "optim_grads")]}
    for world, pairs in loads.items():
        results = run_distributed(dcp_load_worker, world, str(tmp_path), pairs)
        for rank, out in enumerate(results):
            for (name, strategy), (full, weights) in out.items():
                _assert_equal(full[0], saved[name][0], (world, rank, name, strategy, "model"))
                _assert_equal(weights, saved[name][0], (world, rank, name, strategy, "weights"))
                _assert_equal(full[1], saved[name][1], (world, rank, name, strategy, "optimizer"))


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_set_state_dicts_from_full_state_dicts(strategy):
    for rank, (want, got) in enumerate(run_distributed(full_set_worker, 3, strategy)):
        _assert_equal(got[0], want[0], (rank, strategy, "model"))
        _assert_equal(got[1], want[1], (rank, strategy, "optimizer"))


# ---------------------------------------------------------------- FSDP2 interop
def _interop_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))


def _fsdp2(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _interop_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            torch_fully_shard(layer, mesh=mesh)
    return torch_fully_shard(model, mesh=mesh)


def _ours(strategy):
    return fully_shard(_interop_model(), sharding_strategy=strategy)


def _steps(model, opt, rank, world, first, count):
    for step in range(first, first + count):
        _loss(model, step, rank, world).backward()
        opt.step()
        opt.zero_grad()


def _full_weights(model):
    return {k: v.clone() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}


def interop_save_worker(rank, world, root, system, strategy):
    """Train 2 steps, save (model + AdamW), train 2 more: the weights of the model that never moved."""
    model = _fsdp2(world) if system == "fsdp2" else _ours(strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(model, opt, rank, world, 0, 2)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=f"{root}/{system}")
    _steps(model, opt, rank, world, 2, 2)
    return _full_weights(model)


def interop_load_worker(rank, world, root, system, strategy, saved_by):
    torch.manual_seed(5)
    model = _fsdp2(world) if system == "fsdp2" else _ours(strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{saved_by}")
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt, osd)
    _steps(model, opt, rank, world, 2, 2)
    return _full_weights(model)


@pytest.mark.parametrize("direction", ["fsdp2_to_ours", "ours_to_fsdp2"])
def test_checkpoints_interchange_with_torch_fsdp2(tmp_path, direction):
    if direction == "fsdp2_to_ours":
        never_moved = run_distributed(interop_save_worker, 2, str(tmp_path), "fsdp2", None)[0]
        resumed = run_distributed(interop_load_worker, 3, str(tmp_path), "ours", "optim_grads_params", "fsdp2")
    else:
        never_moved = run_distributed(interop_save_worker, 3, str(tmp_path), "ours", "optim_grads")[0]
        resumed = run_distributed(interop_load_worker, 2, str(tmp_path), "fsdp2", None, "ours")
    for rank, weights in enumerate(resumed):
        assert sorted(weights) == sorted(never_moved)
        for name, want in never_moved.items():
            torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-6, msg=f"{direction} rank {rank} {name}")


# ---------------------------------------------------------------- checkpoints of the earlier layout
OLD = pathlib.Path(__file__).parent.parent / "data" / "layout_v1_zero3_dp4"


def old_checkpoint_worker(rank, world, directory, strategy):
    from megatron_fsdp_v2 import load_checkpoint
    from tests.state_gather import full_optimizer_state

    torch.manual_seed(3)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    load_checkpoint(directory, model, opt)
    return model.full_state_dict(), full_optimizer_state(model, opt)


def test_checkpoints_of_the_earlier_layout_still_load(tmp_path):
    """A save_checkpoint directory written by the layout before rows were snapped (ZeRO-3 at dp 4,
    commit 4e22ec1: ranges that start mid-row) loads bitwise at dp 3 into ZeRO-3 and at dp 2 into ZeRO-1."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(OLD / "checkpoint")).read_metadata()
    inner_offsets = [c.offsets[-1] for md in metadata.state_dict_metadata.values()
                     if hasattr(md, "chunks") for c in md.chunks if len(c.offsets) == 2]
    assert any(inner_offsets), "the fixture should hold chunks that start mid-row"
    want = torch.load(OLD / "full_state.pt", weights_only=True)
    directory = tmp_path / "old"
    shutil.copytree(OLD / "checkpoint", directory)
    for world, strategy in ((3, "optim_grads_params"), (2, "optim")):
        for rank, (weights, optimizer) in enumerate(run_distributed(old_checkpoint_worker, world, str(directory),
                                                                     strategy)):
            _assert_equal(weights, want["model"], (world, rank, strategy, "model"))
            _assert_equal(optimizer, want["optimizer"], (world, rank, strategy, "optimizer"))
