"""The groups ``fully_shard`` would build for a module, without building them.

Every step here is the code ``fully_shard`` runs (wrap/units.py ``assign_units`` / ``group_specs``,
mixed_precision.py ``resolve_dtypes``, group/layout.py ``build_layout``), applied to parameter shapes
alone, so a model on the meta device is enough and the plan cannot drift from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.nn as nn

from ..group.layout import FlatLayout, build_layout
from ..mixed_precision import GroupDtypes, MixedPrecisionPolicy, full_precision_param_ids, resolve_dtypes
from ..strategy import reshards_after_forward
from ..wrap.units import assign_units, group_specs

__all__ = ["PlannedGroup", "PlannedUnit", "planned_units"]


@dataclass(frozen=True)
class PlannedGroup:
    """One ParamGroup as it would be laid out over ``layout.dp_size`` ranks."""

    tag: str
    layout: FlatLayout
    dtypes: GroupDtypes
    requires_grad: bool

    @property
    def compute_bytes(self) -> int:
        """The gathered (full-size) compute weights: ZeRO-3's temporary, ZeRO-1/2's persistent copy."""
        return self.layout.total_numel * self.dtypes.compute.itemsize

    @property
    def reduce_input_bytes(self) -> int:
        """The full-size buffer a gradient reduce reads, in the gradient-collective dtype."""
        return self.layout.total_numel * self.dtypes.grad_comm.itemsize

    @property
    def held_grad_bytes(self) -> int:
        """ZeRO-2/3: the gradients autograd hands over (compute dtype) until the group reduces."""
        return sum(self.layout.numels) * self.dtypes.compute.itemsize


@dataclass(frozen=True)
class PlannedUnit:
    fqn: str
    groups: tuple
    reshard_after_forward: Optional[bool] = True     # fully_shard's rule (strategy.reshards_after_forward)

    @property
    def is_root(self) -> bool:
        return self.fqn == ""

    @property
    def reshards_after_forward(self) -> bool:
        return reshards_after_forward(self.reshard_after_forward, self.is_root)


def planned_units(module: nn.Module, unit_modules: Optional[Sequence[type]],
                  mixed_precision: Optional[MixedPrecisionPolicy], shard_size: int, alignment: int,
                  reduce_root_per_child: bool = False, per_parameter: bool = False,
                  reshard_after_forward: Optional[bool] = True) -> list[PlannedUnit]:
    """The units and groups ``fully_shard`` builds for ``module`` over ``shard_size`` ranks (root
    first, then module order: the order a forward that runs the units in module order takes);
    ``per_parameter``: the strategy's ``shards_each_parameter`` (group/layout.py)."""
    out = []
    for spec in assign_units(module, unit_modules):
        full_precision = full_precision_param_ids(spec.module, mixed_precision)
        groups = []
        for gspec in group_specs(spec, full_precision, set(), reduce_root_per_child):
            shapes = [tuple(entry[2].shape) for entry in gspec.entries]
            groups.append(PlannedGroup(
                gspec.tag, build_layout(shapes, shard_size, alignment, per_parameter),
                resolve_dtypes(gspec.dtype, mixed_precision, gspec.requires_grad, gspec.full_precision),
                gspec.requires_grad))
        out.append(PlannedUnit(spec.fqn, tuple(groups), reshard_after_forward))
    return out
