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
    Phase.AWAITING_BACKWARD_NO_SYNC: {Phase.BACKWARD},
    Phase.BACKWARD: {Phase.IDLE, Phase.BACKWARD},
}


class PhaseMachine:
    """The current ``Phase``; ``enter`` checks the move against the diagram above."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def enter(self, new: Phase) -> None:
        if new is not self.phase and new not in _ALLOWED[self.phase]:
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
                    "no_sync(): that micro-batch's gradients would be lost. Run backward on every micro-batch's "
                    "output before the next forward (evaluation forwards belong under torch.no_grad())")
        return "the training step's hooks fired out of order"
