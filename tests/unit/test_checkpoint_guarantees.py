"""What a checkpoint guarantees (docs/checkpointing.md), on 2 gloo ranks in one job:

* integrity (issue items 2, 3): a flipped bit, a cut shard and a cut ``.metadata`` raise on every
  rank, naming the file, "truncated or corrupt" and the rank that found it; without these checks
  torch's reader loaded the flipped bit as a weight of ~1e37.
* atomicity (item 4): from the on-disk state a crash leaves at each point of a save (writing,
  written, between the renames, deleting ``ckpt.old``, a failed rename on rank 0), the next load
  reads the newest complete checkpoint and the next save succeeds and leaves only ``ckpt``.
  (test_checkpoint_crash.py kills real processes at these points.)
* optimizer state (item 5): SGD's state loaded into AdamW raises at load on every rank, naming
  both classes and the missing keys, and leaves the model untouched.
"""

from __future__ import annotations

import os
import shutil
from unittest import mock

import pytest
import torch
from torch.distributed.tensor import DTensor
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from megatron_fsdp_v2 import (SafeFileSystemReader, fully_shard, load_checkpoint, load_optimizer_state_dict,
                              optimizer_state_dict, save_checkpoint)
from megatron_fsdp_v2.checkpoint import commit as checkpoint_commit
from megatron_fsdp_v2.checkpoint.dcp_format import FlatRangeShard
from megatron_fsdp_v2.row_sharded import local_piece

from .checkpoint_helpers import distributed_fixture, failure, run_parts, snapshot
from .models import Block, UnevenNet


def build(strategy="optim_grads", seed=0, optimizer=torch.optim.AdamW, **hyper):
    torch.manual_seed(seed)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    return model, optimizer(model.parameters(), lr=1e-2, **hyper)


def train(model, opt, steps, rank, world):
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
        per = 4 // world
        ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def same(got, want) -> bool:
    (w_got, s_got), (w_want, s_want) = got, want
    return (list(w_got) == list(w_want) and all(torch.equal(w_got[k], w_want[k]) for k in w_want)
            and {n: sorted(s) for n, s in s_got.items()} == {n: sorted(s) for n, s in s_want.items()}
            and all(torch.equal(s_got[n][k], s_want[n][k]) for n in s_want for k in s_want[n]))


def _leader_then_all(rank, fn, *args):
    """``fn`` on rank 0 only (file surgery), then everyone waits for it."""
    if rank == 0:
        fn(*args)
    dist.barrier()


# ---------------------------------------------------------------- items 2 and 3: integrity
def _truncate(path, size=None):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 if size is None else size)


def _flip_in_own_shard(model, directory, rank):
    """Flip the top exponent bit of the first element of this rank's shard of the first sharded
    weight it holds, in its own shard file; returns (key, value read back by torch's reader)."""
    def first_chunk(value):      # the first chunk this rank writes of a sharded value
        if isinstance(value, FlatRangeShard):
            return next(value.pieces())[2].contiguous() if value.local_flat.numel() else None
        return local_piece(value).contiguous() if isinstance(value, DTensor) else None

    name, piece = next((k, c) for k, c in ((k, first_chunk(v)) for k, v in model.state_dict().items())
                       if c is not None and c.numel() >= 16)
    path = f"{directory}/__{rank}_0.distcp"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.find(piece.numpy().tobytes())
    assert at >= 0 and data.find(piece.numpy().tobytes(), at + 1) < 0
    data[at + 3] ^= 0x40                     # float32, little-endian: exponent MSB (x * 2**128 for |x| < 2)
    with open(path, "wb") as f:
        f.write(data)
    return name


def _damage(root):
    for variant in ("cut_shard", "cut_shard_plain"):     # so that every read of rank 1's shard fails
        _truncate(f"{root}/{variant}/__1_0.distcp", 64)
    for variant in ("cut_meta", "cut_meta_plain"):
        _truncate(f"{root}/{variant}/.metadata")
    for variant in ("cut_shard_plain", "cut_meta_plain", "no_manifest"):    # as dcp.save's plain writer leaves them
        os.remove(f"{root}/{variant}/.checksums.json")


def _integrity_cases(rank, world, root):
    model, opt = build()
    train(model, opt, range(1), rank, world)
    good = f"{root}/ckpt"
    save_checkpoint(good, model, opt)
    for variant in ("flip", "cut_shard", "cut_meta", "cut_shard_plain", "cut_meta_plain", "no_manifest"):
        _leader_then_all(rank, shutil.copytree, good, f"{root}/{variant}")
    flipped = _flip_in_own_shard(model, f"{root}/flip", rank) if rank == 1 else None
    _leader_then_all(rank, _damage, root)
    out = {}
    fresh, fresh_opt = build(seed=1)
    sd = {f"model.{k}": v for k, v in fresh.state_dict().items()}      # torch's own reader: loads silently
    dcp.load(sd, storage_reader=FileSystemReader(f"{root}/flip"))
    if flipped:
        value = sd[f"model.{flipped}"]
        local = value.local_flat if isinstance(value, FlatRangeShard) else local_piece(value).reshape(-1)
        out["torch_reader_flip_value"] = local[0].item()
    else:
        out["torch_reader_flip_value"] = None
    out["torch_reader_cut_shard"] = failure(lambda: dcp.load(sd, storage_reader=FileSystemReader(f"{root}/cut_shard")))
    for variant in ("flip", "cut_shard", "cut_meta", "no_manifest"):
        out[variant] = failure(lambda: load_checkpoint(f"{root}/{variant}", fresh, fresh_opt))
    out["flip_dcp_idiom"] = failure(lambda: dcp.load(sd, storage_reader=SafeFileSystemReader(f"{root}/flip")))
    out["cut_shard_plain"] = failure(lambda: dcp.load(sd, storage_reader=SafeFileSystemReader(
        f"{root}/cut_shard_plain")))
    out["cut_meta_plain"] = failure(lambda: SafeFileSystemReader(f"{root}/cut_meta_plain").read_metadata())
    load_checkpoint(good, fresh, fresh_opt)
    out["good_loads"] = same(snapshot(fresh, fresh_opt), snapshot(model, opt))
    return out


# ---------------------------------------------------------------- item 4: the state a crash leaves
CRASH_POINTS = ("writing", "written", "between_renames", "deleting_old", "rename_fails")
NEWEST_COMPLETE = {"writing": "A", "written": "B", "between_renames": "B", "deleting_old": "B", "rename_fails": "B"}


def _leave_crash_state(point, path, newer):
    """Rank 0: turn (``path`` = checkpoint A, ``newer`` = a complete save of B) into what a crash of
    the save of B at ``point`` leaves on disk (checkpoint/commit.py, [Note: committing a checkpoint
    directory])."""
    tmp, old = path + ".tmp", path + ".old"
    if point == "writing":                   # some shard files written, no .metadata, no manifest
        shutil.copytree(newer, tmp)
        for name in (".checksums.json", ".metadata"):
            os.remove(f"{tmp}/{name}")
        _truncate(f"{tmp}/__1_0.distcp")
    elif point == "written":
        shutil.copytree(newer, tmp)
    elif point == "between_renames":
        os.rename(path, old)
        shutil.copytree(newer, tmp)
    elif point == "deleting_old":            # remove() deletes the manifest first, then files
        os.rename(path, old)
        shutil.copytree(newer, path)
        for name in (".checksums.json", "__0_0.distcp"):
            os.remove(f"{old}/{name}")
    shutil.rmtree(newer)


def _crash_state_cases(rank, world, root):
    out = {}
    for point in CRASH_POINTS:
        base = f"{root}/{point}"
        path = f"{base}/ckpt"
        model, opt = build()
        train(model, opt, range(1), rank, world)
        save_checkpoint(path, model, opt)
        saved = {"A": snapshot(model, opt)}
        train(model, opt, range(1, 2), rank, world)
        saved["B"] = snapshot(model, opt)
        error = None
        if point == "rename_fails":          # rank 0's first rename fails, as with a leftover ckpt.old
            def refuse(p):
                raise OSError(39, "Directory not empty", p)
            with mock.patch.object(checkpoint_commit, "commit", refuse if rank == 0 else checkpoint_commit.commit):
                error = failure(lambda: save_checkpoint(path, model, opt))
        else:
            save_checkpoint(f"{base}/newer", model, opt)
            _leader_then_all(rank, _leave_crash_state, point, path, f"{base}/newer")
        left = sorted(os.listdir(base))
        fresh, fresh_opt = build(seed=1)
        load_checkpoint(path, fresh, fresh_opt)
        loaded = next((label for label, state in saved.items() if same(snapshot(fresh, fresh_opt), state)), "neither")
        train(fresh, fresh_opt, range(2, 3), rank, world)
        save_checkpoint(path, fresh, fresh_opt)
        again, again_opt = build(seed=2)
        load_checkpoint(path, again, again_opt)
        out[point] = {"error": error, "left": left, "loaded": loaded, "final": sorted(os.listdir(base)),
                      "next_save_loads": same(snapshot(again, again_opt), snapshot(fresh, fresh_opt))}
        dist.barrier()
    return out


# ---------------------------------------------------------------- item 5: another optimizer's state
def _optimizer_cases(rank, world, root):
    out = {}
    for label, hyper in (("sgd_momentum", {"momentum": 0.9}), ("sgd", {})):
        model, sgd = build(optimizer=torch.optim.SGD, **hyper)
        train(model, sgd, range(1), rank, world)
        save_checkpoint(f"{root}/{label}", model, sgd)
        fresh, adamw = build(seed=1)
        before = fresh.full_state_dict()
        out[label] = failure(lambda: load_checkpoint(f"{root}/{label}", fresh, adamw))
        after = fresh.full_state_dict()
        out[f"{label}_model_untouched"] = all(torch.equal(after[k], v) for k, v in before.items())
    model, sgd = build(optimizer=torch.optim.SGD, momentum=0.9)
    train(model, sgd, range(1), rank, world)
    fresh, adamw = build(seed=1)
    out["load_optimizer_state_dict"] = failure(
        lambda: load_optimizer_state_dict(fresh, adamw, optimizer_state_dict(model, sgd)))
    model, adam = build(optimizer=torch.optim.Adam)     # Adam and AdamW keep the same state: loads
    train(model, adam, range(1), rank, world)
    save_checkpoint(f"{root}/adam", model, adam)
    fresh, adamw = build(seed=1)
    load_checkpoint(f"{root}/adam", fresh, adamw)
    train(fresh, adamw, range(1, 2), rank, world)
    out["adam_into_adamw_step"] = adamw.state[dict(fresh.named_parameters())["proj.weight"]]["step"].item()
    return out


def _worker(rank, world, root):
    return run_parts(rank, world, root, (("integrity", _integrity_cases), ("crash", _crash_state_cases),
                                         ("optimizer", _optimizer_cases)))


results = distributed_fixture(_worker, "guarantees")


def test_a_flipped_bit_raises_on_every_rank_naming_the_file_and_the_rank(results):
    assert abs(results[1]["integrity"]["torch_reader_flip_value"]) > 1e30     # what loaded silently before
    for out in (r["integrity"] for r in results):
        for case in ("flip", "flip_dcp_idiom"):
            message = out[case]
            assert "/flip/__1_0.distcp' is truncated or corrupt (found on rank 1): its sha256 is" in message, message
        assert out["flip"].startswith("CheckpointCorruptError: load_checkpoint(")
        assert out["good_loads"]


def test_truncated_files_raise_naming_the_file(results):
    for out in (r["integrity"] for r in results):
        assert "truncated or corrupt" not in out["torch_reader_cut_shard"]         # before: a bare error
        assert "/cut_shard/__1_0.distcp' is truncated or corrupt (found on rank 1): it has" in out["cut_shard"]
        assert "the save wrote" in out["cut_shard"]
        assert "/cut_meta/.metadata' is truncated or corrupt (found on rank" in out["cut_meta"]
        assert ("/cut_shard_plain/__1_0.distcp' is truncated or corrupt (found on rank 1): it has"
                in out["cut_shard_plain"]) and ".metadata places data up to byte" in out["cut_shard_plain"]
        assert "/cut_meta_plain/.metadata' is truncated or corrupt" in out["cut_meta_plain"]
        assert "it does not unpickle as DCP metadata" in out["cut_meta_plain"]
        assert "has no .checksums.json, so its files cannot be verified" in out["no_manifest"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_next_save_and_load_recover_from_a_crash_at_any_point_of_a_save(results, point):
    for rank, out in enumerate(r["crash"][point] for r in results):
        assert out["loaded"] == NEWEST_COMPLETE[point], (rank, out)
        assert out["final"] == ["ckpt"] and out["next_save_loads"], (rank, out)
    if point == "rename_fails":                   # rank 0 failed; rank 1 raised too instead of waiting
        left = results[0]["crash"][point]["left"]
        assert left == ["ckpt", "ckpt.tmp"], left
        assert results[0]["crash"][point]["error"].startswith("OSError: [Errno 39] Directory not empty")
        assert results[1]["crash"][point]["error"].startswith("OSError: save_checkpoint(")
        assert "failed on group rank(s) [0], so every rank stops: group rank 0: [Errno 39]" in \
            results[1]["crash"][point]["error"]


def test_another_optimizers_state_raises_at_load_naming_both_classes(results):
    adamw_keys = "'state.proj.weight.exp_avg', 'state.proj.weight.exp_avg_sq', 'state.proj.weight.step'"
    for out in (r["optimizer"] for r in results):
        for case in ("sgd_momentum", "sgd"):          # SGD with momentum keeps momentum_buffer, without it nothing
            assert out[case].startswith(f"ValueError: load_checkpoint('"), out[case]
            assert ("the checkpoint's optimizer state was saved by SGD and does not fit AdamW: missing keys ["
                    in out[case])
            assert adamw_keys in out[case] and "and 46 more" in out[case], out[case]
            assert out[f"{case}_model_untouched"]
        assert out["load_optimizer_state_dict"].startswith(
            "ValueError: load_optimizer_state_dict: the checkpoint's optimizer state was saved by SGD and does not "
            "fit AdamW: missing keys [")
        assert adamw_keys in out["load_optimizer_state_dict"]
        assert out["adam_into_adamw_step"] == 2.0
