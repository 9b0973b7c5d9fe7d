"""A group's reduced-gradient buffer, alive as long as something uses it.

[Note: gradient buffers live as long as .grad]
FSDP2 frees a parameter's gradient when ``optimizer.zero_grad(set_to_none=True)`` drops it, so the
activation peak of the next forward finds no gradient memory. Here a group keeps only a weak
reference to its gradient buffer after attaching the ``.grad`` views (``hand_to_views``): when the
optimizer drops every view the buffer is freed, and the next backward allocates a zeroed one as
late as possible (ZeRO-2/3: when the group's first reduce-scatter lands; DDP/ZeRO-1: at its first
gradient). A ``.grad`` the user keeps, ``set_to_none=False`` or a further backward before
``step()`` keeps the buffer alive and everything accumulates as before. With ``persistent``
(Megatron's ``main_grad``) the buffer is always held.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["GradBuffer"]


class GradBuffer:
    """One flat gradient buffer of ``numel`` elements, held strongly or (handed to views) weakly."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.persistent = True
        self._held: Optional[torch.Tensor] = None
        self._weak: Optional[weakref.ref] = None

    def live(self) -> Optional[torch.Tensor]:
        """The buffer if anything still holds it, else None."""
        if self._held is not None:
            return self._held
        return self._weak() if self._weak is not None else None

    def ensure(self) -> tuple[torch.Tensor, bool]:
        """``(buffer, fresh)``: the buffer, held strongly again; a new zeroed one (``fresh``) if it
        was freed."""
        buffer = self.live()
        fresh = buffer is None
        if fresh:
            buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self._held, self._weak = buffer, None
        return buffer, fresh

    def hand_to_views(self) -> None:
        """Unless ``persistent``: from now on only the views taken of the buffer hold it."""
        if self.persistent or self._held is None:
            return
        self._weak, self._held = weakref.ref(self._held), None

    def let_go(self) -> None:
        """Forget the buffer (unless ``persistent``) without touching it: views others keep stay
        as they are, and the next ``ensure`` starts a new one."""
        if not self.persistent:
            self._held = self._weak = None
