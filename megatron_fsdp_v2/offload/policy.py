"""What ``fully_shard(..., offload=...)`` is asked for: ``OffloadPolicy``, its checks, and the choice it
makes (``choose_offloaded``: which whole groups, by main-weight bytes, go to host memory;
``offload_choice_bytes``: what a group weighs in that choice). Pure data and arithmetic, shared by
``fully_shard`` and ``plan``; the copies that keep offloaded groups fed are host_link.py's ([Note:
offload by fraction] there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["OffloadPolicy", "choose_offloaded", "offload_choice_bytes"]


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep the main weights and optimizer state of a ``fraction`` of the parameter groups (by
    bytes, whole groups) in host memory; they step on the CPU, the rest on the device.

    Args:
        fraction: ``0 <= fraction <= 1``; 0 offloads nothing (the default path), 1 every group.
        pin_memory: page-locked host buffers (needed for asynchronous copies on a GPU; ignored
            on a CPU-only run, where there is nothing to pin for).
        overlap: copies on a side stream, overlapped with compute (default); ``False``: on the
            compute stream, synchronous (Megatron's ``overlap_cpu_optimizer_d2h_h2d=False``).
        step_in_backward: step each offloaded group on a host thread as soon as its gradients
            land in a backward outside ``no_sync()``, overlapped with the rest of backward
            (ZeRO-Offload's overlap); exact, under the conditions of backward_steps.py's
            [Note: offloaded steps during backward], which ``optimizer.step()`` checks.
        step_threads: with ``step_in_backward``, the intra-op threads of that host thread's CPU
            steps (``torch.set_num_threads`` there; torch keeps it as the default of threads
            started later too); None: torch's. Fewer than the cores was measured much slower on
            one H200 host (16 cores: 14 threads 1.46x, 12 threads 1.37x the step time of 16;
            docs/benchmarks_history.md), so leave it None unless a measurement says otherwise.
        release_after_gather: ZeRO-3: a non-root offloaded group's device compute-weight shard
            is freed once a gather read it and copied from the host again before the next
            (before its backward: prefetched when the unit after it in forward order begins its
            backward), as FSDP2's ``CPUOffloadPolicy`` keeps no weights on the device: a lower
            peak for one more host-to-device copy of those groups per step.
    """

    fraction: float = 1.0
    pin_memory: bool = True
    overlap: bool = True
    step_in_backward: bool = False
    step_threads: Optional[int] = None
    release_after_gather: bool = False

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 <= f <= 1:
            raise ValueError(f"offload: OffloadPolicy.fraction must be a number with 0 <= fraction <= 1, got {f!r}.")
        for name in ("pin_memory", "overlap", "step_in_backward", "release_after_gather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"offload: OffloadPolicy.{name} must be True or False, got {getattr(self, name)!r}.")
        n = self.step_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"offload: OffloadPolicy.step_threads must be None or a positive int, got {n!r}.")


def offload_choice_bytes(numel: int, main_dtype: torch.dtype) -> int:
    """What a group weighs in the choice: its parameters' elements (no padding, so the same at every
    dp size) in the main-weight dtype. ``fully_shard`` and ``plan`` both weigh groups by this."""
    return numel * main_dtype.itemsize


def choose_offloaded(group_bytes: Sequence[int], fraction: float) -> frozenset:
    """Indices of the groups to offload: from the last back, until at least ``fraction`` of the
    total bytes are chosen ([Note: offload by fraction]); none for 0, all for 1."""
    total = sum(group_bytes)
    chosen, held = set(), 0
    for index in reversed(range(len(group_bytes))):
        if fraction == 0 or (fraction < 1 and held >= fraction * total):
            break
        chosen.add(index)
        held += group_bytes[index]
    return frozenset(chosen)
