"""``async_save_checkpoint`` keeps every promise of ``save_checkpoint`` (issue 64), on 2 gloo ranks:

* it returns before the write finishes (the writer is held until the caller releases it, so the
  save cannot have finished when it returns), and what it wrote loads bitwise as the synchronous
  save of the same state does, although training went on while it was written;
* training after it (two steps while the write is held, two while it runs) is bitwise training
  without it: the write reads host copies, never the live weights and optimizer state, and its
  collectives run on a group of their own while the training's run on the world;
* a second save waits for the one in flight (it is seen waiting while the first is held), and
  neither checkpoint is the other's;
* ``destroy_process_group`` finishes the save in flight first (it is seen waiting while the save
  is held, and the checkpoint loads); a group destroyed around that gives a clear error from the
  future; an error nobody read is raised by the next save, and the save after that works;
* DCP's own ``async_save`` takes ``HostStager`` (the DCP idiom);
* on 4 ranks, two data-parallel groups (as under tensor parallelism) each save asynchronously: every
  rank creates both background groups, in one order, and each checkpoint loads.

A rank killed (SIGKILL) in the middle of an asynchronous save: test_checkpoint_crash.py.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_fsdp_v2 import (ChecksummedFileSystemWriter, HostStager, SafeFileSystemReader, async_save_checkpoint,
                              fully_shard, load_checkpoint, save_checkpoint)
from megatron_fsdp_v2.checkpoint import background
from megatron_fsdp_v2.checkpoint.dcp_format import FlatRangeShard
from megatron_fsdp_v2.checkpoint.integrity import has_manifest

from .checkpoint_helpers import distributed_fixture, failure, run_parts, snapshot
from .dist_utils import run_distributed
from .models import Block, UnevenNet
from .test_checkpoint_guarantees import build, same, train


class _HeldWriter:
    """Holds every rank's shard write until ``release`` (ChecksummedFileSystemWriter.write_data
    patched in this process), and records when each write starts and ends."""

    def __init__(self):
        self.started, self.release, self.events = threading.Event(), threading.Event(), []
        self.original = ChecksummedFileSystemWriter.write_data

    def __enter__(self):
        held = self

        def write_data(writer, plan, planner):
            held.events.append(("start", str(writer.path)))
            held.started.set()
            held.release.wait()
            out = held.original(writer, plan, planner)
            held.events.append(("end", str(writer.path)))
            return out
        ChecksummedFileSystemWriter.write_data = write_data
        return self

    def __exit__(self, *exc):
        ChecksummedFileSystemWriter.write_data = self.original


def _loaded(path, seed=3):
    model, opt = build(seed=seed)
    load_checkpoint(path, model, opt)
    return snapshot(model, opt)


def _returns_before_the_write(rank, world, root):
    model, opt = build()
    reference, reference_opt = build()
    train(model, opt, range(1), rank, world)
    train(reference, reference_opt, range(4), rank, world)        # the same steps, no save
    save_checkpoint(f"{root}/sync", model, opt)
    at_save = snapshot(model, opt)
    with _HeldWriter() as held:
        future = async_save_checkpoint(f"{root}/async", model, opt)
        pending = not future.done() and not has_manifest(f"{root}/async.tmp")
        train(model, opt, range(1, 3), rank, world)               # while the write is held
        held.release.set()
        train(model, opt, range(3, 4), rank, world)               # while it runs
        future.result()
    loaded = _loaded(f"{root}/async")
    return {"returned_pending": pending, "loads_what_sync_saved": same(loaded, _loaded(f"{root}/sync")),
            "loads_state_at_save": same(loaded, at_save),
            "training_unaffected": same(snapshot(model, opt), snapshot(reference, reference_opt)),
            "events": held.events}


def _second_save_waits(rank, world, root):
    model, opt = build()
    train(model, opt, range(1), rank, world)
    first = snapshot(model, opt)
    out = {}
    with _HeldWriter() as held:
        one = async_save_checkpoint(f"{root}/one", model, opt)
        train(model, opt, range(1, 2), rank, world)
        second = snapshot(model, opt)
        got = {}
        thread = threading.Thread(target=lambda: got.update(two=async_save_checkpoint(f"{root}/two", model, opt)))
        thread.start()
        waiting = background.wait_for_pending_save.__code__
        while thread.is_alive() and not _in_frame(thread, waiting):
            time.sleep(0.01)
        out["second_waited"] = thread.is_alive() and _in_frame(thread, waiting) and not one.done()
        held.release.set()
        thread.join()
        one.result()
        got["two"].result()
    out["events"] = [(kind, path.rsplit("/", 1)[-1]) for kind, path in held.events]
    out["one_is_first"] = same(_loaded(f"{root}/one"), first)
    out["two_is_second"] = same(_loaded(f"{root}/two"), second)
    return out


def _in_frame(thread, code) -> bool:
    """Whether ``thread`` is inside a call of ``code``."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _subgroups() -> list:
    return [group for group in dist.distributed_c10d._world.pg_map if group is not dist.group.WORLD]


def _destroy_waits_for_the_save(rank, world, root):
    """``destroy_process_group`` (thread_shutdown.py's wrapper) finishes the save in flight first."""
    model, opt = build()
    train(model, opt, range(1), rank, world)
    main, seen = threading.current_thread(), []

    def release_once_destroy_waits():
        while not (_in_frame(main, background._Writer.shut_down.__code__) or returned.is_set()):
            time.sleep(0.01)
        seen.append(not returned.is_set())
        held.release.set()

    with _HeldWriter() as held:
        future = async_save_checkpoint(f"{root}/ckpt", model, opt)
        returned, helper = threading.Event(), threading.Thread(target=release_once_destroy_waits)
        helper.start()
        for group in _subgroups():          # the background group among them
            dist.destroy_process_group(group)
        returned.set()
        helper.join()
        done = future.done()
        future.result()
    return {"destroy_waited": seen == [True] and done, "loads": same(_loaded(f"{root}/ckpt"), snapshot(model, opt))}


def _destroyed_group(rank, world, root):
    """The group destroyed around the wrapper (a ``destroy_process_group`` bound before it)."""
    model, opt = build()
    train(model, opt, range(1), rank, world)
    destroy = getattr(dist.destroy_process_group, "_megatron_fsdp_v2_original", dist.destroy_process_group)
    out = {}
    for name in ("read", "unread"):
        with _HeldWriter() as held:
            future = async_save_checkpoint(f"{root}/{name}", model, opt)
            held.started.wait()         # every rank's writer past its planning collectives, held in write_data
            dist.barrier()
            for group in _subgroups():      # what destroy_process_group() does to it
                destroy(group)
            held.release.set()
            if name == "read":
                out["future"] = failure(future.result)
            else:
                out["next_save"] = failure(lambda: save_checkpoint(f"{root}/after", model, opt))
    save_checkpoint(f"{root}/after", model, opt)
    out["after_loads"] = same(_loaded(f"{root}/after"), snapshot(model, opt))
    return out


def _dcp_idiom(rank, world, root):
    model, opt = build()
    train(model, opt, range(1), rank, world)
    stager, gloo = HostStager(), dist.new_group(backend="gloo")
    future = dcp.async_save(model.state_dict(), storage_writer=ChecksummedFileSystemWriter(f"{root}/dcp"),
                            async_stager=stager, process_group=gloo)
    train(model, opt, range(1, 2), rank, world)
    future.result()
    fresh, _ = build(seed=4)
    sd = fresh.state_dict()
    dcp.load(sd, storage_reader=SafeFileSystemReader(f"{root}/dcp", require_checksums=True))
    fresh.load_state_dict(sd)
    reference, reference_opt = build()
    train(reference, reference_opt, range(1), rank, world)
    stager.close()
    want, got = reference.full_state_dict(), fresh.full_state_dict()
    return {"loads": list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items()),
            "buffers_freed": stager.host_bytes == 0}


def _cases(rank, world, root):
    return run_parts(rank, world, root, [("returns", _returns_before_the_write), ("waits", _second_save_waits),
                                         ("destroy_waits", _destroy_waits_for_the_save),
                                         ("destroyed", _destroyed_group), ("dcp", _dcp_idiom)])


results = distributed_fixture(_cases, "async_save")


def test_async_save_returns_before_the_write_and_loads_as_the_sync_save(results):
    for out in results:
        out = out["returns"]
        assert out["returned_pending"], out
        assert out["loads_what_sync_saved"] and out["loads_state_at_save"], out
        assert [kind for kind, _ in out["events"]] == ["start", "end"], out


def test_training_after_an_async_save_is_bitwise_training_without_it(results):
    assert all(out["returns"]["training_unaffected"] for out in results)


def test_a_second_save_waits_for_the_save_in_flight(results):
    for out in results:
        out = out["waits"]
        assert out["second_waited"], out
        assert out["events"] == [("start", "one.tmp"), ("end", "one.tmp"), ("start", "two.tmp"), ("end", "two.tmp")]
        assert out["one_is_first"] and out["two_is_second"], out


def test_destroy_process_group_finishes_the_save_in_flight_first(results):
    assert all(out["destroy_waits"]["destroy_waited"] and out["destroy_waits"]["loads"] for out in results), results


def test_a_destroyed_process_group_is_named_and_an_unread_failure_raised_by_the_next_save(results):
    for out in results:
        out = out["destroyed"]
        assert out["future"].startswith("RuntimeError: async_save_checkpoint(") and \
            "the process group was destroyed before the save finished" in out["future"], out
        assert "keeps the newest complete checkpoint" in out["future"], out
        assert out["next_save"].startswith("RuntimeError: save_checkpoint(") and \
            "the asynchronous async_save_checkpoint(" in out["next_save"] and "nobody read its error" in \
            out["next_save"], out
        assert out["after_loads"], out


def test_dcp_async_save_takes_the_host_stager(results):
    assert all(out["dcp"]["loads"] and out["dcp"]["buffers_freed"] for out in results)


def _two_data_parallel_groups(rank, world, root):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]

    def built(seed):
        torch.manual_seed(seed)
        model = fully_shard(UnevenNet(), sharding_strategy="optim_grads", unit_modules=[Block],
                            process_group=groups[rank // 2])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = built(0)
    train(model, opt, range(1), rank % 2, 2)
    async_save_checkpoint(f"{root}/group{rank // 2}", model, opt).result()
    fresh, fresh_opt = built(1)
    load_checkpoint(f"{root}/group{rank // 2}", fresh, fresh_opt)
    return same(snapshot(fresh, fresh_opt), snapshot(model, opt))


def test_two_data_parallel_groups_save_asynchronously_side_by_side(tmp_path):
    assert run_distributed(_two_data_parallel_groups, 4, str(tmp_path)) == [True] * 4


# ---------------------------------------------------------------- HostStager alone (one process)
def test_the_stager_copies_into_buffers_it_reuses_and_keeps_the_value_kinds():
    weight, bias = torch.arange(12.0), torch.tensor(3.0)
    sd = {"w": FlatRangeShard((3, 8), weight, 6), "b": bias, "nested": {"n": 7, "t": torch.ones(2)}}
    stager = HostStager()
    first = stager.stage(sd)
    assert isinstance(first["w"], FlatRangeShard) and first["w"].flat_start == 6 and first["w"].shape == (3, 8)
    assert torch.equal(first["w"].local_flat, weight) and first["nested"]["n"] == 7
    assert first["w"].local_flat.data_ptr() != weight.data_ptr()        # a copy, not the live tensor
    weight.add_(1)
    assert torch.equal(first["w"].local_flat, torch.arange(12.0))
    pointers = [first["w"].local_flat.data_ptr(), first["b"].data_ptr()]
    second = stager.stage(sd)
    assert [second["w"].local_flat.data_ptr(), second["b"].data_ptr()] == pointers     # reused
    assert torch.equal(second["w"].local_flat, weight) and stager.host_bytes == 4 * (12 + 1 + 2)
    sd["extra"] = torch.zeros(5)
    stager.stage(sd)
    assert stager.host_bytes == 4 * (12 + 1 + 2 + 5)                                # reallocated for the new state
