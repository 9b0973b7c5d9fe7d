"""How a ZeRO-3 unit learns that its backward is about to run, whatever its forward returned.

ZeRO-3 frees a unit's gathered weights after its forward, so they must be gathered again before
autograd runs the unit's backward nodes. Two triggers lead to ``Engine._pre_backward``:

1. **Output hook** (early, enables prefetching): a multi-grad hook on the gradient-requiring
   tensors found in the unit's output, through pytree containers and dataclasses. It fires when
   the first gradient reaches the output, before any of the unit's backward nodes.
2. **Saved-weight hook** (the guarantee): while the unit's forward runs, saved-tensor hooks pack
   every tensor that autograd saves from the unit's gathered weights together with a marker.
   When a backward node unpacks it (the moment it needs the weight) the unit is gathered first
   if it is not. This does not depend on the output's type at all: a unit returning a custom
   object, or a tensor that the loss reaches only through an attribute, is covered.

Both triggers share one ``ForwardRecord`` per forward of the unit, so "backward ran twice through
one forward" (ZeRO-3 freed what the second backward needs) is told apart from "two triggers of
the same backward".
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_leaves


class ForwardRecord:
    """One forward of one unit: in which backward (by index) its pre-backward ran, if any."""

    __slots__ = ("backward_index",)

    def __init__(self) -> None:
        self.backward_index: Optional[int] = None


class _SavedWeight:
    """A tensor autograd saved from a unit's gathered weights, the group it came from and the
    forward that saved it."""

    __slots__ = ("tensor", "group", "record")

    def __init__(self, tensor: torch.Tensor, group, record: ForwardRecord) -> None:
        self.tensor = tensor
        self.group = group
        self.record = record


def tensors_needing_grad(output, _depth: int = 0) -> list[torch.Tensor]:
    """Gradient-requiring tensors in ``output``: pytree containers, dataclasses (nested) and
    named tuples. Anything else is left to the saved-weight hook."""
    found = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and _depth < 8:
            for field in dataclasses.fields(leaf):
                found.extend(tensors_needing_grad(getattr(leaf, field.name, None), _depth + 1))
    return found


def _weight_ranges(groups) -> list[tuple[int, int, object]]:
    """[start, end) device addresses of the groups' gathered compute weights, with the group."""
    ranges = []
    for group in groups:
        weights = group.model_weights
        if weights is not None and weights.numel():
            start = weights.data_ptr()
            ranges.append((start, start + weights.numel() * weights.element_size(), group))
    return ranges


class SavedWeightHooks:
    """Saved-tensor hooks around one forward of one unit (see the module docstring, trigger 2).

    ``enter`` / ``exit`` bracket the forward (a forward pre-hook and an always-called forward
    hook), so the hooks are popped even when the forward raises. The unpack callback reaches the
    engine through a weak reference: autograd keeps the packed objects alive as long as the graph.
    """

    def __init__(self, on_unpack: Callable[[ForwardRecord, object], None], groups, record: ForwardRecord) -> None:
        self._ranges = _weight_ranges(groups)
        self._record = record
        self._on_unpack = on_unpack
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def enter(self) -> None:
        self._context.__enter__()

    def exit(self) -> None:
        self._context.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor):
        try:
            address = tensor.data_ptr()
        except RuntimeError:      # tensors without storage (e.g. some subclasses) are never weights
            return tensor
        for start, end, group in self._ranges:
            if start <= address < end:
                return _SavedWeight(tensor, group, self._record)
        return tensor

    def _unpack(self, packed):
        if isinstance(packed, _SavedWeight):
            self._on_unpack(packed.record, packed.group)
            return packed.tensor
        return packed


def weak_method(obj, name: str) -> Callable:
    """``getattr(obj, name)`` called through a weak reference (no cycle through autograd state)."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        if target is not None:
            return getattr(target, name)(*args)
        return None

    return call
