"""Reading a DCP checkpoint directory without running code from it, and without reading a file
that is not what the save wrote: ``SafeFileSystemReader``. Pure torch.

[Note: what SafeFileSystemReader never unpickles]
DCP (torch 2.13) unpickles outside torch's weights-only allow-list in two places:
1. ``FileSystemReader.read_metadata``: a plain ``pickle.load`` of ``.metadata``
   (pytorch/pytorch#189308).
2. ``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)`` of every entry that
   ``.metadata`` declares as bytes (``BytesStorageMetadata``), also for a key whose value in the
   state dict being loaded is a tensor. So a ``.metadata`` built only from DCP's own classes can
   point a model weight at a pickled payload in a planted file, and a plain
   ``dcp.load(model.state_dict(), ...)`` runs it.
The reader closes both, so ``dcp.load(sd, storage_reader=SafeFileSystemReader(path))`` is safe
with DCP's default planner, Megatron's (it keeps the default ``load_bytes``) or any other:
1. ``.metadata`` goes through an unpickler that resolves only DCP's metadata and save-plan
   dataclasses, ``torch.Size``, torch dtypes and paths (``_ALLOWED_GLOBALS``). Plain data
   classes: unpickling them builds instances and sets fields, nothing else.
2. A byte entry is refused (``UnsafeCheckpointError``) where the state dict holds a tensor.
   Otherwise it is unpickled with ``torch.load(weights_only=True)`` and the object is put where
   ``DefaultLoadPlanner.load_bytes`` would put it. A planner with its own ``load_bytes`` gets
   a ``torch.save`` of that vetted object, so whatever it unpickles holds only allow-listed types.
3. Tensors: torch's reader already uses ``torch.load(weights_only=True)``.
Storage paths in ``.metadata`` must be plain file names inside the directory (no ``../``).

[Note: verified before it is read]
``.metadata`` is read into memory, checked, then unpickled. The data files a rank's plan reads are
checked in ``prepare_local_plan``. DCP runs that on every rank inside its planning collective,
before any tensor is read, and re-raises a failure of any rank on every rank (as a
``CheckpointException``). So a corrupt file stops the load everywhere before the state dict is
touched. A file is checked once per reader (``reset`` forgets; within integrity.py's
``verification_scope``, once per load across readers), the files of a plan in parallel (one
thread per file: sha256 is serial within a file, integrity.py's ``io_threads`` writes a large
rank's state as several files). The check reads each file once before the data is read, which
then comes from the page cache: verifying while reading would touch the state dict before a
corrupt file is found, or hold a whole file in memory until it is. ``.metadata`` is read,
checked and unpickled once per reader (DCP asks for it at every step of a load). With a planner
that keeps DCP's default ``resolve_tensor`` and ``commit_tensor`` (``load_checkpoint``'s), the
files are read in parallel too. With ``.checksums.json``
(integrity.py), each file's size and sha256 must match it. Without one (a checkpoint
written by a plain ``FileSystemWriter``), each file must at least be long enough for the data
``.metadata`` places in it. ``require_checksums=True`` refuses a checkpoint without a manifest.
Either way, a failure raises ``CheckpointCorruptError`` naming the file, the rank that found it
and the words "truncated or corrupt". So does a file whose content does not decode.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections import defaultdict
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from .errors import CheckpointCorruptError, UnsafeCheckpointError, corrupt
from .integrity import MANIFEST, in_parallel, read_manifest, verify_file

__all__ = ["SafeFileSystemReader", "TensorsOnlyLoadPlanner", "UnsafeCheckpointError"]


class _RefusedGlobal(pickle.UnpicklingError):
    """The metadata unpickler met a global outside ``_ALLOWED_GLOBALS`` (not corruption)."""


_ALLOWED_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    # Megatron's dist_checkpointing keeps every rank's save plan in .metadata (all_local_plans)
    ("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")} | {
    (module, cls) for module in ("pathlib", "pathlib._local")
    for cls in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _RefusedGlobal(f"checkpoint metadata refers to {module}.{name}; only DCP metadata and save-plan "
                             f"classes, torch.Size, torch dtypes and paths are allowed, so it is not unpickled.")


def _torch_reason(exc: BaseException) -> str:
    """The informative line of torch's (long, multi-line) weights-only refusal."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and "documentation of torch.load" not in line]
    return (lines[-1] if lines else type(exc).__name__)[:300]


class _PlannerError(Exception):
    """Carries an exception the planner itself raised through read_data, so it is not reported as
    a corrupt file."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _call_planner(method, *args):
    try:
        return method(*args)
    except Exception as exc:  # noqa: BLE001 - re-raised unchanged by read_data
        raise _PlannerError(exc) from exc


def _reads_in_parallel(planner) -> bool:
    """Files may be read by several threads when the planner only looks tensors up and keeps
    nothing per read (DCP's own ``resolve_tensor`` / ``commit_tensor``; Megatron's planner keeps
    state in both)."""
    cls = type(planner)
    return (getattr(cls, "resolve_tensor", None) is DefaultLoadPlanner.resolve_tensor
            and getattr(cls, "commit_tensor", None) is DefaultLoadPlanner.commit_tensor)


def _keeps_default_load_bytes(planner) -> bool:
    return getattr(type(planner), "load_bytes", None) is DefaultLoadPlanner.load_bytes


class _VettedBytes:
    """The planner as torch's ``FileSystemReader.read_data`` sees it: byte entries are vetted
    (see the note at the top); everything else goes to the planner."""

    def __init__(self, planner, path: str):
        self._planner = planner
        self._path = path

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def resolve_tensor(self, read_item):
        return _call_planner(self._planner.resolve_tensor, read_item)

    def commit_tensor(self, read_item, tensor) -> None:
        _call_planner(self._planner.commit_tensor, read_item, tensor)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn, planner = read_item.dest_index.fqn, self._planner
        if isinstance(planner, TensorsOnlyLoadPlanner):
            planner.load_bytes(read_item, value)        # refuses before anything is unpickled
        default = _keeps_default_load_bytes(planner)
        if default and isinstance(planner.state_dict.get(fqn), torch.Tensor):
            raise UnsafeCheckpointError(f"checkpoint entry {fqn!r} in {self._path!r} is pickled bytes where the state "
                                        f"dict holds a tensor; it is not unpickled.")
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"checkpoint entry {fqn!r} in {self._path!r} is not loaded: "
                                        f"torch.load(weights_only=True) refused it ({_torch_reason(exc)})") from None
        if not default:
            vetted = io.BytesIO()
            torch.save(obj, vetted)
            vetted.seek(0)
            _call_planner(planner.load_bytes, read_item, vetted)
        elif planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], obj)
        else:
            planner.state_dict[fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never unpickles anything outside torch's weights-only allow-list
    and checks every file before reading it (see the notes at the top):
    ``dcp.load(sd, storage_reader=SafeFileSystemReader(path))``. ``require_checksums=True``
    refuses a checkpoint without ``.checksums.json``."""

    def __init__(self, path, require_checksums: bool = False, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.require_checksums = require_checksums
        self._forget()

    def _forget(self) -> None:
        self._manifest: Optional[dict] = None
        self._manifest_read = False
        self._metadata: dict = {}        # .metadata path -> Metadata, as read and checked once
        self._verified: set = set()
        self._extents: dict = {}

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self._forget()

    def manifest(self) -> Optional[dict]:
        """The checksums of ``.checksums.json`` (None without one, unless ``require_checksums``)."""
        if not self._manifest_read:
            manifest = read_manifest(self.path)
            if manifest is None and self.require_checksums:
                raise CheckpointCorruptError(
                    f"checkpoint {os.fspath(self.path)!r} has no {MANIFEST}, so its files cannot be verified "
                    f"(save_checkpoint writes one last; a directory without it was not completely written, or was "
                    f"written by dcp.save without ChecksummedFileSystemWriter).")
            self._manifest, self._manifest_read = manifest, True
        return self._manifest

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        cached = self._metadata.get(os.fspath(path))
        if cached is None:
            cached = self._metadata[os.fspath(path)] = self._read_metadata(path)
        return cached

    def _read_metadata(self, path) -> Metadata:
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        manifest = self.manifest()
        if manifest is not None:
            verify_file(self.path, os.path.basename(os.fspath(path)), manifest, data)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except _RefusedGlobal:
            raise
        except Exception as exc:  # noqa: BLE001 - EOFError, UnpicklingError, ... of a cut or damaged file
            raise corrupt(path, f"it does not unpickle as DCP metadata ({type(exc).__name__}: {exc})") from exc
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise corrupt(path, f"it holds a {type(metadata).__name__}, not DCP Metadata with storage data")
        for info in metadata.storage_data.values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
                raise UnsafeCheckpointError(f"checkpoint metadata {os.fspath(path)!r} places data in {name!r}; only "
                                            f"file names inside the checkpoint directory are read.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._extents = defaultdict(int)
        for info in self.storage_data.values():
            self._extents[info.relative_path] = max(self._extents[info.relative_path], info.offset + info.length)

    def _verify(self, names) -> None:
        """Check the files ``names`` (see [Note: verified before it is read])."""
        manifest = self.manifest()

        def check(name: str) -> None:
            if manifest is not None:
                verify_file(self.path, name, manifest)
                return
            path = os.fspath(self.fs.concat_path(self.path, name))
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size is None or size < self._extents[name]:
                raise corrupt(path, "it does not exist" if size is None else
                              f"it has {size} bytes, .metadata places data up to byte {self._extents[name]}")

        todo = sorted(set(names) - self._verified)
        in_parallel(check, todo)
        self._verified.update(todo)

    def _files(self, items) -> dict:
        by_file = defaultdict(list)
        for item in items:
            by_file[self.storage_data[item.storage_index].relative_path].append(item)
        return by_file

    def prepare_local_plan(self, plan):
        self._verify(self._files(plan.items))
        return super().prepare_local_plan(plan)

    def read_data(self, plan, planner) -> Future:
        by_file = self._files(plan.items)
        self._verify(by_file)           # files a changed global plan added; normally all checked already

        def read(name: str) -> None:
            path = os.fspath(self.fs.concat_path(self.path, name))
            try:
                super(SafeFileSystemReader, self).read_data(dataclasses.replace(plan, items=by_file[name]),
                                                            _VettedBytes(planner, path)).wait()
            except _PlannerError as exc:
                raise exc.error from exc.error.__cause__
            except (UnsafeCheckpointError, CheckpointCorruptError):
                raise
            except Exception as exc:  # noqa: BLE001 - torch.load / narrowing of damaged content
                raise corrupt(path, f"reading it failed ({type(exc).__name__}: {exc})") from exc

        if _reads_in_parallel(planner):
            in_parallel(read, list(by_file))
        else:
            for name in by_file:
                read(name)
        done: Future = Future()
        done.set_result(None)
        return done


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """A planner for state dicts of tensors only: any byte entry is refused, before anything of it
    is unpickled (``load_checkpoint`` also refuses such checkpoints from their metadata)."""

    def load_bytes(self, read_item, value) -> None:
        raise UnsafeCheckpointError(f"checkpoint stores {read_item.dest_index.fqn!r} as pickled bytes; only tensors "
                                    f"are loaded.")
