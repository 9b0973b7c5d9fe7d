"""No documented load path unpickles anything outside torch's weights-only allow-list (issue item 1).

A checkpoint whose ``.metadata`` uses only DCP's own (allow-listed) classes declares an entry as
pickled bytes; the bytes are a harmless marker payload that creates a file when unpickled. Every
documented load path must refuse it and leave no file behind:
``dcp.load(sd, storage_reader=SafeFileSystemReader(path))`` (a model's and an optimizer's state
dict, and an object entry), ``load_checkpoint`` and Megatron's ``load_dist_checkpoint``. Controls
load the same files through torch's and Megatron's own readers and do create the file: the
payload is live, and these paths unpickled it before ``SafeFileSystemReader`` vetted byte entries.

One rank in the test process (``single_rank_group``): none of this needs a second rank.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex)

from megatron_fsdp_v2 import (ChecksummedFileSystemWriter, SafeFileSystemReader, UnsafeCheckpointError, fully_shard,
                              load_checkpoint, optimizer_state_dict)

from .checkpoint_helpers import failure
from .models import Block, UnevenNet


def _trip(path):
    open(path, "w").close()


class Marker:
    """Pickles to a call of ``_trip(path)``: unpickling it leaves a file behind (test_checkpoint.py
    uses it too)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _trip, (self.path,)


@pytest.fixture()
def model_and_optimizer(single_rank_group):
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_byte_entries_are_never_unpickled_on_any_documented_load_path(tmp_path, model_and_optimizer):
    model, opt = model_and_optimizer
    flag = str(tmp_path / "unpickled.flag")
    evil_model = dict(model.state_dict(), **{"proj.weight": Marker(flag)})     # a weight declared as bytes
    dcp.save(evil_model, checkpoint_id=str(tmp_path / "model"))
    evil_optim = dict(optimizer_state_dict(model, opt), **{"state.proj.weight.exp_avg": Marker(flag)})
    dcp.save(evil_optim, checkpoint_id=str(tmp_path / "optim"))
    dcp.save({f"model.{k}": v for k, v in evil_model.items()},       # save_checkpoint's layout, with checksums
             storage_writer=ChecksummedFileSystemWriter(str(tmp_path / "ckpt")))
    with open(tmp_path / "model" / ".metadata", "rb") as f:
        assert isinstance(pickle.load(f).state_dict_metadata["proj.weight"], BytesStorageMetadata)

    got = {
        "model": failure(lambda: dcp.load(model.state_dict(),
                                          storage_reader=SafeFileSystemReader(str(tmp_path / "model")))),
        "optimizer": failure(lambda: dcp.load(optimizer_state_dict(model, opt),
                                              storage_reader=SafeFileSystemReader(str(tmp_path / "optim")))),
        "object": failure(lambda: dcp.load({"proj.weight": io.BytesIO()},
                                           storage_reader=SafeFileSystemReader(str(tmp_path / "model")))),
        "load_checkpoint": failure(lambda: load_checkpoint(str(tmp_path / "ckpt"), model)),
    }
    assert not os.path.exists(flag), f"a load path unpickled the marker: {got}"
    assert "UnsafeCheckpointError: checkpoint entry 'proj.weight' in" in got["model"]
    assert "is pickled bytes where the state dict holds a tensor; it is not unpickled" in got["model"]
    assert "checkpoint entry 'state.proj.weight.exp_avg'" in got["optimizer"]
    assert "torch.load(weights_only=True) refused it" in got["object"] and "_trip" in got["object"]
    assert "proj.weight: expected (13, 7), got non-tensor bytes" in got["load_checkpoint"]

    shutil.copytree(tmp_path / "model", tmp_path / "control")            # torch's own reader runs it
    dcp.load(model.state_dict(), storage_reader=FileSystemReader(str(tmp_path / "control")))
    assert os.path.exists(flag)


def test_metadata_reader_refuses_foreign_globals_and_paths_outside_the_checkpoint(tmp_path):
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(Marker(str(tmp_path / "unpickled.flag")), f)
    with pytest.raises(pickle.UnpicklingError, match=r"refers to tests\.unit\.test_checkpoint_safety\._trip"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "unpickled.flag").exists()

    metadata = Metadata(state_dict_metadata={"w": BytesStorageMetadata()},
                        storage_data={MetadataIndex("w"): _StorageInfo("../../etc/passwd", 0, 10)})
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafeCheckpointError, match=r"places data in '\.\./\.\./etc/passwd'; only file names inside"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")
def test_megatron_load_dist_checkpoint_never_unpickles_common_state_objects(tmp_path, single_rank_group):
    """Megatron stores non-tensor state (its common state, ShardedObjects) as DCP byte entries and
    its own reader loads them with torch.load(weights_only=False)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_fsdp_v2.megatron import load_dist_checkpoint
    from tests.megatron_cpu import patch_megatron_for_cpu

    def sharded(tensor):
        return {"w": ShardedTensor.from_rank_offsets("w", tensor, replica_id=0)}

    class Holder:
        """What load_dist_checkpoint needs of a model: a sharded_state_dict and a load_state_dict."""

        loaded = None

        def sharded_state_dict(self):
            return sharded(torch.zeros(2, 3))

        def load_state_dict(self, state_dict):
            self.loaded = state_dict

    flag = str(tmp_path / "unpickled.flag")
    weights = torch.arange(6.0).view(2, 3)
    with patch_megatron_for_cpu():
        for name, extra in (("good", {"iteration": 7, "note": "weights-only types"}), ("evil", {"x": Marker(flag)})):
            os.makedirs(tmp_path / name)
            dist_checkpointing.save({**sharded(weights), **extra}, str(tmp_path / name))
        holder = Holder()
        load_dist_checkpoint(str(tmp_path / "good"), holder)
        assert torch.equal(holder.loaded["w"], weights)
        message = failure(lambda: load_dist_checkpoint(str(tmp_path / "evil"), Holder()))
        assert not os.path.exists(flag), message
        assert "UnsafeCheckpointError" in message and "common_state" in message
        assert "torch.load(weights_only=True) refused it" in message and "_trip" in message
        shutil.copytree(tmp_path / "evil", tmp_path / "control")        # Megatron's own reader runs it
        dist_checkpointing.load(sharded(torch.zeros(2, 3)), str(tmp_path / "control"))
    assert os.path.exists(flag)
