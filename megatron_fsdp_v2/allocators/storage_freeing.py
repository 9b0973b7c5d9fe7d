"""Temporary buffers whose tensor object lives forever and whose storage comes and goes.

Why keep the tensor object: ZeRO-3 hands its unsharded weights to the module as views of a flat
buffer, and autograd saves references to them for backward. If each re-allocation returned a new
tensor, every view and every saved reference would have to be rebuilt. Freeing only the storage
(``untyped_storage().resize_(0)``) and growing it back (``resize_(nbytes)``) keeps one tensor
object per key, so views taken once stay valid, while the bytes go back to the caching allocator
between uses. This is the flexible allocator: any schedule works, but addresses may change
between allocations (a view's ``data_ptr`` always follows its base, since they share storage).

Streams: the storage is released at ``free`` on the caller's stream. A caller that used the
buffer on another stream must make the current stream wait for that work before freeing.
"""

from __future__ import annotations

import torch

from megatron_fsdp_v2.allocators.base import Allocator, BufferKey


class StorageFreeingBucketAllocator(Allocator):
    """One cached 1-D tensor per key; ``free`` drops its storage, ``allocate`` regrows it.

    It holds no buckets: the name is the one the design (and Megatron-FSDP's allocator of the
    same role) uses for "the flexible allocator", kept so the two can be compared by name; each
    key is one group's temporary buffer."""

    def __init__(self) -> None:
        super().__init__()
        self._tensors: dict[BufferKey, torch.Tensor] = {}

    def cached_tensor(self, key: BufferKey) -> torch.Tensor | None:
        """The tensor object kept for ``key`` (its storage is empty while the key is not live)."""
        return self._tensors.get(key)

    def _allocate(self, key: BufferKey, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = self._tensors.get(key)
        if tensor is None or tensor.numel() != numel or tensor.dtype != dtype or tensor.device != normalize_device(device):
            # A new shape for the key: old views describe the old shape, so a new object is honest.
            tensor = torch.empty(numel, dtype=dtype, device=device)
            self._tensors[key] = tensor
            return tensor
        storage = tensor.untyped_storage()
        nbytes = numel * dtype.itemsize
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return tensor

    def _free(self, key: BufferKey) -> None:
        self._tensors[key].untyped_storage().resize_(0)

    def release(self) -> None:
        """Forget every cached tensor (their storages are already empty: no key may be live)."""
        if self.live_keys():
            raise RuntimeError(f"StorageFreeingBucketAllocator.release: keys {self.live_keys()!r} are still allocated; free them first.")
        self._tensors.clear()


def normalize_device(device: torch.device | str) -> torch.device:
    """The device a tensor made on ``device`` reports: ``cuda`` means ``cuda:<current>``.

    Without this, ``cuda`` and ``cuda:0`` would name two devices and a key re-allocated with
    the other spelling would get a new tensor (here) or a second pool (``TracePoolAllocator``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
