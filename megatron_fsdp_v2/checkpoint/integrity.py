"""Checksums of a checkpoint's files, written at save and verified before a file is read, so a
flipped bit or a cut-off file raises naming the file instead of loading silently (without them, a
bit flipped in a shard file loaded as a weight of 9.1e37).

[Note: the checksum manifest]
``ChecksummedFileSystemWriter`` is DCP's ``FileSystemWriter`` plus one file, ``.checksums.json``::

    {"format": 1, "algorithm": "sha256",
     "files": {"__0_0.distcp": {"sha256": "9f2c...", "bytes": 123456}, ..., ".metadata": {...}}}

Each rank hashes the bytes of each file as they are written (``_HashingFileSystem``: the stream
DCP writes through updates the digest, so no file is read back) and hands the digests to the
coordinator inside its write results, under an index no state dict uses. A rank with a large
state writes it as several files, one per writer thread (``io_threads``), so the writing and the
hashing of its files run in parallel, and so does their verification at load (safe_reader.py).
The coordinator's ``finish`` takes the digests out again (``.metadata`` stays exactly DCP's), lets
DCP write ``.metadata``, hashes it and writes the manifest last: temporary file, fsync, rename,
fsync of the directory. DCP runs ``finish`` only after every rank's files are written and fsynced,
so **a directory with a manifest is a complete checkpoint**; commit.py builds its
crash recovery on that.

The manifest is JSON: reading it cannot run code. ``SafeFileSystemReader`` (safe_reader.py) checks
the size and digest of every file against it before reading the file. A file that does not match
raises ``CheckpointCorruptError`` naming the file and the rank that found it. sha256 rather than
crc32: both catch bit flips; sha256 costs ~1.5 GB/s per core instead of ~2.8 GB/s, but is the
usual choice and what Megatron's own integrity manifest uses (the cost is measured in
docs/checkpointing.md). Cf. pytorch/torchtitan#4011 (RFC: a SHA-256 manifest for DCP checkpoints).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..comm.ledger_registry import before_collective
from .collective_errors import raise_on_every_rank
from .dcp_format import FlatRangeShard
from .errors import CheckpointCorruptError, corrupt, this_rank

__all__ = ["ALGORITHM", "MANIFEST", "METADATA_FILE", "CheckpointCorruptError", "ChecksummedFileSystemWriter",
           "bytes_checksum", "corrupt", "file_checksum", "has_manifest", "in_parallel", "io_threads", "read_manifest",
           "this_rank", "verification_scope", "verify_directory", "verify_file", "write_directory_manifest",
           "write_manifest"]

MANIFEST = ".checksums.json"
METADATA_FILE = ".metadata"     # DCP's name for it (torch.distributed.checkpoint.filesystem._metadata_fn)
ALGORITHM = "sha256"
FORMAT = 1
_CHUNK = 8 << 20
_DIGESTS_FQN = "\x00megatron_fsdp_v2 file checksums"   # a write-result index no state-dict key can equal
#: A rank writes one file per this many bytes of its state, each with a thread of its own, up to
#: IO_THREADS_MAX and its share of the host's cores (the writing and hashing of one file is serial).
IO_BYTES_PER_THREAD = 1 << 30
IO_THREADS_MAX = 8


def _cores_per_rank() -> int:
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def io_threads(state_dict: dict) -> int:
    """How many files (and writer threads) a rank uses for ``state_dict``: one per
    ``IO_BYTES_PER_THREAD`` of its local bytes, at least 1, at most ``IO_THREADS_MAX`` and its
    share of the cores."""
    local = 0
    for value in state_dict.values():
        piece = value.local_flat if isinstance(value, FlatRangeShard) else getattr(value, "_local_tensor", value)
        if isinstance(piece, torch.Tensor):
            local += piece.numel() * piece.element_size()
    return max(1, min(IO_THREADS_MAX, _cores_per_rank(), local // IO_BYTES_PER_THREAD))


def in_parallel(work, items: list) -> list:
    """``[work(item) for item in items]`` on up to ``IO_THREADS_MAX`` threads (file reads and
    sha256 release the GIL), in the order of ``items``."""
    if len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(min(len(items), IO_THREADS_MAX, _cores_per_rank())) as pool:
        return list(pool.map(work, items))


def file_checksum(path) -> dict:
    """``{"sha256": hex digest, "bytes": size}`` of the file at ``path``."""
    digest, size = hashlib.new(ALGORITHM), 0
    buffer = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                return {ALGORITHM: digest.hexdigest(), "bytes": size}
            digest.update(buffer[:n])     # hashlib releases the GIL for large updates
            size += n


def bytes_checksum(data: bytes) -> dict:
    return {ALGORITHM: hashlib.new(ALGORITHM, data).hexdigest(), "bytes": len(data)}


def has_manifest(directory) -> bool:
    """Whether ``directory`` holds a manifest, i.e. is a complete checkpoint (see the note)."""
    return os.path.isfile(os.path.join(os.fspath(directory), MANIFEST))


def read_manifest(directory) -> Optional[dict]:
    """``{file name: {"sha256": ..., "bytes": ...}}`` from ``directory``'s manifest, or None if it has none."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise corrupt(path, f"it does not parse as a checksum manifest ({type(exc).__name__}: {exc})") from exc
    if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM:
        raise ValueError(f"checksum manifest {path!r}: format {manifest.get('format')!r} with algorithm "
                         f"{manifest.get('algorithm')!r}; this version reads format {FORMAT} with {ALGORITHM!r}.")
    return files


def _mismatch(expected: dict, got: dict) -> Optional[str]:
    if got["bytes"] != expected["bytes"]:
        return f"it has {got['bytes']} bytes, the save wrote {expected['bytes']}"
    if got[ALGORITHM] != expected[ALGORITHM]:
        return f"its {ALGORITHM} is {got[ALGORITHM][:16]}..., the save wrote {expected[ALGORITHM][:16]}..."
    return None


class _Verified:
    """Files checked inside the current ``verification_scope``: path -> (size, mtime, digest)."""

    files: Optional[dict] = None


@contextmanager
def verification_scope():
    """Within it a file is hashed once while its size and modification time stay the same: one
    load that reads a directory through several readers (``verify_directory``, then Megatron's
    readers) checks each file once. Outside any scope every check hashes."""
    outer = _Verified.files
    if outer is None:
        _Verified.files = {}
    try:
        yield
    finally:
        if outer is None:
            _Verified.files = None


def verify_file(directory, name: str, manifest: dict, data: Optional[bytes] = None) -> None:
    """Raise ``CheckpointCorruptError`` unless file ``name`` of ``directory`` (or ``data``, its
    content already read) has the size and digest the manifest lists for it."""
    path = os.path.join(os.fspath(directory), name)
    expected = manifest.get(name)
    if expected is None:
        raise corrupt(path, f"{MANIFEST} does not list it, so the save did not write it")
    if data is not None:
        why = _mismatch(expected, bytes_checksum(data))
        if why:
            raise corrupt(path, why)
        return
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise corrupt(path, f"it does not exist; the save wrote {expected['bytes']} bytes") from None
    if stat.st_size != expected["bytes"]:      # cheap, before hashing
        raise corrupt(path, f"it has {stat.st_size} bytes, the save wrote {expected['bytes']}")
    stamp = (stat.st_size, stat.st_mtime_ns, expected[ALGORITHM])
    seen = _Verified.files
    if seen is not None and seen.get(path) == stamp:
        return
    why = _mismatch(expected, file_checksum(path))
    if why:
        raise corrupt(path, why)
    if seen is not None:
        seen[path] = stamp


def write_manifest(directory: str, files: dict) -> None:
    """Write ``directory``'s manifest for ``files`` ({name: checksum}): temporary file, fsync,
    rename, fsync of the directory. Last of a save: it marks the directory complete."""
    path = os.path.join(directory, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _round_robin(names: list, group) -> list:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return [name for i, name in enumerate(sorted(names)) if i % size == rank]


def write_directory_manifest(directory, group=None) -> None:
    """The manifest for a DCP directory another writer produced (Megatron's
    ``dist_checkpointing.save``): every ``.distcp`` file and ``.metadata``. Collective: every rank
    calls it after the save returned; each hashes a round-robin share of the files and the group's
    rank 0 writes the manifest last, so it still marks a complete checkpoint."""
    directory = os.fspath(directory)
    names = [n for n in os.listdir(directory) if n.endswith(".distcp") or n == METADATA_FILE]
    share = _round_robin(names, group)
    mine = dict(zip(share, in_parallel(file_checksum, [os.path.join(directory, name) for name in share])))
    everyone: list = [None] * dist.get_world_size(group)
    before_collective(group, "all_gather_object", "write_directory_manifest: checksums")
    dist.all_gather_object(everyone, mine, group=group)
    if dist.get_rank(group) == 0:
        files: dict = {}
        for part in everyone:
            files.update(part)
        write_manifest(directory, files)
    before_collective(group, "barrier", "write_directory_manifest: written")
    dist.barrier(group=group)


def verify_directory(directory, group=None) -> None:
    """Check every file the directory's manifest lists (each rank a round-robin share) and raise
    ``CheckpointCorruptError`` on every rank if any rank found a mismatch: for readers whose own
    reads are not collective-safe (Megatron's load exchanges what one rank read with
    broadcasts, so an error on one rank alone would leave the others waiting). No manifest: nothing
    to check."""

    directory = os.fspath(directory)
    error = None
    try:
        manifest = read_manifest(directory)
        in_parallel(lambda name: verify_file(directory, name, manifest), _round_robin(list(manifest or ()), group))
    except ValueError as exc:              # CheckpointCorruptError, or a manifest of another format
        error = exc
    raise_on_every_rank(group, error, f"verifying checkpoint {directory!r}", "verify_directory: checksums checked")


class _HashingStream(io.RawIOBase):
    """A file DCP writes, digesting every byte on its way to the file (DCP only appends)."""

    raw: io.IOBase
    digest: "hashlib._Hash"
    size: int

    def __init__(self, raw) -> None:
        super().__init__()
        self.raw, self.digest, self.size = raw, hashlib.new(ALGORITHM), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)          # hashlib releases the GIL for large updates
        self.size += view.nbytes
        return self.raw.write(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        super().close()                   # flushes
        self.raw.close()

    def checksum(self) -> dict:
        return {ALGORITHM: self.digest.hexdigest(), "bytes": self.size}


class _HashingFileSystem(FileSystem):
    """DCP's ``FileSystem`` whose shard-file streams digest what is written (see the note)."""

    digests: dict                        # file name -> checksum, filled by the writer threads

    def __init__(self) -> None:
        super().__init__()
        self.digests = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if mode != "wb" or not os.fspath(path).endswith(".distcp"):
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
            self.digests[os.path.basename(os.fspath(path))] = hashing.checksum()


class ChecksummedFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that also writes ``.checksums.json`` (see the note at the top):
    ``dcp.save(sd, storage_writer=ChecksummedFileSystemWriter(path))``. Same arguments;
    ``thread_count`` writes that many files per rank in parallel (``io_threads`` picks it for
    ``save_checkpoint``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _HashingFileSystem()

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not kwargs.get("use_collectives", True):
            raise ValueError("ChecksummedFileSystemWriter writes one manifest for all ranks, so it needs dcp.save's "
                             "collectives; got use_collectives=False.")

    def write_data(self, plan, planner) -> Future:
        self.fs.digests.clear()
        written = super().write_data(plan, planner)
        results = list(written.value())
        files = {result.storage_data.relative_path for result in results} | set(self.fs.digests)
        digests = {name: self.fs.digests.get(name) or file_checksum(self.fs.concat_path(self.path, name))
                   for name in sorted(files)}
        done: Future = Future()
        done.set_result(results + [WriteResult(index=MetadataIndex(_DIGESTS_FQN), size_in_bytes=0,
                                               storage_data=digests)])
        return done

    def finish(self, metadata: Metadata, results: list) -> None:
        files: dict = {}
        kept = []
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn == _DIGESTS_FQN:
                    files.update(result.storage_data)
            kept.append([result for result in rank_results if result.index.fqn != _DIGESTS_FQN])
        super().finish(metadata, kept)
        files[METADATA_FILE] = file_checksum(self._get_metadata_path())
        write_manifest(os.fspath(self.path), files)
