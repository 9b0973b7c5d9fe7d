"""Page-locked host buffers at their exact size.

[Note: pinned buffers at their exact size]
Offloaded state is most of a host's memory (16 bytes per offloaded parameter), so the host, not
the GPU, bounds the largest model that trains with offload (docs/benchmarks_history.md, "CPU offload by
fraction"). ``torch.empty(..., pin_memory=True)`` takes page-locked memory from torch's caching
host allocator, which rounds every block up to a power of two so that freed blocks can be reused
(``CachingHostAllocator.h``): a 4096-wide layer's 805 MB main shard takes 1 GiB, and measured on
one H200 box the rounding cost ~4 of the 16 bytes per offloaded parameter. Our buffers live as
long as their group and are never returned for reuse, so the rounding buys nothing: large ones
are allocated at their size in ordinary host memory and page-locked in place with
``cudaHostRegister`` (as torch's own checkpoint stager does,
``torch/distributed/checkpoint/_state_dict_stager.py``), and unregistered when the tensor that
owns them dies, before the memory is freed. Small ones, and accelerators other than CUDA, keep
torch's allocator.
"""

from __future__ import annotations

import weakref

import torch

#: Below this many bytes a buffer comes from torch's caching host allocator: its rounding costs
#: at most this much and small blocks are reused.
EXACT_PIN_MIN_BYTES = 1 << 20


_OFFLOAD_FALLBACK = ("for offload failed: {why}; OffloadPolicy(pin_memory=False) offloads to pageable memory "
                     "instead (copies then wait for the host)")


def pinned_empty(numel: int, dtype: torch.dtype, device: torch.device, failure: str = _OFFLOAD_FALLBACK) -> torch.Tensor:
    """An uninitialised page-locked host tensor of ``numel`` elements for copies with ``device``.
    ``failure``: what a failed page-locking says after "page-locking N bytes of host memory ",
    with ``{why}`` for CUDA's error."""
    nbytes = numel * dtype.itemsize
    if device.type != "cuda" or torch.version.cuda is None or nbytes < EXACT_PIN_MIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    out = torch.empty(numel, dtype=dtype)
    _register(out.data_ptr(), nbytes, failure)
    # The finalizer runs when the owning tensor dies, before its storage is freed (views keep the
    # tensor alive); never at interpreter exit, after CUDA may be gone.
    weakref.finalize(out, _unregister, out.data_ptr()).atexit = False
    return out


def _register(ptr: int, nbytes: int, failure: str) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))   # cudaHostRegisterDefault
    if error != 0:
        raise RuntimeError(f"page-locking {nbytes} bytes of host memory "
                           + failure.format(why=f"cudaHostRegister returned cudaError {error}"))


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:        # noqa: BLE001 -- torch half torn down at interpreter exit: the process ends
        pass
