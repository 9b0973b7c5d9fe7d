"""Which dtype each copy of the weights and gradients is kept and communicated in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """bf16-style training: low-precision compute weights, fp32 master weights and grad accumulation.

    Attributes:
        param_dtype: dtype of the weights the forward and backward compute with (e.g. bf16).
            ``None`` keeps each parameter's own dtype.
        main_params_dtype: dtype of the main weights the optimizer updates (and of its state).
        main_grads_dtype: dtype gradients are accumulated in across micro-batches.
        grad_comm_dtype: dtype of the reduce-scatter / all-reduce of gradients. ``None`` means
            ``main_grads_dtype``. Reducing in bf16 halves bytes moved at some accuracy cost.
    """

    param_dtype: Optional[torch.dtype] = None
    main_params_dtype: torch.dtype = torch.float32
    main_grads_dtype: torch.dtype = torch.float32
    grad_comm_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, field)
            if value is None and field in ("param_dtype", "grad_comm_dtype"):
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{field} must be a floating torch.dtype, got {value!r}.")
        if self.main_grads_dtype != self.main_params_dtype:
            # The optimizer-facing ``.grad`` is a view of the reduced gradient buffer, and torch
            # requires a parameter's .grad to have the parameter's dtype.
            raise ValueError(
                f"MixedPrecisionPolicy.main_grads_dtype must equal main_params_dtype "
                f"({self.main_params_dtype}), got {self.main_grads_dtype}; use grad_comm_dtype to reduce "
                f"gradients in a lower precision.")


@dataclass(frozen=True)
class GroupDtypes:
    """The resolved dtypes of one parameter group."""

    compute: torch.dtype   # model weights used by forward/backward
    main: torch.dtype      # optimizer-facing main weights
    grad: torch.dtype      # accumulated gradients
    grad_comm: torch.dtype # gradient collectives


def resolve_dtypes(param_dtype: torch.dtype, policy: Optional[MixedPrecisionPolicy],
                   requires_grad: bool = True) -> GroupDtypes:
    """Without a policy every copy keeps the parameter's dtype (plain fp32 training stays fp32).

    Frozen parameters never change, so their stored copy keeps the parameter's own dtype (no fp32
    upcast to pay for) and only the compute copy follows ``param_dtype``."""
    if policy is None:
        return GroupDtypes(param_dtype, param_dtype, param_dtype, param_dtype)
    compute = policy.param_dtype or param_dtype
    if not requires_grad:
        return GroupDtypes(compute, param_dtype, param_dtype, param_dtype)
    grad = policy.main_grads_dtype
    return GroupDtypes(compute, policy.main_params_dtype, grad, policy.grad_comm_dtype or grad)
