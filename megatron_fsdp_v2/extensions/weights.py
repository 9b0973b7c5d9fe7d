"""The compute weights of a group whose parameters gather through FSDP2's extension protocol.

A ParamGroup of such parameters (wrap/units.py puts them in groups of their own) keeps its fp32 main
weights as any group does; only the compute weights differ. Where a plain group casts its main
shard into a flat compute buffer and gathers that, this one asks each parameter's class
(protocol.py, [Note: gathered through the tensor's own protocol]):

* ``no_shard`` (and any strategy over one rank): ``pre`` on the whole main weight, its outputs
  copied into the compute weight's storage (torchao's float8 cast writes there directly,
  float8_cast.py), ``post``: a local cast, no collective;
* ZeRO-1/2: ``pre`` on this rank's main shard after the step, one all-gather of every output of
  the group's parameters (as bytes: float8 travels as uint8, which gloo accepts), ``post``;
  deferred to the next forward, as FSDP2 gathers, so a scale that
  ``precompute_float8_dynamic_scale_for_fsdp`` stores after ``optimizer.step()`` is the one used;
* ZeRO-3: the same per unit at use; the gathered storages are freed at reshard (resized to 0, as
  FSDP2 frees them) and the compute parameters keep their identity.

The main weight and the compute weight relate as FSDP2's sharded and unsharded parameters: the
main parameter's local tensor is the parameter's own class wrapping our fp32 main shard
(``TensorClass.rewrap``), the optimizer steps it in place, and ``pre`` reads it; the compute parameter is what
``post`` returned on the first gather (e.g. a ``Float8TrainingTensor``), refilled in place with
``out=`` on every later one. Gradients are plain high-precision tensors and reduce as in any group.

Outputs whose first dimension is this rank's rows are padded to the layout's piece rows (zeros),
so every rank sends the same bytes; gathered, output ``j`` of a parameter is ``[dp * piece_rows,
...]`` and the compute parameter is its first ``rows`` rows (``as_strided``, as FSDP2).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm import PendingCollective
from .float8_cast import fused_float8_pre_all_gather, scaled_pre_all_gather, whole_weight_scale
from .protocol import TensorClass, pre_all_gather

__all__ = ["ExtensionWeights"]


class ExtensionWeights:
    """Per parameter of one group: its class (``classes``), the module it is registered on,
    the tensors its gathers land in and the compute parameter ``post`` made of them."""

    classes: list              # each parameter's TensorClass: its class and settings, not its data
    owners: list               # the module each parameter is registered on (5-argument pre)
    mesh: Any                  # the DeviceMesh handed to pre (dynamic scales reduce their amax over it)
    mp_policy: Any             # torch FSDP2's MixedPrecisionPolicy of the group's dtypes (5-argument pre)
    outputs: list              # per parameter: the tensors its gathers land in (full, padded)
    inner: list                # per parameter: the tensors post returned as its storage
    compute_params: list       # per parameter: the nn.Parameter forward computes with (None before the first)

    def __init__(self, classes: list, owners: list, mesh, mp_policy) -> None:
        self.classes = classes
        self.owners = owners
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.outputs = [None] * len(classes)
        self.inner = [[] for _ in classes]
        self.compute_params = [None] * len(classes)

    @classmethod
    def for_entries(cls, root: nn.Module, entries: tuple, mesh, dtypes) -> "ExtensionWeights":
        """For a group spec's ``entries`` (``(first_name, names, parameter)``) of ``root``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
        owners = [root.get_submodule(name.rpartition(".")[0]) for name, _, _ in entries]
        policy = TorchMixedPrecision(param_dtype=dtypes.compute, reduce_dtype=dtypes.grad_comm)
        return cls([TensorClass(param) for _, _, param in entries], owners, mesh, policy)

    def main_tensor(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """Our main piece ``local`` in parameter ``index``'s own class (what the optimizer steps)."""
        return self.classes[index].rewrap(local)

    # ------------------------------------------------------------------ pre
    def _pre(self, group, index: int, into: Optional[torch.Tensor] = None, whole: bool = False) -> tuple[list, Any]:
        """``pre`` of parameter ``index``: torchao's float8 cast in one kernel where it applies
        (float8_cast.py, [Note: the float8 cast in one kernel]; ``into``: where its bytes may land),
        else the class's own method. ``whole``: this rank holds the whole weight, so a dynamic
        scale needs no amax all-reduce ([Note: a whole weight needs no amax all-reduce])."""
        local = _protocol_tensor(group, index)
        shape = torch.Size(group.shapes[index])
        scale = whole_weight_scale(local) if whole else None
        fused = fused_float8_pre_all_gather(local, into, scale)
        if fused is not None:
            outputs, metadata = fused
        elif scale is not None:
            outputs, metadata = scaled_pre_all_gather(local, scale)
        else:
            with torch.no_grad():
                outputs, metadata = pre_all_gather(local, self.mesh, shape, _contiguous_stride(shape),
                                                   self.owners[index], self.mp_policy)
        if not group.strategy.optim_sharded:
            return list(outputs), metadata
        rows_here = local.shape[0]
        piece_rows = group.layout.piece_rows[index] if group.layout.per_parameter else rows_here
        return [_pad_rows(out, rows_here, piece_rows) for out in outputs], metadata

    # ------------------------------------------------------------------ the weights
    def refresh(self, group, async_op: bool) -> PendingCollective:
        """Compute weights from the main weights: a local cast (``no_shard``) or one all-gather of the
        group's outputs as bytes, ``post`` once it has landed."""
        if not group.strategy.optim_sharded or group.comm.size == 1:       # nothing to gather: a cast
            for index in range(len(self.classes)):
                outputs, metadata = self._pre(group, index, into=self._landing(index), whole=True)
                group.comm.stats.record_scales(_tensors_in(metadata))
                self._land(index, outputs)
                self._post(group, index, metadata)
            return PendingCollective(None, lambda: None)
        pres = [self._pre(group, i) for i in range(len(self.classes))]
        group.comm.stats.record_scales([t for _, metadata in pres for t in _tensors_in(metadata)])
        return self._gather(group, pres, async_op)

    def _landing(self, index: int) -> Optional[torch.Tensor]:
        """A local cast's target for parameter ``index``'s one output, its storage back (None before
        the first cast, or for a class with several outputs)."""
        outputs = self.outputs[index]
        if outputs is None or len(outputs) != 1:
            return None
        self._ensure_outputs(index, outputs, 1)
        return outputs[0]

    def _gather(self, group, pres: list, async_op: bool) -> PendingCollective:
        comm, key = group.comm, (group.name, "extension_gathered")
        widths = [out.numel() * out.element_size() for outputs, _ in pres for out in outputs]
        size = sum(widths)
        gathered = group.allocator.allocate(key, size * comm.size, torch.uint8, group.device)
        slot = gathered[comm.rank * size:(comm.rank + 1) * size]
        with torch.no_grad():
            torch.cat([out.contiguous().view(-1).view(torch.uint8) for outputs, _ in pres for out in outputs],
                      out=slot)
        carried: dict = {}                      # what the uint8 bytes are, for comm_stats()
        for out, width in zip((out for outputs, _ in pres for out in outputs), widths):
            carried[out.dtype] = carried.get(out.dtype, 0) + width * comm.size
        work = comm.all_gather(gathered, slot, async_op=async_op, label=f"weights of {group.name}", carried=carried)

        def copy_out() -> None:
            for index, (outputs, _) in enumerate(pres):
                self._ensure_outputs(index, outputs, comm.size)
            targets = [t.view(-1).view(torch.uint8).view(comm.size, -1) for outs in self.outputs for t in outs]
            with torch.no_grad():
                torch.split_with_sizes_copy(gathered.view(comm.size, size), widths, dim=1, out=targets)
            group.allocator.free(key)
            for index, (_, metadata) in enumerate(pres):
                self._post(group, index, metadata)
        if not async_op:
            copy_out()
            return PendingCollective(None, lambda: None)
        return PendingCollective(work, copy_out)

    def _land(self, index: int, outputs: list) -> None:
        """A cast (``no_shard``, or a group of one rank): its outputs become (first time) or are copied
        into the storage."""
        if self.outputs[index] is None:
            self.outputs[index] = outputs
            return
        self._ensure_outputs(index, outputs, 1)
        with torch.no_grad():
            for target, out in zip(self.outputs[index], outputs):
                if out is not target:             # (pre wrote into it: float8_cast.py)
                    target.copy_(out)

    def _ensure_outputs(self, index: int, outputs: list, ranks: int) -> None:
        """Parameter ``index``'s gathered tensors exist and have storage (made at the first gather,
        ``[ranks * rows, ...]`` of each output, FSDP2's ``view(-1, *size[1:])``)."""
        if self.outputs[index] is None:
            self.outputs[index] = [torch.empty((ranks * out.shape[0], *out.shape[1:]) if out.dim() else
                                               (ranks,), dtype=out.dtype, device=out.device) for out in outputs]
            return
        for tensor in self.outputs[index] + self.inner[index]:
            _alloc_storage(tensor)

    def _post(self, group, index: int, metadata) -> None:
        local = _protocol_tensor(group, index)
        outputs = tuple(self.outputs[index])
        with torch.no_grad():
            if self.compute_params[index] is not None:
                local.fsdp_post_all_gather(outputs, metadata, group.dtypes.compute, out=self.compute_params[index])
                return
            tensor, inner = local.fsdp_post_all_gather(outputs, metadata, group.dtypes.compute)
            shape = torch.Size(group.shapes[index])
            weight = torch.as_strided(tensor, shape, _contiguous_stride(shape), storage_offset=0)
        self.inner[index] = list(inner)
        self.compute_params[index] = nn.Parameter(weight, requires_grad=group.requires_grad)

    def free(self) -> None:
        """ZeRO-3 reshard: the gathered storages go (resized to 0); the compute parameters stay."""
        for outputs, inner in zip(self.outputs, self.inner):
            for tensor in (outputs or []) + inner:
                tensor.untyped_storage().resize_(0)


def _protocol_tensor(group, index: int) -> torch.Tensor:
    """Parameter ``index``'s main piece in its own class: what pre and post are called on."""
    main = group.main_params[index]
    return main._local_tensor if isinstance(main, DTensor) else main


def _tensors_in(metadata) -> list:
    """The tensors in a protocol's metadata (any nesting of tuples, lists and dicts)."""
    from torch.utils._pytree import tree_leaves
    return [leaf for leaf in tree_leaves(metadata) if isinstance(leaf, torch.Tensor)]


def _contiguous_stride(shape: torch.Size) -> tuple:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def _pad_rows(out: torch.Tensor, rows_here: int, piece_rows: int) -> torch.Tensor:
    """An output of this rank's rows, zero-padded to every rank's piece rows (same bytes sent)."""
    if out.dim() == 0 or out.shape[0] != rows_here or rows_here == piece_rows:
        return out
    padded = torch.zeros((piece_rows, *out.shape[1:]), dtype=out.dtype, device=out.device)
    padded[:rows_here].copy_(out)
    return padded


def _alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.nbytes() < nbytes:
        storage.resize_(nbytes)

