"""torchao's float8 weight cast at gather time, in one kernel.

[Note: the float8 cast in one kernel]
torchao's ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``, once
``precompute_float8_dynamic_scale_for_fsdp`` has stored a scale on the weight, casts the
high-precision shard in eager mode: ``hp.to(float32) * scale``, ``clamp(-max, max)``,
``.to(float8)``. That is three kernels and two float32 temporaries the size of the weight, at
every gather (forward, and again in backward under ZeRO-3). On one H100 with issue 47's 8-layer
Llama at one rank, those casts take about 27 ms of a 290 ms step (docs/benchmarks_history.md, "HF
Llama, float8 and compile").

For exactly that class with a stored scale, on CUDA, we compute the same bytes with one compiled
pointwise kernel: the same float32 multiply, the same clamp and the same round-to-nearest
conversion. tests/unit/test_float8_cast.py checks it bit for bit against torchao's own method. The
result is what torchao returns, ``((data,), (scale,))``, so ``fsdp_post_all_gather`` is unchanged.
Everything else goes through the class's own method: a sharded weight with no stored scale (the
dynamic amax, whose all-reduce is torchao's), another class, or a tensor that is not on CUDA.

[Note: a whole weight needs no amax all-reduce]
Without a stored scale torchao's method reduces the weight's amax over the mesh: one all-reduce per
weight per gather. Where this rank holds the whole weight (``no_shard``, whose weights are the same
on every rank, or a group of one rank) that all-reduce returns the local amax, and torchao's
precompute does not reach such weights (it takes DTensors only). ``whole_weight_scale`` computes
that scale here with torchao's own ``tensor_to_amax`` and ``amax_to_scale``, so the cast is the one
torchao's dynamic path gives, bit for bit, without a collective that ``comm_stats()`` would not see.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import torch

__all__ = ["fused_float8_pre_all_gather", "scaled_pre_all_gather", "whole_weight_scale"]

# Where the compiled kernel is used. Tests add "cpu" to check the same path against torchao there.
DEVICE_TYPES: tuple = ("cuda",)

_compiled: dict = {}


def _scaled_cast(hp: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """torchao's ``hp_tensor_and_scale_to_float8`` and ``to_fp8_saturated``, written into ``out``."""
    max_value = torch.finfo(out.dtype).max
    out.copy_((hp.to(torch.float32) * scale).clamp(min=-max_value, max=max_value).to(out.dtype))


def _kernel():
    """The compiled cast, made on first use: one graph for every length (dynamic), per dtype pair.
    None once compiling failed here (no triton, say): torchao's own cast from then on."""
    if "cast" not in _compiled:
        _compiled["cast"] = torch.compile(_scaled_cast, dynamic=True, fullgraph=True)
    return _compiled["cast"]


def _run_compiled(hp: torch.Tensor, scale: torch.Tensor, into: torch.Tensor) -> bool:
    """Cast with the compiled kernel; False (with one warning) if it can not be compiled here."""
    kernel = _kernel()
    if kernel is None:
        return False
    try:
        kernel(hp, scale, into)
    except Exception as error:                 # the same bytes come from torchao's method instead
        _compiled["cast"] = None
        warnings.warn(f"megatron_fsdp_v2: the fused float8 weight cast could not be compiled ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); torchao's own cast is used instead "
                      "(the same values, slower).", RuntimeWarning, stacklevel=3)
        return False
    return True


@functools.cache
def _cast_class() -> Optional[type]:
    """torchao's float8 weight class, looked up once (this runs at every gather of every weight)."""
    try:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except Exception:            # torchao absent or broken: nothing to speed up
        return None
    return WeightWithDynamicFloat8CastTensor


def whole_weight_scale(local: torch.Tensor) -> Optional[torch.Tensor]:
    """The scale torchao's dynamic cast gives ``local`` when it is a whole weight (no stored scale),
    computed without its amax all-reduce ([Note: a whole weight needs no amax all-reduce]); None
    for another class or a stored scale."""
    cls = _cast_class()
    if cls is None or type(local) is not cls or local._precomputed_scale is not None:
        return None
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
    with torch.no_grad():
        return amax_to_scale(tensor_to_amax(local._tensor), local._dtype)


def scaled_pre_all_gather(local: torch.Tensor, scale: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
    """torchao's ``fsdp_pre_all_gather`` with ``scale`` as the stored scale, in torchao's own eager
    ops (where the fused kernel does not apply)."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    with torch.no_grad():
        cast = hp_tensor_and_scale_to_float8(local._tensor, scale, local._dtype, local._linear_mm_config,
                                             GemmInputRole.WEIGHT)
    return (cast._data,), (cast._scale,)


def fused_float8_pre_all_gather(local: torch.Tensor, into: Optional[torch.Tensor] = None,
                                scale: Optional[torch.Tensor] = None
                                ) -> Optional[tuple[tuple[torch.Tensor, ...], Any]]:
    """``local.fsdp_pre_all_gather``'s result computed in one kernel, or None where this does not
    apply (the caller then calls the method). ``into``: a float8 tensor of the weight's shape to
    write the bytes into (a gather over one rank lands there directly); ``scale``: the scale to
    use instead of the stored one (``whole_weight_scale``)."""
    cls = _cast_class()
    if cls is None or type(local) is not cls:
        return None
    scale, hp = (local._precomputed_scale if scale is None else scale), local._tensor
    if (type(scale) is not torch.Tensor or type(hp) is not torch.Tensor or not hp.is_contiguous()
            or hp.device.type not in DEVICE_TYPES):
        return None
    if into is None:
        into = torch.empty(hp.shape, dtype=local._dtype, device=hp.device)
    if into.dtype != local._dtype or into.shape != hp.shape or not into.is_contiguous():
        return None
    with torch.no_grad():
        if torch.compiler.is_compiling():        # inside a traced region: the same ops, fused by that graph
            _scaled_cast(hp.view(-1), scale, into.view(-1))
        elif not _run_compiled(hp.view(-1), scale, into.view(-1)):
            return None
    return (into,), (scale,)
