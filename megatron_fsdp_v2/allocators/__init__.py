"""Allocators for the engine's temporary buffers, and the factory that picks one by name.

``storage_freeing`` keeps one tensor object per key and frees only its storage: any schedule
works and views stay valid. ``trace_pool`` records one iteration and replays it from a planned
pool at fixed addresses. See each module's docstring for why.
"""

from __future__ import annotations

from megatron_fsdp_v2.allocators.base import Allocator, BufferKey
from megatron_fsdp_v2.allocators.pool_plan import PoolPlan, plan_pool
from megatron_fsdp_v2.allocators.storage_freeing import StorageFreeingBucketAllocator
from megatron_fsdp_v2.allocators.trace_pool import TracePoolAllocator

ALLOCATORS: dict[str, type[Allocator]] = {
    "storage_freeing": StorageFreeingBucketAllocator,
    "trace_pool": TracePoolAllocator,
}


def make_allocator(name: str | Allocator) -> Allocator:
    """A new allocator for ``name``; an ``Allocator`` instance is returned unchanged."""
    if isinstance(name, Allocator):
        return name
    if not isinstance(name, str) or name not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {list(ALLOCATORS)}, got {name!r}.")
    return ALLOCATORS[name]()


__all__ = [
    "ALLOCATORS",
    "Allocator",
    "BufferKey",
    "PoolPlan",
    "StorageFreeingBucketAllocator",
    "TracePoolAllocator",
    "make_allocator",
    "plan_pool",
]
