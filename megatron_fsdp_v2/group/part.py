"""``GroupPart``: what every part of a ParamGroup is (its main weights, levels, reducer, offloading
and exporter): an object holding the one group it belongs to, which holds the part in turn. A part
is one concern of the group in a file of its own; it reads and writes the attributes the group
declares and adds none to it (FSDP2 splits ``FSDPParamGroup``'s concerns the same way)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .param_group import ParamGroup

__all__ = ["GroupPart"]


class GroupPart:
    """One concern of a ParamGroup, holding the group."""

    group: "ParamGroup"           # the group this part belongs to (it holds this part too)

    def __init__(self, group: "ParamGroup") -> None:
        self.group = group
