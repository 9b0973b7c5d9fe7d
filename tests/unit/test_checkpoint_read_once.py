"""What a save and a load no longer do twice (issue 64, item 3), in one process (DCP's no_dist):

* the writer hashes a shard file while writing it: no shard file is read back, only ``.metadata``
  is hashed from disk, and the manifest holds the file's true sha256;
* a reader reads, checks and unpickles ``.metadata`` once, however often DCP asks;
* within ``verification_scope`` a file is hashed once across readers, and again once it changed.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed.checkpoint as dcp

from megatron_fsdp_v2 import ChecksummedFileSystemWriter, SafeFileSystemReader
from megatron_fsdp_v2.checkpoint import integrity


def _saved(tmp_path, monkeypatch) -> tuple:
    """A checkpoint of two tensors, and the files ``file_checksum`` read while it was written."""
    hashed = []
    original = integrity.file_checksum
    monkeypatch.setattr(integrity, "file_checksum", lambda path: hashed.append(str(path)) or original(path))
    sd = {"w": torch.arange(1000.0).reshape(10, 100), "b": torch.ones(7)}
    dcp.save(sd, storage_writer=ChecksummedFileSystemWriter(str(tmp_path)), no_dist=True)
    monkeypatch.setattr(integrity, "file_checksum", original)
    return sd, hashed


def test_shard_files_are_hashed_while_written_not_read_back(tmp_path, monkeypatch):
    _, hashed = _saved(tmp_path, monkeypatch)
    assert [p.rsplit("/", 1)[-1] for p in hashed] == [".metadata"]
    manifest = integrity.read_manifest(tmp_path)
    shard = tmp_path / "__0_0.distcp"
    assert manifest["__0_0.distcp"] == {"sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
                                        "bytes": shard.stat().st_size}


def test_metadata_is_read_once_per_reader_and_files_hashed_once_per_scope(tmp_path, monkeypatch):
    sd, _ = _saved(tmp_path, monkeypatch)
    reader = SafeFileSystemReader(str(tmp_path), require_checksums=True)
    reads = []
    original_read = SafeFileSystemReader._read_metadata
    monkeypatch.setattr(SafeFileSystemReader, "_read_metadata", lambda self, path: reads.append(path) or
                        original_read(self, path))
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.read_metadata() is reader.read_metadata() and len(reads) == 1
    assert all(torch.equal(target[k], v) for k, v in sd.items())

    hashed = []
    original = integrity.file_checksum
    monkeypatch.setattr(integrity, "file_checksum", lambda path: hashed.append(str(path)) or original(path))
    manifest = integrity.read_manifest(tmp_path)
    with integrity.verification_scope():
        for _ in range(2):
            integrity.verify_file(tmp_path, "__0_0.distcp", manifest)
        assert len(hashed) == 1
        (tmp_path / "__0_0.distcp").touch()                 # changed since: hashed again
        integrity.verify_file(tmp_path, "__0_0.distcp", manifest)
        assert len(hashed) == 2
    integrity.verify_file(tmp_path, "__0_0.distcp", manifest)   # outside a scope every check hashes
    assert len(hashed) == 3
