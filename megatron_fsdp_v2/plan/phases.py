"""Our device bytes at the moments of a step where activations meet them, and the peak with them.

[Note: the peak with activations]
``plan(..., activation_bytes=A)``: A is the peak of the model's activations in one forward and
backward, measured without any wrapper (the weights' bytes left out). ``zero_grad()`` (torch's
default ``set_to_none=True``) frees the gradients, so a step starts from the kept bytes minus the
gradients (``P0``; not with ``persistent_grads``) and its activations meet three states of ours:

* ``forward_end``: P0 plus the allocator's buffers live when the forward returns (none: ZeRO-3
  reshards the root then), meeting the forward's activations;
* ``last_unit_backward``: the most we hold from the start of the last unit's backward until the
  unit before it gets its first gradient (which waits for the last unit's reduce): P0, ZeRO-3's
  gathered root, units and prefetched neighbour, the last unit's reduce input (ZeRO-2/3), and
  DDP/ZeRO-1's gradient buffers made by then (the root's and the last unit's, allocated at their
  first gradient). A transformer's activations peak in that stretch (the last layer's attention
  backward, all activations still saved), so A is added here. ZeRO-2/3's per-parameter
  gradients held until their group reduces are not added: autograd makes them in the unwrapped
  run too. With several micro-batches the later ones find every gradient already there;
* ``step``: every kept byte, no activations, plus offload's upload copies (plan/offload.py): the
  step of a kernel that updates in place (fused Adam). The foreach and single-tensor kernels allocate
  more, fitted apart (``step_peak_bytes``: plan/optimizer_step.py, [Note: the optimizer step's
  temporaries]).

An offloaded DDP/ZeRO-1 group accumulates on the device and lands its gradients on the host at
the end of backward, so its device buffer is a backward temporary: in ``last_unit_backward``
and the temporaries' ``peak``, not in the kept bytes.

The planned peak is the largest of ``last_unit_backward + A``, ``step`` and the kept bytes plus
the peak of our temporaries (``peak_bytes``, activations taken as gone). Further on, each unit's
backward frees its saved activations as its gradients and our temporaries arrive; the plan takes
the former to be at least the latter (true of transformer layers at training batch sizes), so
the peak falls on one of these moments.
"""

from __future__ import annotations

from typing import Optional

from ..strategy import ShardingStrategy
from .schedule import microbatch_trace

__all__ = ["check_activation_bytes", "step_phases", "peak_with_activations"]


def check_activation_bytes(value) -> Optional[int]:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"activation_bytes must be None or a number of bytes >= 0, got {value!r}.")
    return value


def step_phases(units: list, strategy: ShardingStrategy, shard_size: int, kept: dict, micro_batches: int,
                persistent_grads: bool, upload_bytes: int, offloaded_accumulation: int,
                backward_upload_bytes: int = 0) -> dict:
    """``{"forward_end", "last_unit_backward", "step"}``: our device bytes at each moment
    ([Note: the peak with activations]), from the planned schedule (schedule.py) and ``kept``
    (the rank's ``rank_persistent_bytes``); ``offloaded_accumulation``: offloaded DDP/ZeRO-1
    groups' device gradient buffers, alive from their first gradient to the end of the backward
    that lands them on the host; ``backward_upload_bytes``: an upload's copy in flight during
    backward (offload with ``step_in_backward``)."""
    fresh = micro_batches == 1 and not persistent_grads       # the step starts without gradients
    trace = microbatch_trace(units, strategy, shard_size, grad_buffers=fresh)
    kinds = ("weights", "reduce_input", "grad_buffer")
    at_forward_end, _ = trace.live_between("forward_end", "forward_end", kinds)
    _, in_last_unit = trace.live_between("backward_start", "previous_unit_grads", kinds)
    start = kept["total"] - (0 if persistent_grads else kept["grads"])
    base = start if fresh else kept["total"] + offloaded_accumulation
    return {"forward_end": start + at_forward_end, "last_unit_backward": base + in_last_unit + backward_upload_bytes,
            "step": kept["total"] + upload_bytes}


def peak_with_activations(phases: dict, peak_bytes: int, activation_bytes: int) -> int:
    """The planned peak of a step whose activations peak at ``activation_bytes``."""
    return max(phases["last_unit_backward"] + activation_bytes, phases["step"], peak_bytes)
