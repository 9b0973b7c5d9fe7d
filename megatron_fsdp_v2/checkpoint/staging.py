"""A copy of a checkpoint's state in host memory, so that an asynchronous save writes the state as
it was when the save was called while training goes on: ``HostStager``, DCP's ``AsyncStager``.

[Note: staging a checkpoint in reused host buffers]
Training changes the weights and the optimizer state in place, so a save that writes in the
background must not read them: the state dict is first copied ("staged") into host buffers, and
the write reads only those. ``stage`` returns a state dict of the same keys and the same kinds of
value, over host copies, so DCP declares exactly the chunks the live values do:

    plain tensor (replicated)      -> a host tensor with its values
    FlatRangeShard                 -> the same flat range over a host copy of ``local_flat``
    DTensor / RowShardedTensor     -> the same spec (and row splits) over a host copy of the local piece
    dict, list, tuple              -> the same container of staged values
    anything else (numbers, ...)   -> a deep copy

Memory, per rank:

* host: one buffer per tensor, exactly the size of this rank's piece of it (the rank's shard of
  the checkpoint, plus the small replicated values), allocated at the first ``stage`` and reused by
  every later one while the state dict's tensors keep their shapes, dtypes and devices (a changed
  state dict, e.g. optimizer state that appeared after the first step, allocates anew and frees
  the old buffers). Buffers that receive copies from a GPU are page-locked at their exact size
  (offload/host_memory.py, [Note: pinned buffers at their exact size]: torch's caching host
  allocator would round a 235 MB tensor up to 256 MiB). They stay until ``close()`` or until the
  stager is garbage collected (``async_save_checkpoint`` keeps one per model).
* GPU: none. Each copy goes from the live tensor straight into its host buffer (a non-blocking
  copy into page-locked memory, on the current stream, so it follows the optimizer step that
  wrote the value); ``stage`` then waits for the copies and returns. (A non-contiguous GPU tensor
  would need a contiguous temporary; the values of ``model_state_dict`` are contiguous.)

Each buffer is its own allocation, so DCP's writer takes it as it is (it clones a tensor whose
storage is larger than the tensor: a view into one big buffer would be copied once more).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ..offload.host_memory import pinned_empty
from ..row_sharded import over_local
from .dcp_format import FlatRangeShard

__all__ = ["HostStager"]

_PIN_FAILURE = ("to stage a checkpoint failed: {why}; save_checkpoint (synchronous) needs no staging buffers")


def _pieces(value, out: list) -> None:
    """Append, in traversal order, the tensor each staged value copies (a shard's local piece)."""
    if isinstance(value, dict):
        for item in value.values():
            _pieces(item, out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _pieces(item, out)
    elif isinstance(value, FlatRangeShard):
        out.append(value.local_flat)
    elif isinstance(value, DTensor):
        out.append(value._local_tensor)
    elif isinstance(value, torch.Tensor):
        out.append(value.detach())


def _rebuild(value, buffers):
    """``value`` with each tensor replaced by the next of ``buffers`` (see the note)."""
    if isinstance(value, dict):
        return type(value)((key, _rebuild(item, buffers)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(item, buffers) for item in value)
    if isinstance(value, FlatRangeShard):
        return FlatRangeShard(value.shape, next(buffers), value.flat_start)
    if isinstance(value, DTensor):
        return over_local(value, next(buffers))
    if isinstance(value, torch.Tensor):
        return next(buffers)
    return copy.deepcopy(value)


def _host_buffer(piece: torch.Tensor) -> torch.Tensor:
    if piece.device.type == "cuda":
        return pinned_empty(piece.numel(), piece.dtype, piece.device, _PIN_FAILURE).view(piece.shape)
    return torch.empty(piece.shape, dtype=piece.dtype)


class HostStager(AsyncStager):
    """Stages a state dict into host buffers allocated once and reused across saves (see the
    note at the top). Also DCP's ``AsyncStager``:
    ``dcp.async_save(sd, storage_writer=ChecksummedFileSystemWriter(path), async_stager=HostStager(), ...)``.
    ``stage`` is synchronous: it returns once every copy is done."""

    _synchronize_after_execute = False
    _buffers: list
    _signature: Optional[tuple]

    def __init__(self) -> None:
        self._buffers, self._signature = [], None

    @property
    def host_bytes(self) -> int:
        """The host memory the buffers hold now."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers)

    def stage(self, state_dict):
        pieces: list = []
        _pieces(state_dict, pieces)
        signature = tuple((tuple(p.shape), p.dtype, p.device.type) for p in pieces)
        if signature != self._signature:
            self._buffers, self._signature = [], None          # the old buffers go before the new ones come
            self._buffers, self._signature = [_host_buffer(p) for p in pieces], signature
        devices = set()
        with torch.no_grad():
            for piece, buffer in zip(pieces, self._buffers):
                on_device = piece.device.type != "cpu"
                buffer.copy_(piece, non_blocking=on_device)     # page-locked when on_device (_host_buffer)
                if on_device:
                    devices.add(piece.device)
        for device in devices:       # the copies were queued on each device's current stream
            torch.get_device_module(device).current_stream(device).synchronize()
        return _rebuild(state_dict, iter(self._buffers))

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns with every copy done."""

    def close(self) -> None:
        """Free the buffers (the next ``stage`` allocates new ones)."""
        self._buffers, self._signature = [], None
