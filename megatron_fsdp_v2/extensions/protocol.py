"""FSDP2's all-gather extension protocol: a parameter tensor that says how it is gathered.

[Note: gathered through the tensor's own protocol]
torch FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``) gathers a parameter whose
local tensor defines ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` through those methods:
``pre`` turns this rank's high-precision shard into the tensors that travel (torchao's float8
training weights, ``WeightWithDynamicFloat8CastTensor``: the float8 bytes, scaled by the global
amax, and the scale as metadata that stays local), ``post`` turns the gathered tensors into the
weight forward computes with (a ``Float8TrainingTensor``). Transformer Engine's float8 tensors
implement it too. We call the same methods with the same arguments:

* ``fsdp_pre_all_gather(mesh)`` or ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
  mp_policy)``, told apart by arity as FSDP2 does, on the local tensor of the main parameter the
  optimizer steps (so a scale that ``precompute_float8_dynamic_scale_for_fsdp`` stored on it is
  used);
* ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` once, and with ``out=`` (the compute
  parameter) on every later gather: autograd and compiled graphs alias that parameter, so it is
  refilled in place.

A parameter of any *other* tensor subclass is refused at wrap (``check_param_types``): our buffers
would copy its values out and leave the subclass computing with its own stale copy.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["TensorClass", "check_param_types", "data_of", "has_protocol", "pre_all_gather", "set_data"]


def has_protocol(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local tensor) defines both halves of the protocol."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return callable(getattr(local, "fsdp_pre_all_gather", None)) and callable(
        getattr(local, "fsdp_post_all_gather", None))


def _is_plain(param: torch.Tensor) -> bool:
    return type(param) in (torch.Tensor, nn.Parameter)


def check_param_types(module: nn.Module) -> None:
    """Refuse a parameter whose tensor is a subclass we can not shard exactly: neither a plain
    tensor nor one implementing both halves of the protocol with ``__tensor_flatten__`` (how we
    wrap our own main shard in its class); a DTensor parameter (torch tensor parallelism) too. Deterministic from the
    model, so every rank that builds the same model raises the same error."""
    for name, param in module.named_parameters():
        if _is_plain(param):
            continue
        if isinstance(param, DTensor):
            raise TypeError(
                f"module: parameter {name!r} is already a DTensor (placements {tuple(param.placements)}, e.g. from "
                "torch tensor parallelism); fully_shard shards plain tensors: allowed are plain tensors (Megatron's "
                "tensor parallelism keeps plain local shards) and tensor subclasses implementing FSDP2's all-gather "
                "extension.")
        kind = f"{type(param).__module__}.{type(param).__qualname__}"
        has_pre = callable(getattr(param, "fsdp_pre_all_gather", None))
        has_post = callable(getattr(param, "fsdp_post_all_gather", None))
        if not (has_pre or has_post):
            raise TypeError(
                f"module: parameter {name!r} is a {kind}, a tensor subclass that fully_shard can not shard: "
                "allowed are plain tensors, DTensors and subclasses implementing FSDP2's all-gather extension "
                "(fsdp_pre_all_gather and fsdp_post_all_gather, e.g. torchao float8 training with "
                "enable_fsdp_float8_all_gather=True).")
        if has_pre != has_post:
            missing = "fsdp_post_all_gather" if has_pre else "fsdp_pre_all_gather"
            raise TypeError(f"module: parameter {name!r} is a {kind} that defines only one half of FSDP2's "
                            f"all-gather extension: {missing} is missing; both are needed.")
        if not hasattr(type(param), "__tensor_unflatten__") or not hasattr(param, "__tensor_flatten__"):
            raise TypeError(f"module: parameter {name!r} is a {kind} implementing FSDP2's all-gather extension "
                            "without __tensor_flatten__ / __tensor_unflatten__, which fully_shard needs to hold "
                            "its main shard in the same class.")
        _check_arity(name, kind, param.fsdp_pre_all_gather)


def _check_arity(name: str, kind: str, method) -> None:
    count = len(inspect.signature(method).parameters)
    if count not in (1, 5):
        raise TypeError(f"module: parameter {name!r} is a {kind} whose fsdp_pre_all_gather takes {count} "
                        "arguments; FSDP2's protocol allows (mesh) or (mesh, outer_size, outer_stride, module, "
                        "mp_policy).")


class TensorClass:
    """A protocol tensor's class and settings without its data (``__tensor_flatten__``'s context):
    what ``rewrap`` needs to hold our main shard in that class. Keeping the original tensor instead
    would keep its full-size data alive on every rank."""

    cls: type
    data_name: str            # the data's name in __tensor_flatten__ (its first inner tensor)
    context: Any

    def __init__(self, tensor: torch.Tensor) -> None:
        names, self.context = tensor.__tensor_flatten__()
        self.cls, self.data_name = type(tensor), names[0]

    def rewrap(self, inner: torch.Tensor) -> torch.Tensor:
        """A tensor of this class whose data is ``inner`` (our main shard): any other inner tensor
        of the original (a cached scale) is left out, to be computed again from the new data."""
        return self.cls.__tensor_unflatten__({self.data_name: inner}, self.context, inner.size(), inner.stride())


def data_of(param: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``param``'s values: a protocol tensor's first inner tensor (its
    data, ``TensorClass.data_name``), else ``param.data``."""
    if has_protocol(param) and not isinstance(param, DTensor):
        return getattr(param, TensorClass(param).data_name)
    return param.data


def set_data(param: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``values`` the tensor holding ``param``'s values from now on (what was there is freed
    with its last reference). A protocol tensor keeps its data in a Python attribute, which
    ``.data =`` does not reach: that attribute is set."""
    if has_protocol(param) and not isinstance(param, DTensor):
        setattr(param, TensorClass(param).data_name, values)
    else:
        param.data = values


def pre_all_gather(local: torch.Tensor, mesh, orig_size: torch.Size, orig_stride: tuple, module: nn.Module,
                   mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Optional[Any]]:
    """``local.fsdp_pre_all_gather`` in the form it declares: ``(all_gather_inputs, metadata)``."""
    method = local.fsdp_pre_all_gather
    if len(inspect.signature(method).parameters) == 1:
        inputs, metadata = method(mesh)
    else:
        inputs, metadata = method(mesh, orig_size, orig_stride, module, mp_policy)
    return tuple(inputs), metadata
