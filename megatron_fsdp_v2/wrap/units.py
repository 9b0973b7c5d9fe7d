"""Which module instances are units, and which unit owns each parameter.

A unit is the granularity of ZeRO-3's all-gather / reshard and of every strategy's gradient
reduction. The root module is always a unit; every instance of a class in ``unit_modules``
becomes one more. A parameter belongs to the deepest unit containing it; a parameter reachable
under two units (tied weights, e.g. an embedding shared with the output layer) belongs to the
deepest unit containing *every* place it is used, so it stays unsharded whenever any user runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch.nn as nn

from ..extensions.protocol import has_protocol


@dataclass
class UnitSpec:
    """One unit: its module, its name in the root, and the (names, parameter) pairs it owns."""

    module: nn.Module
    fqn: str
    params: list = field(default_factory=list)   # [(first_name, [all names], nn.Parameter)]

    @property
    def is_root(self) -> bool:
        return self.fqn == ""


def _validate_unit_classes(unit_modules: Optional[Iterable]) -> tuple:
    if unit_modules is None:
        return ()
    if isinstance(unit_modules, type):
        unit_modules = (unit_modules,)
    try:
        classes = tuple(unit_modules)
    except TypeError:
        raise TypeError(
            f"unit_modules must be a module class or a list of nn.Module subclasses, got {unit_modules!r}."
        ) from None
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"unit_modules must contain nn.Module subclasses, got {cls!r} ({type(cls).__name__}).")
    return classes


def _contains(unit_fqn: str, name: str) -> bool:
    return unit_fqn == "" or name == unit_fqn or name.startswith(unit_fqn + ".")


def assign_units(root: nn.Module, unit_modules: Optional[Sequence[type]],
                 unit_instances: Iterable[nn.Module] = ()) -> list[UnitSpec]:
    """Split ``root``'s parameters into units; the root unit comes first, the rest in module order.

    ``unit_instances`` are submodules that are units whatever their class (those an earlier
    ``fully_shard`` call wrapped, as FSDP2's nested calls mark units).
    Raises ``ValueError`` when a class in ``unit_modules`` matches no submodule (a typo or a model
    that changed would otherwise silently fall back to one giant unit).
    """
    classes = _validate_unit_classes(unit_modules)
    instances = {id(m) for m in unit_instances}
    units = [UnitSpec(root, "")]
    matched = set()
    for fqn, module in root.named_modules():
        if fqn and ((classes and isinstance(module, classes)) or id(module) in instances):
            units.append(UnitSpec(module, fqn))
            matched.update(cls for cls in classes if isinstance(module, cls))
    missing = [cls.__name__ for cls in classes if cls not in matched]
    if missing:
        raise ValueError(
            f"unit_modules: no submodule of {type(root).__name__} is an instance of {missing}; "
            f"pass classes the model contains (or None for a single root unit)."
        )
    names_of: dict[int, list[str]] = {}
    param_of: dict[int, nn.Parameter] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        param_of[id(param)] = param
    for key, names in names_of.items():
        owner = max(
            (u for u in units if all(_contains(u.fqn, n) for n in names)),
            key=lambda u: u.fqn.count(".") + (1 if u.fqn else 0),
        )
        owner.params.append((names[0], names, param_of[key]))
    return [u for u in units if u.params or u.is_root]


@dataclass(frozen=True)
class GroupSpec:
    """One parameter group of a unit: parameters of one (dtype, requires_grad, full precision,
    expert, root child, gathered through FSDP2's extension protocol) share one flat buffer, so one
    collective moves them all."""

    tag: str
    dtype: object
    requires_grad: bool
    full_precision: bool
    expert: bool
    entries: tuple     # ((first_name, [all names], nn.Parameter), ...)
    extension: bool = False   # its tensors gather themselves (extensions/weights.py)


def group_specs(spec: UnitSpec, full_precision: set, experts: set, reduce_root_per_child: bool) -> list[GroupSpec]:
    """Split a unit's parameters into groups, in first-seen order (what ``fully_shard`` builds a
    ParamGroup from and ``plan`` lays out: one source of truth for both)."""
    buckets: dict = {}
    for first_name, names, param in spec.params:
        child = first_name.split(".", 1)[0] if reduce_root_per_child and spec.is_root and "." in first_name else ""
        key = (param.dtype, param.requires_grad, id(param) in full_precision, id(param) in experts, child,
               has_protocol(param))
        buckets.setdefault(key, []).append((first_name, names, param))
    out = []
    for (dtype, requires_grad, keep_precision, expert, child, extension), entries in buckets.items():
        tag = (f"{spec.fqn or '<root>'}{'/' + child if child else ''}/{str(dtype).replace('torch.', '')}/"
               f"{'grad' if requires_grad else 'frozen'}"
               f"{'/full_precision' if keep_precision else ''}{'/experts' if expert else ''}"
               f"{'/' + type(entries[0][2]).__name__ if extension else ''}")
        out.append(GroupSpec(tag, dtype, requires_grad, keep_precision, expert, tuple(entries), extension))
    return out
