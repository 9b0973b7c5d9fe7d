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
from functools import partial
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from ..group.param_group import ParamGroup


class ForwardRecord:
    """One forward of one unit: in which backward (by index) its pre-backward ran, if any."""

    __slots__ = ("backward_index",)

    def __init__(self) -> None:
        self.backward_index: Optional[int] = None


class _SavedWeight:
    """A tensor autograd saved from a unit's gathered weights, the group it came from, the forward
    that saved it and what to call when a backward node unpacks it."""

    __slots__ = ("tensor", "group", "record", "on_unpack")

    def __init__(self, tensor: torch.Tensor, group: "ParamGroup", record: ForwardRecord,
                 on_unpack: Callable[[ForwardRecord, object], None]) -> None:
        self.tensor = tensor
        self.group = group
        self.record = record
        self.on_unpack = on_unpack


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


def _weight_ranges(groups: "list[ParamGroup]") -> list[tuple[int, int, object]]:
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

    [Note: what the hooks hold]
    The two callables handed to autograd hold nothing of the model: the pack hook reaches this
    object through a weak reference and the unpack hook is a plain function of the packed object.
    torch copies the thread's saved-tensor hooks into state it keeps beyond the forward (an async
    gloo collective issued inside the forward, e.g. ZeRO-3's prefetch of the next unit, was seen to
    keep them after the work had been waited for and dropped), so a strong reference from a hook
    to the gathered groups kept a deleted model's parameters alive.
    """

    def __init__(self, on_unpack: Callable[[ForwardRecord, "ParamGroup"], None], groups: "list[ParamGroup]",
                 record: ForwardRecord) -> None:
        self._ranges = _weight_ranges(groups)
        self._record = record
        self._on_unpack = on_unpack
        self._context = torch.autograd.graph.saved_tensors_hooks(partial(_pack_through, weakref.ref(self)),
                                                                 _unpack)

    def enter(self) -> None:
        self._context.__enter__()

    def exit(self) -> None:
        self._context.__exit__(None, None, None)

    def pack(self, tensor: torch.Tensor):
        # [Note: what a pack hook may keep] A tensor with a ``grad_fn`` is kept detached: when
        # autograd saves a node's own *output* (tanh, exp, ...), keeping the tensor would make the
        # node hold, through C++ state the cycle collector cannot see, a tensor holding the node;
        # a forward whose backward never runs would then keep its whole graph (and through the
        # packed groups the model's parameters) alive forever (torch's saved_tensors_hooks: "the
        # return value of pack_hook cannot hold a reference to the input tensor"). The detached
        # tensor shares storage and version counter; autograd re-attaches the history at unpack.
        # A leaf (a module's parameter) holds no graph and is kept as is, so that at unpack it
        # reads the weights the unit gathered again.
        kept = _without_history(tensor)
        try:
            address = tensor.data_ptr()
        except RuntimeError:      # tensors without storage (e.g. some subclasses) are never weights
            return kept
        for start, end, group in self._ranges:
            if start <= address < end:
                return _SavedWeight(kept, group, self._record, self._on_unpack)
        return kept


def _without_history(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.grad_fn is None else tensor.detach()


def _pack_through(hooks_ref: "weakref.ref[SavedWeightHooks]", tensor: torch.Tensor):
    hooks = hooks_ref()
    return _without_history(tensor) if hooks is None else hooks.pack(tensor)


def _unpack(packed):
    if isinstance(packed, _SavedWeight):
        packed.on_unpack(packed.record, packed.group)
        return packed.tensor
    return packed
