"""Our ``fsdp_dtensor`` checkpoints through Megatron-LM's asynchronous save queue (``--async-save
--use-persistent-ckpt-worker``), for the launcher's ``--save``.

[Note: our checkpoints in Megatron's async queue]
Megatron-LM saves asynchronously by handing an ``AsyncRequest`` to its queue
(megatron/training/async_utils.py; megatron.core.dist_checkpointing.strategies.async_utils): the
save is planned on the training ranks (DCP's planning collectives, on the default group, before
the call returns); the request goes to a persistent worker process per rank, whose
``preload_fn`` copies the tensors to the host (through CUDA IPC) while the trainer waits, and
which then writes the files; the trainer's next ``maybe_finalize_async_save`` after every rank's
worker is done runs the request's finalize steps (the write results gathered, ``.metadata``
written, the tracker file last), so a crash before that leaves the previous tracked checkpoint.

``--ckpt-format torch_dist``: Megatron-LM's own path takes our wrapper as it is (its
``sharded_state_dict``), nothing here. ``fsdp_dtensor``: Megatron-LM's path needs Megatron-FSDP's
model (``preprocess_fsdp_dtensor_state_dict``), and with megatron-core 0.19.2's own strategy
(``--async-strategy mcore``) it passes ``save_state_dict_async_plan`` an argument that version
does not take and finalizes with its whole return value. ``fsdp_dtensor_async_request`` builds the
same request for the state dict ``save_fsdp_dtensor_checkpoint`` writes (fsdp_dtensor_format.py),
with Megatron's own writer, planner call and queue, plus the checksum manifest of the
synchronous save computed off the training's path: each rank's worker hashes the files it wrote
(``.checksums.<rank>.json``), and a finalize step on rank 0, after Megatron wrote ``.metadata``,
merges them with ``.metadata``'s digest into ``.checksums.json`` (integrity.py) and removes them.

Host tensors: Megatron's writer clones a host tensor at planning only when it is a view of a larger
storage, and its ``preload_fn`` copies device tensors only (``tensor.to("cpu")`` returns a host
tensor itself). A host tensor that owns its storage (Adam's moments with ``--optimizer-cpu-offload``,
or any such tensor of a CPU run) reaches the persistent worker through a ``torch.multiprocessing``
queue, which moves its storage into shared memory in place: the trainer's next step then changes
the values the worker has yet to write, and the checkpoint holds a later step's state.
``copy_host_tensors_at_preload`` makes the preload, which the trainer waits for, copy them too
(host memory: one copy of the host-resident state, freed when the write ends).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ...checkpoint.integrity import METADATA_FILE, file_checksum, write_manifest
from .fsdp_dtensor_format import fsdp_dtensor_state_dict

__all__ = ["copy_host_tensors_at_preload", "fsdp_dtensor_async_request"]

logger = logging.getLogger(__name__)

_DIGESTS = ".checksums.{rank}.json"


def write_and_digest(write: Callable, directory: str, *args, **kwargs) -> None:
    """The worker's part: Megatron's writer (``write(rank, write_buckets, results_queue)``), then
    the checksums of the files it wrote, into ``directory/.checksums.<rank>.json``. Raises
    nothing: Megatron's worker loop does not catch (its writer reports failures through the
    results queue, which the finalize raises on every rank), and a digest that is missing leaves
    the checkpoint without a manifest (``merge_digests``)."""
    write(*args, **kwargs)
    try:
        rank, buckets = args[0], args[1]
        digests = {name: file_checksum(path) for path, name, _ in buckets}
        target = os.path.join(directory, _DIGESTS.format(rank=rank))
        with open(target + ".tmp", "w") as f:
            json.dump(digests, f)
        os.replace(target + ".tmp", target)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.warning("megatron_fsdp_v2: hashing the files of %r failed (%s: %s); it gets no checksum manifest.",
                       directory, type(exc).__name__, exc)


def merge_digests(directory: str) -> None:
    """Rank 0, after ``.metadata`` is written: the manifest from every rank's digests (none if a
    file lacks one: the checkpoint then loads with size checks only, safe_reader.py)."""
    if dist.get_rank() != 0:
        return
    parts = sorted(glob.glob(os.path.join(glob.escape(directory), _DIGESTS.format(rank="*"))))
    files: dict = {}
    for part in parts:
        with open(part) as f:
            files.update(json.load(f))
        os.remove(part)
    unlisted = sorted(set(n for n in os.listdir(directory) if n.endswith(".distcp")) - set(files))
    if unlisted:
        logger.warning("megatron_fsdp_v2: %r gets no checksum manifest: no digest of %s.", directory, unlisted[:5])
        return
    files[METADATA_FILE] = file_checksum(os.path.join(directory, METADATA_FILE))
    write_manifest(directory, files)


def copy_host_tensors_at_preload(request):
    """``request`` (Megatron's ``AsyncRequest``), its preload also copying the host tensors it would
    hand over as they are (see the note: the checkpoint then holds the values at save time).
    megatron-core's ``AsyncRequest`` only (``--async-strategy mcore``): nvidia-resiliency-ext's
    request is returned as it is."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    if not isinstance(request, AsyncRequest) or request.preload_fn is None:
        return request
    return request._replace(preload_fn=functools.partial(_staged_with_host_copies, request.preload_fn,
                                                         request.async_fn_args[1]))


def _staged_with_host_copies(preload: Callable, buckets: list) -> list:
    """Megatron's preload of the write ``buckets`` (path, name, (bytes, [(item, tensor)])), with a
    copy of each tensor it returned unchanged, i.e. still the trainer's own host memory."""
    passed_through = {id(tensor) for _, _, (_, tensors) in buckets for _, tensor in tensors}
    return [(path, name, (data, [(item, tensor.clone() if id(tensor) in passed_through else tensor)
                                 for item, tensor in tensors]))
            for path, name, (data, tensors) in preload()]


def fsdp_dtensor_async_request(path: "str | os.PathLike", wrapper, optimizer=None, iteration: Optional[int] = None,
                               args=None, extra: Optional[dict] = None, async_strategy: str = "mcore",
                               thread_count: int = 1):
    """Megatron's ``AsyncRequest`` writing what ``save_fsdp_dtensor_checkpoint(path, wrapper,
    optimizer, iteration, args, extra)`` writes (see the note); collective: planned here on every
    rank. Hand it to ``megatron.training.async_utils.schedule_async_save`` (add finalize steps
    first, e.g. the tracker file)."""
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    directory = os.fspath(path)
    state = fsdp_dtensor_state_dict(f"async --save to {directory!r}", wrapper, optimizer, iteration, args, extra)
    _, modules = get_async_strategy(async_strategy)
    writer = modules["FileSystemWriterAsync"](directory, thread_count=thread_count)
    planned = modules["save_state_dict_async_plan"](state, writer, None, 0, planner=DefaultSavePlanner())
    finalize_args = planned[0] if isinstance(planned[0], tuple) else planned    # mcore's return: (args, plans...)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    async_fn = None if save_fn is None else functools.partial(write_and_digest, save_fn, directory)
    finalize = [functools.partial(modules["save_state_dict_async_finalize"], *finalize_args),
                functools.partial(merge_digests, directory)]
    return copy_host_tensors_at_preload(modules["AsyncRequest"](async_fn, save_args, finalize, async_fn_kwargs={},
                                                                preload_fn=preload_fn))
