"""Which dtype each copy of the weights and gradients is kept and communicated in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm


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
        full_precision_modules: module classes whose own parameters compute in the main-weight
            dtype instead of ``param_dtype``. Default: BatchNorm, whose fp32 running statistics
            cannot be combined with bf16 weights (PyTorch FSDP1 makes the same exception); its
            kernels accept low-precision inputs with fp32 weights. ``()`` turns it off.
    """

    param_dtype: Optional[torch.dtype] = None
    main_params_dtype: torch.dtype = torch.float32
    main_grads_dtype: torch.dtype = torch.float32
    grad_comm_dtype: Optional[torch.dtype] = None
    full_precision_modules: tuple = (_BatchNorm,)

    def __post_init__(self) -> None:
        for field in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, field)
            if value is None and field in ("param_dtype", "grad_comm_dtype"):
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy.{field} must be a floating torch.dtype, got {value!r}.")
        classes = self.full_precision_modules
        if not isinstance(classes, tuple) or not all(isinstance(c, type) and issubclass(c, torch.nn.Module)
                                                     for c in classes):
            raise ValueError(f"MixedPrecisionPolicy.full_precision_modules must be a tuple of nn.Module classes, "
                             f"got {classes!r}.")
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
                   requires_grad: bool = True, full_precision: bool = False) -> GroupDtypes:
    """Without a policy every copy keeps the parameter's dtype (plain fp32 training stays fp32).

    Frozen parameters never change, so their stored copy keeps the parameter's own dtype (no fp32
    upcast to pay for) and only the compute copy follows ``param_dtype``. ``full_precision``
    (a parameter of a ``full_precision_modules`` module) computes in the stored dtype."""
    if policy is None:
        return GroupDtypes(param_dtype, param_dtype, param_dtype, param_dtype)
    if full_precision:
        stored = policy.main_params_dtype if requires_grad else param_dtype
        compute = stored
    else:
        compute = policy.param_dtype or param_dtype
    if not requires_grad:
        return GroupDtypes(compute, param_dtype, param_dtype, param_dtype)
    grad = policy.main_grads_dtype
    return GroupDtypes(compute, policy.main_params_dtype, grad, policy.grad_comm_dtype or grad)


def full_precision_param_ids(module: torch.nn.Module, policy: Optional[MixedPrecisionPolicy]) -> set:
    """ids of the parameters owned directly by a ``policy.full_precision_modules`` submodule."""
    if policy is None or policy.param_dtype is None or not policy.full_precision_modules:
        return set()
    return {id(p) for m in module.modules() if isinstance(m, policy.full_precision_modules)
            for p in m.parameters(recurse=False)}
