"""A ParamGroup's main weights as the optimizer sees them: each parameter's piece of the main shard
(this rank's rows, or the whole parameter), the optimizer-facing parameters viewing it (plain
tensors, DTensors on the group's mesh, or the parameter class's own under FSDP2's extension
protocol), and moving the main weights to another home (the main segment, the host) with those
parameters still viewing them. FSDP2 keeps the same in ``FSDPParam``'s sharded parameter.

A part of ParamGroup (its ``main``); it writes the group's ``main_shard``, ``main_locals`` and
``main_params`` and adds nothing to the group; it keeps, for itself, the spec each piece faces the
optimizer with (made once: the step's ``.grad`` views are wrapped with it every step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..row_sharded import RowsSpec, rows_spec, wrap_rows
from .part import GroupPart

if TYPE_CHECKING:
    from .param_group import ParamGroup

__all__ = ["MainWeights"]


class MainWeights(GroupPart):
    """The main weights' pieces and the optimizer's parameters viewing them."""

    _specs: dict                  # (index, piece shape, dtype) -> RowsSpec: how a piece faces the optimizer

    def __init__(self, group: "ParamGroup") -> None:
        super().__init__(group)
        self._specs = {}

    def make_params(self) -> None:
        """main_locals: this rank's pieces as plain tensors (what the engine reads and writes);
        main_params: the same memory as the optimizer sees it (DTensors can not be re-pointed
        later, so they are made where the main shard stays)."""
        group = self.group
        group.main_locals = []
        group.main_params = [self._make_param(i) for i in range(len(group.params))]

    def own_values_buffer(self, device: torch.device, from_values: bool = True) -> torch.Tensor:
        """This rank's main weights (its shard, or the whole buffer) taken from the parameters in
        a new buffer on ``device`` (main_segment.py's ``build_device``); padding is zero, and all of
        it without ``from_values`` (parameters still on meta). Built piece by piece: no full-size
        temporary of the group."""
        group = self.group
        main = torch.zeros(self.numel, dtype=group.dtypes.main, device=device)
        if not from_values:
            return main
        with torch.no_grad():
            for index, param in enumerate(group.params):
                piece = self.view(main, index)
                piece.copy_(self._own_values(index, param).view(piece.shape))
        return main

    @property
    def numel(self) -> int:
        """Elements of the main weights: the shard, or (not ``optim_sharded``) the whole buffer."""
        group = self.group
        return group.layout.shard_numel if group.strategy.optim_sharded else group.layout.total_numel

    def rehome(self, storage: torch.Tensor) -> None:
        """Move the main weights into ``storage`` (``numel`` elements of the main dtype; zeros
        if there were none yet) and point the main parameters, if made, there (their ``.data``:
        plain-tensor main parameters only)."""
        group = self.group
        with torch.no_grad():
            if group.main_shard is None:
                storage.zero_()
            else:
                storage.copy_(group.main_shard)
        self.point_at(storage)

    def point_at(self, main: torch.Tensor) -> None:
        """``main`` is the main weights from now on; main parameters already made view it."""
        group = self.group
        group.main_shard = main
        if group.main_params is None:
            return
        group.main_locals = [self.view(main, i) for i in range(len(group.params))]
        with torch.no_grad():
            for index, param in enumerate(group.main_params):
                param.data = self._for_optimizer(group.main_locals[index], index)

    def view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """``index``'s piece of a buffer laid out like ``main_shard``: this rank's rows
        ``[rows_here, *shape[1:]]`` (a 0-d parameter: ``[1]`` or ``[0]``), or the whole parameter."""
        group = self.group
        if group.strategy.optim_sharded:
            piece = group.layout.shard_slice(index, group.comm.rank)
            splits = group.layout.row_splits(index)
            rows = splits[group.comm.rank + 1] - splits[group.comm.rank]
            return buffer[piece.shard_start:piece.shard_start + piece.numel].view(rows, *group.shapes[index][1:])
        start, end = group.layout.param_range(index)
        return buffer[start:end].view(group.shapes[index])

    def facing_optimizer(self, local: torch.Tensor, index: int, requires_grad: bool = False) -> torch.Tensor:
        """A piece laid out like ``main_shard`` as the optimizer sees it (see ``mesh``)."""
        group = self.group
        if group.mesh is None:
            return local
        key = (index, local.shape, local.dtype)
        made: RowsSpec = self._specs.get(key)
        if made is None:
            shape = tuple(group.shapes[index]) or (1,)
            made = self._specs[key] = rows_spec(local, group.mesh, shape, group.layout.row_splits(index))
        return wrap_rows(made, local, requires_grad)

    def _make_param(self, index: int) -> nn.Parameter:
        group = self.group
        local = self.view(group.main_shard, index)
        group.main_locals.append(local)
        return nn.Parameter(self._for_optimizer(local, index), requires_grad=group.requires_grad)

    def _for_optimizer(self, local: torch.Tensor, index: int) -> torch.Tensor:
        """A main piece as the optimizer steps it: in the parameter's own class if that class
        gathers itself (its protocol reads the scale a step stored on it), then as ``facing_optimizer``."""
        group = self.group
        if group.extension is not None:
            local = group.extension.main_tensor(index, local)
        return self.facing_optimizer(local, index)

    def write_values(self, index: int, full: torch.Tensor) -> None:
        """Store parameter ``index``'s values (a full tensor) in this rank's main weights (a model
        initialized from meta: wrap/meta_init.py). The compute weights follow at the next rebuild."""
        with torch.no_grad():
            local = self.group.main_locals[index]
            local.copy_(self._own_values(index, full).view(local.shape))

    def _own_values(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of parameter ``index``'s values ``full``, flat."""
        group = self.group
        values = full.detach().reshape(-1)
        if not group.strategy.optim_sharded:
            return values
        piece = group.layout.shard_slice(index, group.comm.rank)
        return values[piece.param_start:piece.param_end]

    def version(self) -> int:
        """Changes whenever the optimizer (or a load) writes the main weights in place."""
        group = self.group
        # In-place ops on a DTensor parameter bump the wrapper's counter, not the local view's
        # (they run below autograd's in-place tracking); writes to the buffer bump the buffer's.
        return group.main_shard._version + sum(p._version for p in group.main_params)
