"""DCP checkpoints: bitwise resume, resharding across dp sizes and strategies, atomic saves, clear
errors for a different model, a plain-torch full export, and no unpickling of foreign objects."""

import math
import os
import pickle

import pytest
import torch

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

from megatron_fsdp_v2 import (STRATEGY_NAMES, ChecksummedFileSystemWriter, MixedPrecisionPolicy, SafeFileSystemReader,
                              export_full_state_dict, fully_shard, load_checkpoint, load_optimizer_state_dict,
                              optimizer_state_dict, save_checkpoint)
from megatron_fsdp_v2.checkpoint.dcp_format import flat_range_boxes

from .checkpoint_helpers import distributed_fixture, run_parts, snapshot
from .dist_utils import run_distributed
from .models import Block, UnevenNet
from .test_checkpoint_safety import Marker

GLOBAL_BATCH = 4   # split over ranks, so every dp size trains on the same samples


def _batch(step, rank, dp):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
    per = GLOBAL_BATCH // dp
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _build(strategy, seed=0, model_fn=UnevenNet, **kwargs):
    torch.manual_seed(seed)
    model = fully_shard(model_fn(), sharding_strategy=strategy, unit_modules=[Block], **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train(model, opt, steps, rank, dp, dtype=torch.float32):
    """``rank`` and ``dp`` are the data-parallel rank and size (of the model's group)."""
    for step in steps:
        x, y = _batch(step, rank, dp)
        out = model(x.to(dtype))
        ((out - y.to(out.dtype)) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def _differences(got, want, close):
    """Names of weights and optimizer-state entries where ``close(got, want)`` fails."""
    (w_got, s_got), (w_want, s_want) = got, want
    if list(w_got) != list(w_want) or {n: sorted(s) for n, s in s_got.items()} != {n: sorted(s) for n, s in s_want.items()}:
        return ["weight or optimizer-state keys differ"]
    bad = [n for n in w_want if not close(w_got[n], w_want[n])]
    return bad + [f"{n}.{k}" for n in s_want for k in s_want[n] if not close(s_got[n][k], s_want[n][k])]


# ---------------------------------------------------------------- pure layout of the chunks
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_flat_range_boxes_tile_the_range_in_order(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    index = torch.arange(numel).view(shape)
    boxes = flat_range_boxes(tuple(shape), start, end)
    pieces = [index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1) for offsets, sizes in boxes]
    covered = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    assert torch.equal(covered, torch.arange(start, end))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


# ---------------------------------------------------------------- bitwise resume (the DCP idiom)
def _resume_save_worker(rank, world, root):
    continuous = {}
    for strategy in STRATEGY_NAMES:
        model, opt = _build(strategy)
        _train(model, opt, range(6), rank, world)
        continuous[strategy] = snapshot(model, opt)
        model, opt = _build(strategy)
        _train(model, opt, range(3), rank, world)
        dcp.save(model.state_dict(), checkpoint_id=f"{root}/{strategy}/model")
        dcp.save(optimizer_state_dict(model, opt), checkpoint_id=f"{root}/{strategy}/optim")
    return continuous


def _resume_load_worker(rank, world, root):
    resumed = {}
    for strategy in STRATEGY_NAMES:
        model, opt = _build(strategy, seed=1)       # other initial weights: the load must overwrite them
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=f"{root}/{strategy}/model")
        model.load_state_dict(sd)
        osd = optimizer_state_dict(model, opt)
        dcp.load(osd, checkpoint_id=f"{root}/{strategy}/optim")
        load_optimizer_state_dict(model, opt, osd)
        _train(model, opt, range(3, 6), rank, world)
        resumed[strategy] = snapshot(model, opt)
    return resumed


def test_resume_is_bitwise_identical_for_every_strategy(tmp_path):
    continuous = run_distributed(_resume_save_worker, 2, str(tmp_path))
    resumed = run_distributed(_resume_load_worker, 2, str(tmp_path), fresh=True)   # new processes: resume from disk only
    for rank in range(2):
        for strategy in STRATEGY_NAMES:
            bad = _differences(resumed[rank][strategy], continuous[rank][strategy], torch.equal)
            assert not bad, f"rank {rank} {strategy}: not bitwise equal: {bad}"
            assert continuous[rank][strategy][1]["proj.weight"]["step"].item() == 6.0


# ---------------------------------------------------------------- resharding matrix
DP_SIZES = (1, 2, 4)


def _fp64_net():
    """fp32 runs at different dp sizes differ by ~2e-4 relative after 4 AdamW steps (reduction-order
    rounding that Adam's normalisation amplifies on near-zero gradients); in fp64 they agree to
    ~1e-13, so rtol 1e-6 separates a resharding bug from rounding. Bitwise resume covers fp32."""
    return UnevenNet().double()


def _matrix_worker(rank, world, root):
    """One 4-rank job (a spawn costs ~10 s here): dp sizes are the subgroups of the first 1, 2 and 4
    ranks. Every (N, S) trains 2 steps and saves; then at every (M, T) each checkpoint is loaded,
    trained 2 more steps and compared with 4 uninterrupted steps at (M, T)."""
    groups = {dp: dist.new_group(list(range(dp))) for dp in DP_SIZES}
    for dp in DP_SIZES:
        if rank < dp:
            for strategy in STRATEGY_NAMES:
                model, opt = _build(strategy, process_group=groups[dp], model_fn=_fp64_net)
                _train(model, opt, range(2), rank, dp, torch.float64)
                save_checkpoint(f"{root}/dp{dp}/{strategy}", model, opt)
        dist.barrier()
    results = {}
    for dp in DP_SIZES:
        if rank < dp:
            results[dp] = _load_everything_at(rank, dp, groups[dp], root)
        dist.barrier()
    return results


def _load_everything_at(rank, dp, group, root):
    failures, checked, worst = [], 0, 0.0

    def close(got, want):
        nonlocal worst
        if got.numel():
            worst = max(worst, ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item())
        return torch.allclose(got, want, rtol=1e-6, atol=0.0)

    for target in STRATEGY_NAMES:
        model, opt = _build(target, process_group=group, model_fn=_fp64_net)
        _train(model, opt, range(4), rank, dp, torch.float64)
        reference = snapshot(model, opt)
        for saved_dp in DP_SIZES:
            for saved in STRATEGY_NAMES:
                model, opt = _build(target, seed=1, process_group=group, model_fn=_fp64_net)
                load_checkpoint(f"{root}/dp{saved_dp}/{saved}", model, opt)
                _train(model, opt, range(2, 4), rank, dp, torch.float64)
                bad = _differences(snapshot(model, opt), reference, close)
                if bad:
                    failures.append(f"({saved_dp}, {saved}) -> ({dp}, {target}): {bad[:5]}")
                checked += 1
    return failures, checked, worst


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory):
    return run_distributed(_matrix_worker, max(DP_SIZES), str(tmp_path_factory.mktemp("matrix")))


@pytest.mark.parametrize("load_dp", DP_SIZES)
def test_checkpoint_reshards_across_dp_sizes_and_strategies(matrix_results, load_dp):
    for rank in range(load_dp):
        failures, checked, worst = matrix_results[rank][load_dp]
        assert checked == len(DP_SIZES) * len(STRATEGY_NAMES) ** 2
        assert not failures, f"rank {rank} (worst relative error {worst:.3g}): {failures}"


# ---------------------------------------------------------------- atomic saves
def _failed_save_worker(rank, world, root):
    path = f"{root}/ckpt"
    model, opt = _build("optim_grads")
    _train(model, opt, range(1), rank, world)
    save_checkpoint(path, model, opt)
    good = snapshot(model, opt)
    _train(model, opt, range(1, 2), rank, world)

    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = original(self, plan, planner)
        written.wait()
        if rank == 1:              # its shard file is on disk, the checkpoint is not complete
            raise RuntimeError("simulated crash while writing")
        return written

    FileSystemWriter.write_data = write_then_die
    try:
        save_checkpoint(path, model, opt)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = str(exc)
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()
    after_failure = sorted(os.listdir(root))

    fresh, fresh_opt = _build("optim_grads", seed=1)
    load_checkpoint(path, fresh, fresh_opt)
    intact = not _differences(snapshot(fresh, fresh_opt), good, torch.equal)

    if rank == 0:                  # a save that died between its two renames: only path.old exists
        os.rename(path, path + ".old")
    dist.barrier()
    fresh, fresh_opt = _build("optim_grads", seed=1)
    load_checkpoint(path, fresh, fresh_opt)
    old_intact = not _differences(snapshot(fresh, fresh_opt), good, torch.equal)
    save_checkpoint(path, model, opt)
    return error, after_failure, intact, old_intact, sorted(os.listdir(root))


def _two_rank_checks_worker(rank, world, root):
    """The failed save, the error messages and the export share one job (a spawn costs ~10 s here)."""
    return run_parts(rank, world, root, (("failed_save", _failed_save_worker), ("errors", _errors_worker),
                                         ("export", _export_worker)))


two_rank_checks = distributed_fixture(_two_rank_checks_worker, "two_rank")


def test_failed_save_leaves_last_checkpoint_loadable(two_rank_checks):
    for error, after_failure, intact, old_intact, final in (r["failed_save"] for r in two_rank_checks):
        assert error is not None and "simulated crash" in error
        assert after_failure == ["ckpt"], f"the failed save left {after_failure}"
        assert intact, "the checkpoint before the failed save no longer loads to the same state"
        assert old_intact, "a checkpoint left at path.old by an interrupted rename did not load"
        assert final == ["ckpt"]


# ---------------------------------------------------------------- clear errors, nothing unpickled
TRIPWIRE = "unpickled.flag"


def _errors_worker(rank, world, root):
    model, opt = _build("optim", model_fn=lambda: UnevenNet(depth=3, hidden=37))
    save_checkpoint(f"{root}/ckpt", model, opt)
    messages = {}
    for label, fn in {"bigger": lambda: UnevenNet(depth=4, hidden=38), "smaller": lambda: UnevenNet(depth=2)}.items():
        other, other_opt = _build("optim_grads_params", model_fn=fn)
        with pytest.raises(ValueError) as info:
            load_checkpoint(f"{root}/ckpt", other, other_opt)
        messages[label] = str(info.value)
    with pytest.raises(ValueError) as info:
        model.load_state_dict({"bogus": torch.zeros(3)})
    messages["load_state_dict"] = str(info.value)

    tripwire = Marker(f"{root}/{TRIPWIRE}")        # pickled objects where tensors belong, checksums intact
    sd = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.save({**sd, "model.offset": tripwire}, storage_writer=ChecksummedFileSystemWriter(f"{root}/evil_model"))
    optim_sd = {f"optimizer.{k}": v for k, v in optimizer_state_dict(model, opt).items()}
    dcp.save({**sd, **optim_sd, "optimizer.param_groups.0.lr": tripwire},
             storage_writer=ChecksummedFileSystemWriter(f"{root}/evil_optimizer"))
    for label, optimizer in (("evil_model", None), ("evil_optimizer", opt)):
        with pytest.raises(ValueError) as info:
            load_checkpoint(f"{root}/{label}", model, optimizer)
        messages[label] = str(info.value)
    dist.barrier()
    return messages, os.path.exists(f"{root}/{TRIPWIRE}")


def test_loading_a_different_model_names_the_bad_keys(two_rank_checks):
    messages, tripped = two_rank_checks[0]["errors"]
    assert "missing keys ['blocks.3." in messages["bigger"]
    assert "blocks.0.up.weight: expected (38, 13), got (37, 13)" in messages["bigger"]
    assert "unexpected keys ['blocks.2." in messages["smaller"]
    assert "unexpected keys ['bogus']" in messages["load_state_dict"] and "proj.weight" in messages["load_state_dict"]
    assert "offset: expected (), got non-tensor bytes" in messages["evil_model"]
    assert "['optimizer.param_groups.0.lr'] are pickled bytes" in messages["evil_optimizer"]
    assert not tripped, "a pickled object in the checkpoint was unpickled"


def test_metadata_reader_refuses_foreign_globals(tmp_path):
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(Marker(str(tmp_path / TRIPWIRE)), f)
    with pytest.raises(pickle.UnpicklingError, match="_trip"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / TRIPWIRE).exists()


# ---------------------------------------------------------------- full export
def _export_worker(rank, world, root):
    path = f"{root}/model.pt"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model, opt = _build("optim_grads_params", mixed_precision=policy)
    _train(model, opt, range(1), rank, world, dtype=torch.bfloat16)
    export_full_state_dict(model, path, rank=1)
    full = model.full_state_dict()
    loaded = torch.load(path, weights_only=True)
    same = list(loaded) == list(full) and all(torch.equal(loaded[k], v) for k, v in full.items())
    plain = UnevenNet()
    plain.load_state_dict(loaded)                      # a plain module takes it as is
    fresh, _ = _build("optim", seed=1, mixed_precision=policy)
    fresh.load_state_dict(loaded)                      # and so does a sharded one (full tensors)
    back = fresh.full_state_dict()
    return same, {str(v.dtype) for v in loaded.values()}, all(torch.equal(back[k], v) for k, v in full.items())


def test_full_export_loads_with_plain_torch(two_rank_checks):
    for same, dtypes, roundtrip in (r["export"] for r in two_rank_checks):
        assert same, "the export differs from full_state_dict()"
        assert dtypes == {"torch.float32"}, f"export is not full precision: {dtypes}"
        assert roundtrip
