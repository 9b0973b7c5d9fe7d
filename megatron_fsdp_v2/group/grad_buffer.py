"""A group's reduced-gradient buffer, alive as long as something uses it.

[Note: gradient buffers live as long as .grad]
FSDP2 frees a parameter's gradient when ``optimizer.zero_grad(set_to_none=True)`` drops it, so the
activation peak of the next forward finds no gradient memory. Here a group keeps only a weak
reference to its gradient buffer after attaching the ``.grad`` views (``hand_to_views``): when the
optimizer drops every view the buffer is freed, and the next backward allocates a zeroed one as
late as possible (ZeRO-2/3: when the group's first reduce-scatter lands; DDP/ZeRO-1: at its first
gradient). A ``.grad`` the user keeps, ``set_to_none=False`` or a further backward before
``step()`` keeps the buffer alive and everything accumulates as before. With ``persistent``
(Megatron's ``main_grad``) the buffer is always held.

[Note: gradient buffers from their own pool]
Freed at ``zero_grad`` and allocated again in the next backward, a gradient buffer must not take
the holes the backward's transients leave. With the default CUDA allocator settings a freed 2 GiB
attention-score block is the best fit for the next 768 MiB gradient buffer: it is split, the next
layer's 2 GiB request finds no block and the device fills with 512 MiB remainders (measured on
one H200, issue-16 GPT at 38 layers: 12.5 GiB reserved but free at the out-of-memory point,
docs/benchmarks_history.md, "Largest model that trains"). FSDP2 does not see this because its gradients are
reduce-scatter outputs allocated on its reduce-scatter stream, and the caching allocator keeps
one pool of blocks per stream. So on an accelerator the buffers are allocated while a stream of
their own is current (``gradient_pool_stream``): their blocks form a pool that only gradient
buffers reuse, of exactly their sizes. The buffer is used on the stream current at ``ensure``
(its zeroing runs there), and ``record_stream`` on that stream keeps a freed block from being
handed out before that stream's queued work on it is done. The price: the two pools cannot lend
each other blocks, so free blocks of one stay reserved while the other grows (issue 47's Llama,
bf16, one H100: 55.57 GiB reserved with the pool, 48.12 without it, at the same allocated peak;
FSDP2 55.99; docs/benchmarks_history.md, "HF Llama, float8 and compile"). Before it reports out of memory the
allocator gives back every cached segment with no block in use, so near the memory limit, where
the pool helps, this reserve mostly goes back.

[Note: one segment for the gradient pool]
A gradient buffer a little under a multiple of the allocator's 2 MiB segment rounding would get a
segment of its own whose remainder, under the 1 MiB split threshold, stays in its block and counts
as allocated (main_segment.py says the same of the main shards; FSDP2 holds 3.06 MB besides its
weights and gradients on its memory-test model at world 1, what its per-group reduce-scatter
outputs would leave this way; not traced). So once a model is wrapped, one block as
large as all its device gradient buffers together (plus the split threshold) is allocated in the
gradient pool and freed at once (``reserve_gradient_segment``): the segment stays cached, and every
gradient buffer is then split from it at its exact size, in every step. It costs, at the wrap,
that many bytes for a moment (below the first step's), and from the wrap on, that many bytes
reserved in the pool, which the first backward would have reserved anyway. ``empty_cache`` (or
the allocator freeing cached memory under pressure before the first gradient) gives the segment
back; the buffers then take segments of their own again.

Only for gradients of at most 1/64 of the device's memory: once a backward's first buffer is split
from the segment, the part the later groups will take stays reserved until they do, where buffers
of their own would leave it to the activations until then. Near the memory limit (the largest
model that trains) that could cost more than the at most 1 MiB per buffer it saves, which is what
matters for small groups; at 1/64 the most it can cost is 2.2 GB of an H200's 141.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch

__all__ = ["GradBuffer", "gradient_pool_stream", "reserve_gradient_segment"]

_POOL_STREAMS: Dict[torch.device, object] = {}


def gradient_pool_stream(device: torch.device):
    """The stream whose allocator pool holds ``device``'s gradient buffers (None on CPU, or on a
    device module without streams) ([Note: gradient buffers from their own pool])."""
    if device.type in ("cpu", "meta"):
        return None
    try:
        module = torch.get_device_module(device)
    except RuntimeError:
        return None
    if not hasattr(module, "Stream") or not hasattr(module, "stream"):
        return None
    key = torch.device(device.type, device.index if device.index is not None else module.current_device())
    if key not in _POOL_STREAMS:
        _POOL_STREAMS[key] = module.Stream(device=key)
    return _POOL_STREAMS[key]


def new_from_pool(numel: int, dtype: torch.dtype, device: torch.device, zeroed: bool = True) -> torch.Tensor:
    """A new flat buffer, zeroed (``zeroed=False``: uninitialized, for a caller that overwrites all
    of it); on an accelerator its block comes from the gradient pool."""
    pool = gradient_pool_stream(device)
    if pool is None:
        buffer = torch.empty(numel, dtype=dtype, device=device)
    else:
        module = torch.get_device_module(device)
        with module.stream(pool):
            buffer = torch.empty(numel, dtype=dtype, device=device)
        buffer.record_stream(module.current_stream(device))
    return buffer.zero_() if zeroed else buffer


_BLOCK_ALIGN = 512            # the caching allocator rounds every block up to this
_SPLIT_THRESHOLD = 1 << 20    # a larger block's remainder above this is split off as free
_MAX_SHARE = 64               # reserve a segment for gradients of at most 1/64 of the device's memory


def _device_bytes(module, device: torch.device) -> int:
    """The device's total memory (0 where the device module does not say: nothing is reserved)."""
    try:
        return int(module.get_device_properties(device).total_memory)
    except (AttributeError, RuntimeError, AssertionError):
        return 0


def reserve_gradient_segment(buffers: list, device: torch.device, replace: bool = False) -> None:
    """Leave one cached segment in ``device``'s gradient pool that ``buffers`` (GradBuffers not
    yet allocated) fit in together ([Note: one segment for the gradient pool]). ``replace``: give
    the device's unused cached memory back first (after ``set_offload`` moved gradients to the
    host, the segment reserved at the wrap is too large). No-op on CPU."""
    pool = gradient_pool_stream(device)
    if pool is None:
        return
    module = torch.get_device_module(device)
    if replace and hasattr(module, "empty_cache"):
        module.empty_cache()
    nbytes = sum(-(-b.numel * b.dtype.itemsize // _BLOCK_ALIGN) * _BLOCK_ALIGN for b in buffers)
    if not nbytes or nbytes > _device_bytes(module, device) // _MAX_SHARE:
        return
    with module.stream(pool):
        block = torch.empty(nbytes + _SPLIT_THRESHOLD + _BLOCK_ALIGN, dtype=torch.uint8, device=device)
    del block


class GradBuffer:
    """One flat gradient buffer of ``numel`` elements, held strongly or (handed to views) weakly."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.persistent = True
        self._held: Optional[torch.Tensor] = None
        self._weak: Optional[weakref.ref] = None

    def live(self) -> Optional[torch.Tensor]:
        """The buffer if anything still holds it, else None."""
        if self._held is not None:
            return self._held
        return self._weak() if self._weak is not None else None

    def ensure(self, zeroed: bool = True) -> tuple[torch.Tensor, bool]:
        """``(buffer, fresh)``: the buffer, held strongly again; a new zeroed one (``fresh``) if it
        was freed (``zeroed=False``: a new one uninitialized, for a caller that overwrites it all)."""
        buffer = self.live()
        fresh = buffer is None
        if fresh:
            buffer = new_from_pool(self.numel, self.dtype, self.device, zeroed)
        self._held, self._weak = buffer, None
        return buffer, fresh

    def hand_to_views(self) -> None:
        """Unless ``persistent``: from now on only the views taken of the buffer hold it."""
        if self.persistent or self._held is None:
            return
        self._weak, self._held = weakref.ref(self._held), None

    def let_go(self) -> None:
        """Forget the buffer (unless ``persistent``) without touching it: views others keep stay
        as they are, and the next ``ensure`` starts a new one."""
        if not self.persistent:
            self._held = self._weak = None
