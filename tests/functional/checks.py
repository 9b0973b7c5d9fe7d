"""Assertion helpers: every rank gathers every rank's findings, so all ranks pass or fail together."""

from __future__ import annotations

from typing import Iterable, List

import pytest

from . import harness


def assert_no_failures(local_failures: Iterable[str], what: str) -> None:
    """Fail (on every rank) if any rank reported a failure; the message names the ranks."""
    gathered = harness.all_gather_object(list(local_failures))
    lines = [f"rank {rank}: {line}" for rank, failures in enumerate(gathered) for line in failures]
    if lines:
        shown = lines[:40] + ([f"... and {len(lines) - 40} more"] if len(lines) > 40 else [])
        pytest.fail(f"{what}:\n" + "\n".join(shown), pytrace=False)


def curve_table(got: List[float], want: List[float], label_got: str, label_want: str, limit: int = 8) -> str:
    """The worst iterations, for failure messages."""
    gaps = harness.relative_gaps(got, want)
    worst = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:limit]
    rows = [f"  iter {i:3d}: {label_want} {want[i]:.6f}  {label_got} {got[i]:.6f}  gap {100 * gaps[i]:.3f}%"
            for i in sorted(worst)]
    return "\n".join(rows)
