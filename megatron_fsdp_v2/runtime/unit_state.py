"""A unit at run time: its groups, gathered and resharded together (``Unit``), and the order units
ran in the first forward, which picks what to prefetch (``ForwardOrder``). Which module
instances are units is decided at wrap time (wrap/units.py); when each verb runs, by the engine."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..group.param_group import ParamGroup
from ..mixed_precision import MixedPrecisionPolicy
from ..strategy import reshards_after_forward

__all__ = ["ForwardOrder", "Unit"]


class ForwardOrder:
    """The order units ran in the first forward; frozen after it, used to pick prefetch targets."""

    def __init__(self) -> None:
        self.units: list = []
        self.frozen = False

    def record(self, unit) -> None:
        if not self.frozen and unit not in self.units:
            self.units.append(unit)

    def freeze(self) -> None:
        if self.units:
            self.frozen = True

    def is_last(self, unit) -> bool:
        """Whether ``unit`` ran last in the recorded forward (False before it is recorded: during
        the first forward every unit would look last)."""
        return self.frozen and unit in self.units and self.units[-1] is unit

    def neighbour(self, unit, step: int):
        if not self.frozen or unit not in self.units:
            return None
        position = self.units.index(unit) + step
        return self.units[position] if 0 <= position < len(self.units) else None


class Unit:
    """The groups of one unit module, acted on together."""

    index: int                                   # its position in the engine's units (the root: 0)
    module: nn.Module
    fqn: str                                     # the module's name in the model ("": the root)
    groups: list[ParamGroup]
    mixed_precision: Optional[MixedPrecisionPolicy]   # the policy of the fully_shard call that made it
    reshard_after_forward: Optional[bool]        # that call's rule (``reshards_after_forward``)
    forwards_in_flight: list                     # (ForwardRecord, SavedWeightHooks or None) per forward running

    def __init__(self, index: int, module: nn.Module, fqn: str, groups: list[ParamGroup],
                 mixed_precision: Optional[MixedPrecisionPolicy] = None,
                 reshard_after_forward: Optional[bool] = True) -> None:
        self.index, self.module, self.fqn, self.groups = index, module, fqn, groups
        self.mixed_precision, self.reshard_after_forward = mixed_precision, reshard_after_forward
        self.forwards_in_flight = []

    @property
    def is_root(self) -> bool:
        return self.fqn == ""

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3: whether its gathered weights go back after its forward (strategy.py)."""
        return reshards_after_forward(self.reshard_after_forward, self.is_root)

    @property
    def is_unsharded(self) -> bool:
        return all(group.is_unsharded for group in self.groups)

    def unshard(self, async_op: bool = True) -> None:
        for group in self.groups:
            group.unshard(async_op)

    @property
    def worth_prefetching(self) -> bool:
        """Whether gathering this unit moves data between ranks. Over a group of one rank the
        gather is a local cast with nothing to hide behind compute, and prefetching it would only
        hold a second unit's weights through the current unit's activation peak."""
        return any(group.gather_size > 1 for group in self.groups)

    def wait_unshard(self) -> None:
        """Wait for this unit's weights: a ZeRO-3 gather or a ZeRO-1/2 refresh in flight."""
        for group in self.groups:
            group.wait_unshard()
            group.wait_refresh()

    def reshard(self) -> None:
        for group in self.groups:
            group.reshard()

    def prefetch_uploads(self) -> None:
        """Offload with ``release_after_gather``: start copying this unit's released compute shards."""
        for group in self.groups:
            group.offloading.prefetch_upload()
