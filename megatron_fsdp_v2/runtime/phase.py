"""Where a wrapped model is in its training step, with the allowed moves checked.

The hooks of ``engine.py`` fire in an order that torch decides (module hooks, autograd hooks, the
autograd engine's final callback). A hook firing in a phase it does not expect means a misuse or a
bug; corrupting buffers silently is the worst outcome, so every change of phase goes through
``PhaseMachine.enter`` and an illegal one raises, naming the phase it found.

    IDLE ----------> FORWARD --------> AWAITING_BACKWARD[_NO_SYNC] ----> BACKWARD ----> IDLE
      ^  (root pre-forward) (root post-forward,     (first backward hook)   (final callback)
      |                      grad-requiring output)
      +------------------------------------------ reset_iteration (any phase) ---------+

Also allowed: FORWARD -> IDLE (evaluation forward, or an output without gradient),
AWAITING_BACKWARD -> FORWARD (another forward before the backward, e.g. two losses summed),
AWAITING_BACKWARD_NO_SYNC -> FORWARD while still inside ``no_sync()`` (pipeline schedules run
several micro-batches' forwards before their backwards, all of them without gradient sync; a
forward *outside* ``no_sync()`` there is refused: the earlier micro-batch's gradients would then be
reduced by one backward and accumulated again by the other),
IDLE -> BACKWARD (a second backward through a retained graph), FORWARD -> BACKWARD and
BACKWARD -> BACKWARD (a backward inside a forward, e.g. ``torch.autograd.grad`` in a loss, or
a recomputing forward inside backward).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    AWAITING_BACKWARD = "awaiting backward"                    # a training forward's output is out
    AWAITING_BACKWARD_NO_SYNC = "awaiting backward (no_sync)"  # ... and its gradients reduce later
    BACKWARD = "backward"


_ALLOWED = {
    Phase.IDLE: {Phase.FORWARD, Phase.BACKWARD},
    Phase.FORWARD: {Phase.IDLE, Phase.AWAITING_BACKWARD, Phase.AWAITING_BACKWARD_NO_SYNC, Phase.BACKWARD},
    Phase.AWAITING_BACKWARD: {Phase.FORWARD, Phase.BACKWARD},
    Phase.AWAITING_BACKWARD_NO_SYNC: {Phase.FORWARD, Phase.BACKWARD},
    Phase.BACKWARD: {Phase.IDLE, Phase.BACKWARD},
}


class PhaseMachine:
    """The current ``Phase``; ``enter`` checks the move against the diagram above."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def enter(self, new: Phase, gradient_sync: bool = True) -> None:
        """Move to ``new``; ``gradient_sync``: whether gradients reduce now (False inside ``no_sync()``)."""
        pipelined = self.phase is Phase.AWAITING_BACKWARD_NO_SYNC and new is Phase.FORWARD and not gradient_sync
        if new is not self.phase and (new not in _ALLOWED[self.phase] or
                                      (self.phase is Phase.AWAITING_BACKWARD_NO_SYNC and new is Phase.FORWARD
                                       and not pipelined)):
            raise RuntimeError(f"{self._misuse(new)} (found phase {self.phase.value!r}, asked for {new.value!r}).")
        self.phase = new

    def reset(self) -> None:
        """Back to IDLE from anywhere: only ``reset_iteration`` may do this."""
        self.phase = Phase.IDLE

    def is_(self, *phases: Phase) -> bool:
        return self.phase in phases

    def _misuse(self, new: Phase) -> str:
        if self.phase is Phase.AWAITING_BACKWARD_NO_SYNC and new is Phase.FORWARD:
            return ("forward called again before the backward of the previous forward, which ran inside "
                    "no_sync(), and this forward runs outside it: that micro-batch's gradients would be reduced "
                    "twice. Run backward on every micro-batch's output before the next forward, or keep every "
                    "forward but the last backward's inside no_sync() (as pipeline schedules do); evaluation "
                    "forwards belong under torch.no_grad()")
        return "the training step's hooks fired out of order"
