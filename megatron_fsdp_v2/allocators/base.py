"""The allocator interface every temporary buffer of the engine goes through.

Why an interface: temporary buffers (ZeRO-3's unsharded weights, ZeRO-2/3's full-size grads
waiting for their reduce-scatter) dominate peak memory. Routing every one of them through a
single object makes their lifetimes visible (``live_bytes`` / ``peak_live_bytes``), testable,
and replaceable (storage freeing for flexibility, a trace-planned pool for fixed addresses).

Keys name a buffer by (owner, role), e.g. ``("unit3/float32/grad", "full_grad")``. A key is
either live (allocated, not yet freed) or not; allocating a live key or freeing a dead one is a
schedule bug and raises.
"""

from __future__ import annotations

import abc
from typing import Hashable

import torch

BufferKey = Hashable


class Allocator(abc.ABC):
    """Hands out temporary flat buffers by key and tracks how many bytes are live."""

    def __init__(self) -> None:
        self._live_nbytes: dict[BufferKey, int] = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0

    # -- public interface -------------------------------------------------------------------
    def allocate(self, key: BufferKey, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return a 1-D tensor of ``numel`` elements for ``key``; its contents are undefined."""
        if key in self._live_nbytes:
            raise RuntimeError(f"allocator: key {key!r} is already allocated; free it before allocating again.")
        if numel < 0:
            raise ValueError(f"allocator: numel must be >= 0, got {numel} for key {key!r}.")
        tensor = self._allocate(key, int(numel), dtype, torch.device(device))
        nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
        self._live_nbytes[key] = nbytes
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return tensor

    def free(self, key: BufferKey) -> None:
        """Give the memory of ``key`` back; tensors returned for it must not be read afterwards."""
        if key not in self._live_nbytes:
            raise RuntimeError(f"allocator: key {key!r} is not allocated; cannot free it.")
        self._free(key)
        self.live_bytes -= self._live_nbytes.pop(key)

    def is_live(self, key: BufferKey) -> bool:
        return key in self._live_nbytes

    def live_keys(self) -> list[BufferKey]:
        return list(self._live_nbytes)

    def reset_peak(self) -> None:
        self.peak_live_bytes = self.live_bytes

    def step(self) -> None:
        """Called by the engine at the end of every backward that reduced gradients (each
        micro-batch for ZeRO-2/3, the last one for DDP / ZeRO-1) and after ``reset_iteration``.

        Allocators that learn from a trace (``TracePoolAllocator``) use it as the iteration
        boundary; the default does nothing."""

    def release(self) -> None:
        """Give back every cached byte. Live keys must have been freed first."""

    # -- implementation hooks ---------------------------------------------------------------
    @abc.abstractmethod
    def _allocate(self, key: BufferKey, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    @abc.abstractmethod
    def _free(self, key: BufferKey) -> None: ...
