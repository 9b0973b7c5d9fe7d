"""Which tensor a wrapped module's parameter attributes hold: the optimizer's, or the compute one.

[Note: one parameter, one tensor]
A wrapped parameter has two tensors: the compute weight that forward and backward use (whole, or
gathered around its unit under ZeRO-3) and the main parameter the optimizer steps (this rank's rows
as a ``RowShardedTensor`` of the original shape; plain whole tensors under ``no_shard``). FSDP2's
modules hold the sharded DTensor between steps and the unsharded weight only inside forward and
backward (``FSDPParam.to_sharded`` / ``to_unsharded``); users rely on that: per-module optimizer
groups (``{"params": model.head.parameters(), "lr": ...}``), ``model.head.weight`` in a log line,
``block.requires_grad_(False)``. So every registration of a parameter (``owner._parameters[leaf]``,
tied names included) holds the main parameter between steps; the engine swaps the compute weights
in at the start of forward (root or unit) and back out when the step's backward has finished, or
at the end of a forward after which no backward runs (evaluation). Autograd keeps its own
references to the compute weights, so the swap-out right after a training forward would work for
plain backward, but activation checkpointing re-runs forwards inside backward and reads the
module's attributes: the compute weights stay in until backward ends.

The Megatron adapter (``dtensor_params=False``) keeps the compute weights registered at all times:
its main parameters have local shapes, and Megatron reads the module's weights directly.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["ParamSlots", "register_in_place_of"]


def register_in_place_of(module: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Every registration of ``old`` in ``module``'s tree (tied names included) holds ``new`` instead
    (a tensor class whose data lives in Python attributes can not take ``.data =``)."""
    for owner in module.modules():
        for leaf, param in owner._parameters.items():
            if param is old:
                owner._parameters[leaf] = new


class ParamSlots:
    """Every ``(owner module, attribute name)`` that registers a wrapped parameter, with the two
    tensors it can hold; ``hold_main`` / ``hold_compute`` swap them all (dictionary writes only)."""

    def __init__(self, module: nn.Module, main_of: dict, swaps: bool) -> None:
        """``main_of``: id(compute parameter) -> its main parameter; ``swaps``: False keeps the
        compute weights registered at all times (``dtensor_params=False``)."""
        self.swaps = swaps
        self.holding_main = False
        self._slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        if not swaps:
            return
        for owner in module.modules():
            for leaf, param in owner._parameters.items():
                if param is not None and id(param) in main_of:
                    self._slots.append((owner, leaf, param, main_of[id(param)]))

    def hold_main(self) -> None:
        """Between steps: every attribute holds the tensor the optimizer steps."""
        if self.swaps and not self.holding_main:
            for owner, leaf, _, main in self._slots:
                owner._parameters[leaf] = main
            self.holding_main = True

    def hold_compute(self) -> None:
        """Forward and backward (and ``summon_full_params``): the compute weights."""
        if self.holding_main:
            for owner, leaf, compute, _ in self._slots:
                owner._parameters[leaf] = compute
            self.holding_main = False

    def release(self) -> None:
        """Stop swapping for good (the module is being unwrapped): the compute weights stay."""
        self.hold_compute()
        self.swaps = False
        self._slots.clear()
