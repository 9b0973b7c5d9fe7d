"""What a captured step cannot see change, checked before every replay.

[Note: changes a graph cannot see]
A replay repeats the kernels of its capture with the values they read from memory, so a change made
in memory (an lr held as a tensor and filled by a scheduler, weights loaded in place by
``load_checkpoint``) is seen, and a change made in Python is not:
* a hyperparameter held as a Python number (``param_groups[i]["lr"] = 1e-4``, a scheduler on a float
  lr, a new param group): the capture baked the old number into its kernels;
* ``requires_grad_()`` on a parameter: the capture reduces and steps the old set;
* ``optimizer.load_state_dict``: torch makes new state tensors, the graph writes the old ones;
* a ``.grad`` set to None or replaced outside the step: the graph writes the buffer the old one viewed.
``CaptureWatch`` records these at capture and ``changed()`` names the first that moved, so the step
runs eagerly once and is captured again (graphs/graphed_step.py): never a silent stale replay.
Checking costs one comparison per optimizer hyperparameter and two per parameter, on the host.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["CaptureWatch"]


def _hyperparameters(optimizers: Sequence) -> tuple:
    """Every optimizer's param groups without their parameters; a tensor value by identity (its
    contents are read by the graph, its object is not)."""
    return tuple(
        tuple((key, id(value) if isinstance(value, torch.Tensor) else value)
              for key, value in sorted(group.items()) if key != "params")
        + (len(group["params"]),)
        for optimizer in optimizers for group in optimizer.param_groups)


class CaptureWatch:
    """The Python-side state a capture baked in, and the check that it still holds."""

    optimizers: list
    params: list[nn.Parameter]             # the models' parameters, as the optimizers see them
    _hyper: tuple                          # _hyperparameters at capture
    _requires_grad: tuple                  # each parameter's requires_grad at capture
    _grads: tuple                          # each parameter's .grad object at capture
    _loads: int                            # optimizer state loads since the watch began
    _loads_at_capture: int
    _handles: list

    def __init__(self, models: Sequence[nn.Module], optimizers: Sequence) -> None:
        self.optimizers = list(optimizers)
        self.params = [p for model in models for p in model.parameters()]
        self._loads = self._loads_at_capture = 0
        ref = weakref.ref(self)
        self._handles = [opt.register_load_state_dict_post_hook(lambda _opt: ref() and ref()._loaded())
                         for opt in self.optimizers]
        self.record()

    def _loaded(self) -> None:
        self._loads += 1

    def record(self) -> None:
        """Take the state a capture is about to bake in."""
        self._hyper = _hyperparameters(self.optimizers)
        self._requires_grad = tuple(p.requires_grad for p in self.params)
        self._grads = tuple(p.grad for p in self.params)
        self._loads_at_capture = self._loads

    def changed(self) -> Optional[str]:
        """What changed since ``record`` (the first found), or None."""
        if self._loads != self._loads_at_capture:
            return "the optimizer's state was loaded (load_state_dict)"
        if _hyperparameters(self.optimizers) != self._hyper:
            return "an optimizer hyperparameter held as a Python number changed (e.g. param_groups[i]['lr'])"
        if any(p.requires_grad is not flag for p, flag in zip(self.params, self._requires_grad)):
            return "a parameter's requires_grad changed"
        if any(p.grad is not grad for p, grad in zip(self.params, self._grads)):
            return "a parameter's .grad was replaced or set to None outside the step"
        return None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
