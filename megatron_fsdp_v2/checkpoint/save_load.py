"""Atomic save and load of a wrapped model (and optimizer) with DCP, and a single-file full export.

The state dicts come from state_dict.py; how a save is committed atomically: commit.py;
checksums: integrity.py; what a load never unpickles: safe_reader.py.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import commit as checkpoint_commit
from .background import SaveFuture, background_group, group_destroyed, submit, wait_for_pending_save
from .integrity import ChecksummedFileSystemWriter, CheckpointCorruptError, io_threads
from .collective_errors import gather_reports, raise_on_every_rank, raise_reported
from .safe_reader import SafeFileSystemReader, TensorsOnlyLoadPlanner, UnsafeCheckpointError
from .staging import HostStager

from ..comm.ledger_registry import before_collective
from ..wrap.experts import expert_names_refusal

from .state_dict import (_CLASS_BYTES, CLASS_KEY, _decode_class, _missing_state, _model_shapes, _optimizer_mismatch,
                         _optimizer_params, _optimizer_targets, _raise_if_mismatched, _sharded_module, _torch_optimizer,
                         load_optimizer_state_dict, model_state_dict, optimizer_state_dict)

__all__ = ["async_save_checkpoint", "export_full_state_dict", "load_checkpoint", "save_checkpoint"]


# ---------------------------------------------------------------- atomic save / load, export
def save_checkpoint(path: "str | os.PathLike", model, optimizer=None) -> None:
    """Save model (and optimizer) state under ``path`` atomically, with a checksum of every file:
    rank 0 first recovers from any crash of an earlier save, every rank writes its shards into
    ``path.tmp`` (``.checksums.json`` last), then rank 0 puts ``path.tmp`` in place of ``path``.
    A crash at any point leaves the newest complete checkpoint loadable (commit.py,
    [Note: committing a checkpoint directory]). A failure raises on every rank. An asynchronous
    save in flight is waited for first."""
    what = f"save_checkpoint({os.fspath(path)!r})"
    model, path, group = _save_target(model, path, what)
    _write_atomically(path, _state_to_save(model, optimizer), group, "save_checkpoint")


def async_save_checkpoint(path: "str | os.PathLike", model, optimizer=None) -> SaveFuture:
    """``save_checkpoint`` in the background: returns once this rank's state is copied into host
    buffers (staging.py, [Note: staging a checkpoint in reused host buffers]); the write, the
    checksums and the atomic commit then run on a writer thread, with collectives on a gloo group
    of their own (background.py, [Note: collectives of a background save]). Returns a
    ``concurrent.futures.Future``: ``result()`` waits and raises the save's error. Every promise
    of ``save_checkpoint`` holds: a crash at any moment leaves the newest complete checkpoint
    loadable, every file is checksummed, training after the call is unaffected (the write reads
    only the copies). A save or load called while one is in flight waits for it first (raising its
    error if nobody read it). Host memory: one buffer per tensor of this rank's state, allocated at
    the first call and reused; GPU memory: none."""
    what = f"async_save_checkpoint({os.fspath(path)!r})"
    model, path, group = _save_target(model, path, what)
    background, staged, error = None, None, None
    try:
        background = background_group(group)
        staged = _stager_of(model).stage(_state_to_save(model, optimizer))
    except Exception as exc:  # noqa: BLE001 - raised on every rank below, before the writer thread starts
        error = exc
    raise_on_every_rank(group, error, f"{what}: staging the state", "async_save_checkpoint: staged")
    return submit(what, lambda: _write_in_background(path, staged, background, what))


_STAGERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # model -> its HostStager


def _stager_of(model) -> HostStager:
    """The model's staging buffers: reused by its every asynchronous save, freed with the model."""
    stager = _STAGERS.get(model)
    if stager is None:
        stager = _STAGERS[model] = HostStager()
    return stager


def _save_target(model, path, what: str) -> tuple:
    """(the module, the path as a string, the checkpoint group), after the save in flight is done."""
    model = _sharded_module(model)
    if model._fsdp_engine.experts is not None:
        raise expert_names_refusal(what.partition("(")[0])
    wait_for_pending_save(what)
    return model, os.fspath(path), _checkpoint_group(model)


def _state_to_save(model, optimizer) -> "OrderedDict[str, torch.Tensor]":
    sd = OrderedDict((f"model.{k}", v) for k, v in model_state_dict(model).items())
    if optimizer is not None:
        sd.update((f"optimizer.{k}", v) for k, v in optimizer_state_dict(model, optimizer).items())
    return sd


def _write_in_background(path: str, staged: dict, group, what: str) -> None:
    """The writer thread's part of ``async_save_checkpoint``; a destroyed process group (its first
    collective then fails) is named."""
    try:
        _write_atomically(path, staged, group, "async_save_checkpoint", staged=True)
    except BaseException as exc:
        if not group_destroyed(group):
            raise
        raise RuntimeError(f"{what}: the process group was destroyed before the save finished (wait for the "
                           f"future's result() before torch.distributed.destroy_process_group()); {path!r} keeps "
                           f"the newest complete checkpoint. ({type(exc).__name__}: {exc})") from exc


def _write_atomically(path: str, sd: dict, group, call: str, staged: bool = False) -> None:
    """Recover, write ``path.tmp``, commit (see ``save_checkpoint``), with ``group``'s collectives;
    ``call`` names the caller in errors and in the group's ledger. ``staged``: ``sd`` is host
    copies, so DCP's writer copies nothing ahead from a GPU (its copy-ahead loader would wait on
    the device's default stream, i.e. on training, for every 10 MB)."""
    leader = dist.get_rank(group) == 0
    _on_leader(group, leader, lambda: checkpoint_commit.recover(path), f"{call}({path!r}): recovering from an earlier "
               f"save", f"{call}: recovering from an earlier save")
    tmp = checkpoint_commit.tmp_dir(path)
    writer = ChecksummedFileSystemWriter(tmp, thread_count=io_threads(sd), **({"per_thread_copy_ahead": 0}
                                                                              if staged else {}))
    try:
        dcp.save(sd, storage_writer=writer, process_group=group)
    except BaseException as exc:
        if leader:                 # DCP raised on every rank, after every rank stopped writing
            try:
                checkpoint_commit.remove(tmp)
            except OSError:
                pass               # incomplete (no manifest): the next save's recover deletes it
        if isinstance(exc, CheckpointException):    # a BaseException: `except Exception` would miss it
            raise RuntimeError(f"{call}: writing {path!r} failed on ranks {sorted(exc.failures)}; the "
                               f"previous checkpoint there is intact. {exc}") from exc
        raise
    _on_leader(group, leader, lambda: checkpoint_commit.commit(path), f"{call}({path!r}): committing {tmp!r}",
               f"{call}: committing")


def _checkpoint_group(model):
    """The ranks that save and load one checkpoint together: the data-parallel group; with hybrid
    sharding every replica of every shard, which must then be the whole world (replicas write their
    identical shards once: DCP keeps one writer per chunk)."""
    engine = model._fsdp_engine
    if engine.replicas is None:
        return engine.comm.group
    if engine.comm.size * engine.replicas.size != dist.get_world_size():
        raise ValueError(f"save_checkpoint / load_checkpoint: with hybrid sharding the checkpoint is written by "
                         f"every replica of every shard, which must be the whole world ({dist.get_world_size()} "
                         f"ranks), got {engine.replicas.size} replicas x {engine.comm.size} shards.")
    return dist.group.WORLD


def _on_leader(group, leader: bool, step, what: str, call: str) -> None:
    """Run ``step()`` on the group's rank 0 only (directory renames); an exception there is raised
    on every rank, so none waits alone in the next collective (``call``: the exchange's name in the
    group's ledger)."""
    error = None
    if leader:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    raise_on_every_rank(group, error, what, call)


class _LoadPlan:
    """What a rank found out about a checkpoint before reading any tensor of it."""

    def __init__(self, directory: str, reader: SafeFileSystemReader, metadata: dict):
        self.directory, self.reader, self.metadata = directory, reader, metadata
        self.state_dict: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self.missing: list = []          # optimizer state keys the live optimizer needs and the checkpoint lacks


def _plan_load(path: str, model, optimizer) -> _LoadPlan:
    directory = checkpoint_commit.newest_complete(path)
    reader = SafeFileSystemReader(directory, require_checksums=True)
    plan = _LoadPlan(directory, reader, reader.read_metadata().state_dict_metadata)
    model_md = {k[6:]: v for k, v in plan.metadata.items() if k.startswith("model.")}
    if not model_md:
        raise ValueError(f"checkpoint {directory!r} has no 'model.*' keys, so save_checkpoint did not write it; "
                         f"load a dcp.save(model.state_dict()) checkpoint with dcp.load and model.load_state_dict.")
    shapes, aliases = _model_shapes(model)
    got = {k: tuple(md.size) if isinstance(md, TensorStorageMetadata) else "non-tensor bytes"
           for k, md in model_md.items()}
    _raise_if_mismatched(f"checkpoint {directory!r}", shapes, got, aliases)
    plan.state_dict.update((f"model.{k}", v) for k, v in model_state_dict(model).items() if k in model_md)
    if optimizer is not None:
        optim_md = {k: v for k, v in plan.metadata.items() if k.startswith("optimizer.")}
        if not optim_md:
            raise ValueError(f"checkpoint {directory!r} has no optimizer state (no 'optimizer.*' keys); "
                             f"pass optimizer=None to load the model only.")
        bytes_keys = [k for k, md in optim_md.items() if not isinstance(md, TensorStorageMetadata)]
        if bytes_keys:
            raise UnsafeCheckpointError(f"checkpoint optimizer entries {bytes_keys[:20]} are pickled bytes, not "
                                        f"tensors; they are not unpickled.")
        targets, loaded = _optimizer_targets(model, optimizer, optim_md, "optimizer.")
        plan.state_dict.update(targets)
        torch_optimizer = _torch_optimizer(optimizer)
        plan.missing = _missing_state(torch_optimizer, _optimizer_params(model, torch_optimizer), loaded)
    return plan


def _read_failure(what: str, exc: CheckpointException) -> Exception:
    """DCP's ``CheckpointException`` (the same on every rank) -> our error, with each failing rank's message."""
    errors = {rank: failure[0] if isinstance(failure, tuple) else failure
              for rank, failure in sorted(exc.failures.items())}
    kinds = {type(e) for e in errors.values()}
    cls = next((k for k in (UnsafeCheckpointError, CheckpointCorruptError) if k in kinds), RuntimeError)
    return cls(f"{what} failed on group rank(s) {sorted(errors)}: " + "; ".join(str(e) for e in errors.values()))


def _saved_class(plan: _LoadPlan, group) -> str:
    """The checkpoint's optimizer class name (a 64-byte read by every rank)."""
    key = f"optimizer.{CLASS_KEY}"
    if key not in plan.metadata:
        return "an optimizer it does not name"
    target = torch.zeros(_CLASS_BYTES, dtype=torch.uint8)
    dcp.load({key: target}, storage_reader=plan.reader, planner=TensorsOnlyLoadPlanner(), process_group=group)
    return _decode_class(target)


def load_checkpoint(path: "str | os.PathLike", model, optimizer=None) -> None:
    """Load what ``save_checkpoint`` wrote, at any dp size and strategy: the newest complete
    checkpoint at ``path`` (after a crashed save, possibly ``path.tmp`` or ``path.old``; see
    commit.py). Before any tensor is read, every rank checks the checkpoint's keys and
    shapes against the model (ValueError naming missing, unexpected and mis-shaped keys), its
    optimizer state keys against the optimizer (naming both classes), and the size and sha256 of
    every file it reads (``CheckpointCorruptError`` naming the file and the rank that found it).
    Nothing is unpickled outside torch's weights-only allow-list. Any failure raises on every rank."""
    model = _sharded_module(model)
    if model._fsdp_engine.experts is not None:
        raise expert_names_refusal("load_checkpoint")
    path = os.fspath(path)
    what = f"load_checkpoint({path!r})"
    wait_for_pending_save(what)
    group = _checkpoint_group(model)
    plan, error = None, None
    try:
        plan = _plan_load(path, model, optimizer)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    reports = gather_reports(group, error, None if plan is None else (plan.directory, plan.missing[:20],
                                                                      len(plan.missing)),
                             call="load_checkpoint: checking the checkpoint against the model")
    raise_reported(reports, error, what)
    directories = [extra[0] for _, extra in reports]
    if len(set(directories)) > 1:
        raise RuntimeError(f"{what}: the ranks see different newest checkpoints (by group rank: {directories}); is "
                           f"another job saving there?")
    shown, total = next(((extra[1], extra[2]) for _, extra in reports if extra[2]), ([], 0))
    try:
        if total:
            raise _optimizer_mismatch(what, _saved_class(plan, group), _torch_optimizer(optimizer), shown, total)
        dcp.load(plan.state_dict, storage_reader=plan.reader, planner=TensorsOnlyLoadPlanner(), process_group=group)
    except CheckpointException as exc:              # a BaseException, raised on every rank
        raise _read_failure(f"{what}: reading {plan.directory!r}", exc) from exc
    sd = plan.state_dict
    model.load_state_dict(OrderedDict((k[6:], v) for k, v in sd.items() if k.startswith("model.")), strict=False)
    if optimizer is not None:
        load_optimizer_state_dict(model, optimizer,
                                  OrderedDict((k[10:], v) for k, v in sd.items() if k.startswith("optimizer.")))


def export_full_state_dict(model, path: "str | os.PathLike", rank: int = 0) -> None:
    """Write ``{name: full tensor}`` (main-weight precision, all tied names, persistent buffers) to
    one ``torch.save`` file from ``rank``, for export or inference; ``torch.load(weights_only=True)``
    reads it. Gathers one group at a time; other ranks drop each gathered group at once."""
    model = _sharded_module(model)
    comm = model._fsdp_engine.comm
    if not isinstance(rank, int) or not 0 <= rank < comm.size:
        raise ValueError(f"rank must be a data-parallel rank in [0, {comm.size}), got {rank!r}.")
    replicas = model._fsdp_engine.replicas
    writer = comm.rank == rank and (replicas is None or replicas.rank == 0)   # hybrid: replica 0 writes
    full: dict = {}
    for group in model._fsdp_engine.groups:
        full_main = group.exporter.gather_full_main()
        if writer:
            for index, names in enumerate(group.all_names):
                value = group.exporter.full_param(full_main, index).clone()
                full.update((name, value) for name in names)
        del full_main
    if writer:
        full.update((name, buffer.detach().clone()) for name, buffer in model._fsdp_buffers())
        order = model._fsdp_name_order
        tmp = os.fspath(path) + ".tmp"
        torch.save(OrderedDict(sorted(full.items(), key=lambda kv: order.get(kv[0], 1 << 30))), tmp)
        os.replace(tmp, path)
    group = _checkpoint_group(model)
    before_collective(group, "barrier", "export_full_state_dict: written")
    dist.barrier(group=group)
