"""Tensor attributes a captured step binds to new tensors, carried back to the tensors its kernels read.

[Note: attributes a step rebinds]
A CUDA graph replays kernels on the addresses they had at capture. A step that assigns a new tensor
to a Python attribute, read by the next step's kernels, breaks that: the captured kernels read the
tensor bound before the capture, and every replay writes a tensor nobody reads again. torchao's
tensorwise float8 does this twice per step (found on one H100, 2026-12-07: replays parted from the
eager steps from the second replay on):
* ``precompute_float8_dynamic_scale_for_fsdp`` sets ``weight._local_tensor._precomputed_scale =
  scale[i]`` after the optimizer step, read by the next step's weight casts;
* ``fsdp_post_all_gather(..., out=compute)`` sets ``compute._scale = scale`` at every weight
  refresh, which ZeRO-1/2 and ``no_shard`` run after the optimizer step, read by the next forward.
So before the capture every tensor attribute of the parameters the step can touch (each module's
parameters, a DTensor's local tensor, and the compute parameters of groups whose class gathers
itself, extensions/weights.py) is noted; where the captured step bound one to a new tensor of the
same shape, dtype and device, the capture ends with a copy of the new value into the noted tensor,
and the attribute is bound to it again. Each replay then leaves the value where the next replay's
kernels read it, as eager steps would. A new binding of another shape, dtype or device cannot be
carried so and is refused, naming the attribute.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.engine import Engine

__all__ = ["TensorAttribute", "tensor_attributes", "carry_rebound"]


class TensorAttribute(NamedTuple):
    """``holder.name`` was bound to ``tensor`` before the capture."""

    holder: object
    name: str
    tensor: torch.Tensor


def _holders(models: Sequence[nn.Module], engines: Sequence[Engine]) -> Iterable[torch.Tensor]:
    """The parameters a step reads (and their DTensor local tensors), each once."""
    params = [p for model in models for module in model.modules() for p in module._parameters.values()]
    for engine in engines:
        for group in engine.groups:
            if group.extension is not None:
                params += group.extension.compute_params
    seen: set = set()
    for param in params:
        for holder in (param, param._local_tensor if isinstance(param, DTensor) else None):
            if holder is not None and id(holder) not in seen:
                seen.add(id(holder))
                yield holder


def _attribute_names(holder: torch.Tensor) -> list[str]:
    """The names of ``holder``'s tensor attributes: its instance dictionary's, and the inner tensors
    a wrapper subclass declares in ``__tensor_flatten__`` (which may live in slots)."""
    names = [name for name, value in (getattr(holder, "__dict__", None) or {}).items()
             if isinstance(value, torch.Tensor)]
    flatten = getattr(type(holder), "__tensor_flatten__", None)
    if flatten is not None:
        names += [name for name in flatten(holder)[0] if name not in names]
    return names


def tensor_attributes(models: Sequence[nn.Module], engines: Sequence[Engine]) -> list[TensorAttribute]:
    """Every tensor bound to a Python attribute of a parameter the step reads, now."""
    found = []
    for holder in _holders(models, engines):
        for name in _attribute_names(holder):
            value = getattr(holder, name, None)
            if isinstance(value, torch.Tensor):
                found.append(TensorAttribute(holder, name, value))
    return found


def carry_rebound(before: Sequence[TensorAttribute]) -> int:
    """Inside the capture, at its end: copy each attribute the step bound to a new tensor into the
    tensor bound ``before``, and bind it back ([Note: attributes a step rebinds]). Returns how many."""
    rebound = [(a, getattr(a.holder, a.name, None)) for a in before]
    rebound = [(a, now) for a, now in rebound if isinstance(now, torch.Tensor) and now is not a.tensor]
    for a, now in rebound:
        if now.shape != a.tensor.shape or now.dtype != a.tensor.dtype or now.device != a.tensor.device:
            raise RuntimeError(
                f"make_graphed_step: the step bound {type(a.holder).__name__}.{a.name} to a new tensor of "
                f"{tuple(now.shape)} {now.dtype} on {now.device}, where the captured kernels read one of "
                f"{tuple(a.tensor.shape)} {a.tensor.dtype} on {a.tensor.device}; a replay cannot carry it. "
                "Write such a value in place, or run this step eagerly.")
    if rebound:
        with torch.no_grad():
            torch._foreach_copy_([a.tensor for a, _ in rebound], [now for _, now in rebound])
        for a, _ in rebound:
            setattr(a.holder, a.name, a.tensor)
    return len(rebound)
