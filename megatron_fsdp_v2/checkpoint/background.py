"""Where an asynchronous save runs: one writer thread per process, one save at a time, with
collectives on a gloo group of its own. save_load.py's ``async_save_checkpoint`` hands it the
staged state (staging.py).

[Note: collectives of a background save]
A save is collective: DCP gathers the ranks' plans and write results, and the commit agrees that
rank 0's renames succeeded (save_load.py, commit.py). Issued from a background thread on the
training's process group, those collectives would interleave with the training's own (a gradient
reduce-scatter on rank 0 meeting DCP's all-gather on rank 1): gloo aborts or reads garbage, NCCL
hangs. So the background thread uses a gloo group of its own over the same ranks, created once per
training group, and nothing else uses it:

* created on the calling (main) thread, at the first asynchronous save of that group, by every
  rank of the world in the same order (``new_group`` is collective over the world; with several
  data-parallel groups, e.g. tensor parallelism, every rank creates every group, in an order all
  ranks agree on through one ``all_gather_object`` of the groups' ranks);
* used only by the writer thread, which runs one save at a time, so every rank issues the same
  collectives on it in the same order;
* gloo, so its collectives run on the CPU and need no CUDA stream: the staged state is in host
  memory.

A second save (asynchronous or not) or a load first waits for the save in flight
(``wait_for_pending_save``), so two saves never interleave and the staging buffers are not
overwritten while they are written. A failure of the background save is raised by its future,
and, if nobody read it there, by the next save or load, so it is never lost.

The writer thread registers with comm/thread_shutdown.py ([Note: threads at exit]): at
``torch.distributed.destroy_process_group`` and at interpreter exit, the save in flight is
finished first, so a script that ends without waiting for its last save still writes it. Where
the group is destroyed without that wrapper (a ``destroy_process_group`` name bound before it was
installed), the save fails at its next collective and its future raises a ``RuntimeError`` that
says so; the directory keeps the newest complete checkpoint (commit.py). A writer that was inside
one of the group's collectives at that moment waits there until the group's timeout.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Optional

import torch.distributed as dist

from ..comm.thread_shutdown import shut_down_at_exit

__all__ = ["SaveFuture", "background_group", "group_destroyed", "submit", "wait_for_pending_save"]

logger = logging.getLogger(__name__)


class SaveFuture(Future):
    """The ``concurrent.futures.Future`` of an asynchronous save (result ``None``; ``result()``
    raises the save's error). A failure that neither ``result()`` nor ``exception()`` read is
    raised by the next save or load."""

    what: str
    read: bool

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what, self.read = what, False

    def result(self, timeout: Optional[float] = None):
        try:
            return super().result(timeout)
        finally:
            self.read = self.read or self.done()

    def exception(self, timeout: Optional[float] = None):
        try:
            return super().exception(timeout)
        finally:
            self.read = self.read or self.done()


class _Writer:
    """The process's writer thread, its save in flight, and the background groups."""

    executor: Optional[ThreadPoolExecutor]
    pending: Optional[SaveFuture]
    groups: dict                       # training group -> its background gloo group
    lock: threading.Lock

    def __init__(self) -> None:
        self.executor, self.pending, self.groups, self.lock = None, None, {}, threading.Lock()

    def shut_down(self) -> None:
        """Finish the save in flight and end the thread (destroy_process_group, interpreter exit:
        comm/thread_shutdown.py); the next save starts a new one. Its error stays with its future."""
        with self.lock:
            executor, self.executor = self.executor, None
        if executor is not None:
            if self.pending is not None:
                wait([self.pending])
            executor.shutdown(wait=True)


_WRITER = _Writer()


def group_destroyed(group) -> bool:
    """Whether ``group`` (or the whole process group) was destroyed: it is no longer registered."""
    return not dist.is_initialized() or group not in dist.distributed_c10d._world.pg_map


def _new_groups(group):
    """The gloo group over ``group``'s ranks (see the note): every rank of the world creates the
    groups of every rank, in one agreed order."""
    ranks = dist.get_process_group_ranks(group)
    world = dist.get_world_size()
    if len(ranks) == world:
        return dist.new_group(backend="gloo")
    everyone: list = [None] * world
    dist.all_gather_object(everyone, tuple(ranks))
    mine = None
    for members in sorted(set(everyone)):
        created = dist.new_group(list(members), backend="gloo")
        if tuple(ranks) == members:
            mine = created
    return mine


def background_group(group):
    """The background save's gloo group for the training group ``group`` (created at first use,
    on the calling thread, by every rank of the world; again after a ``destroy_process_group``)."""
    key = group if group is not None else dist.group.WORLD
    cached = _WRITER.groups.get(key)
    if cached is None or group_destroyed(cached):
        _WRITER.groups = {k: g for k, g in _WRITER.groups.items() if not group_destroyed(g)}
        cached = _WRITER.groups[key] = _new_groups(key)
    return cached


def wait_for_pending_save(caller: str) -> None:
    """Wait for the save in flight, if any; raise its failure if nobody read it (naming ``caller``)."""
    pending = _WRITER.pending
    if pending is None:
        return
    wait([pending])
    _WRITER.pending = None
    error = None if pending.read else Future.exception(pending)
    if error is not None:
        raise RuntimeError(f"{caller}: the asynchronous {pending.what} before it failed and nobody read its "
                           f"error: {error}") from error


def _run(future: SaveFuture, work: Callable[[], None]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        work()
    except BaseException as exc:  # noqa: BLE001 - handed to the future (DCP's CheckpointException is a BaseException)
        logger.error("megatron_fsdp_v2: %s failed: %s", future.what, exc)
        future.set_exception(exc)
    else:
        future.set_result(None)


def submit(what: str, work: Callable[[], None]) -> SaveFuture:
    """Run ``work`` on the writer thread; the future completes when it has. The caller waited for
    the save before (``wait_for_pending_save``)."""
    with _WRITER.lock:
        if _WRITER.executor is None:
            _WRITER.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron_fsdp_v2-checkpoint")
            shut_down_at_exit(_WRITER)          # [Note: threads at exit]
        future = SaveFuture(what)
        _WRITER.pending = future
        _WRITER.executor.submit(_run, future, work)
    return future
