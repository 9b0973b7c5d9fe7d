"""A reading of what is alive, taken once it has settled -- FOR THE TESTS ONLY.

Tests that count every live tensor after a step can see something released a moment late (a
backend's thread dropping a finished collective's tensors): loaded full-suite runs counted a few
bytes more on rank 1, once in ``test_lifetime``, twice in ``test_plan_offload`` and once in
``test_robustness``'s long run (32 bytes at step 100 over step 2), never when run alone. That is not
a leak, which stays on every reading.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, TypeVar

__all__ = ["settled"]

T = TypeVar("T")


def settled(read: Callable[[], T], key: Callable[[T], object] = lambda reading: reading,
            tries: int = 40, pause_s: float = 0.05) -> T:
    """``read()`` after ``gc.collect()``, again until two readings ``pause_s``+ apart agree (by ``key``),
    at most ``tries`` times with growing pauses; the last reading."""
    last = reading = None
    for attempt in range(tries):
        reading = None                      # a reading may hold what it found: drop it before the next
        gc.collect()
        reading = read()
        if attempt and key(reading) == last:
            break
        last = key(reading)
        time.sleep(pause_s * (1 + attempt))
    return reading
