"""The plan's records and its table: what one strategy (and hybrid shape) costs a rank per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..comm import COLLECTIVES

__all__ = ["Plan", "StrategyPlan", "format_bytes"]


def format_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class StrategyPlan:
    """One candidate: a strategy over ``shape = (outer, inner)`` ranks (outer 1: flat).

    Attributes:
        ranks: per shard rank (the outer replicas hold the same), ``{kind: bytes}`` kept between
            steps: ``model_weights``, ``main_weights``, ``grads``, ``optimizer_state``, ``total``,
            and ``padding`` (inside the first three).
        temporaries: peak bytes of one step's temporaries, the same on every rank:
            ``gathered_weights`` (ZeRO-3's gathered and prefetched units), ``reduce_inputs``,
            ``held_grads`` (ZeRO-2/3's unreduced gradients), ``storage_freeing`` and
            ``trace_pool`` (what each allocator holds at its peak: live bytes / its pool) and
            ``peak`` (all of them together at the worst moment).
        comm: the collectives of one step, in ``comm_stats()``'s form.
        wire_bytes: bytes a rank sends per step (ring algorithms), shard and outer groups.
    """

    strategy: str
    shape: tuple
    ranks: tuple
    temporaries: dict
    comm: dict
    wire_bytes: int

    @property
    def persistent_bytes(self) -> int:
        """The largest rank's bytes kept between steps, optimizer state included."""
        return max(rank["total"] for rank in self.ranks)

    @property
    def peak_bytes(self) -> int:
        """Planned memory: the largest rank's persistent bytes plus the peak of our temporaries
        (activations are the caller's ``activation_reserve_bytes``)."""
        return self.persistent_bytes + self.temporaries["peak"]

    @property
    def name(self) -> str:
        outer, inner = self.shape
        return self.strategy if outer == 1 and "across_replicas" not in self.comm else f"{self.strategy} {outer}x{inner}"

    def row(self) -> list:
        rank = max(self.ranks, key=lambda r: r["total"])
        cells = [self.name] + [format_bytes(rank[k]) for k in
                               ("model_weights", "main_weights", "grads", "optimizer_state", "padding", "total")]
        cells += [format_bytes(self.temporaries[k]) for k in
                  ("gathered_weights", "reduce_inputs", "held_grads", "trace_pool", "peak")]
        cells.append(format_bytes(self.peak_bytes))
        for name in COLLECTIVES[:3]:
            cells.append(f"{self.comm[name]['count']} / {format_bytes(self.comm[name]['bytes'])}")
        outer = self.comm.get("across_replicas")
        cells.append(f"{outer['all_reduce']['count']} / {format_bytes(outer['all_reduce']['bytes'])}" if outer else "-")
        cells.append(format_bytes(self.wire_bytes))
        return cells


HEADER = ["strategy", "weights", "main", "grads", "optimizer", "(padding)", "kept", "gathered", "reduce in",
          "held grads", "trace pool", "temp peak", "peak", "all-gather", "reduce-scatter", "all-reduce",
          "outer all-reduce", "sent/rank"]


@dataclass(frozen=True)
class Plan:
    """Per-rank memory and communication of each candidate; ``str()`` is the table.

    ``chosen`` / ``runner_up``: with a budget, the candidate fitting it that sends the fewest
    bytes (ties: the smaller peak) and the next one (None if only one fits)."""

    candidates: tuple
    micro_batches: int
    optimizer: str
    budget_bytes: Optional[int] = None
    chosen: Optional[StrategyPlan] = None
    runner_up: Optional[StrategyPlan] = None

    def __getitem__(self, name: str) -> StrategyPlan:
        for candidate in self.candidates:
            if name in (candidate.name, candidate.strategy):
                return candidate
        raise KeyError(f"no candidate named {name!r}; candidates: {[c.name for c in self.candidates]}.")

    def __str__(self) -> str:
        rows = [HEADER] + [c.row() for c in self.candidates]
        widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
        lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"per rank, one step of {self.micro_batches} micro-batch(es), {self.optimizer}; "
                     "collectives: calls / bytes covered; sent/rank: ring algorithms; activations not included")
        if self.budget_bytes is not None:
            lines.append(f"budget {format_bytes(self.budget_bytes)}: chosen {self.chosen.name}"
                         + (f", runner-up {self.runner_up.name}" if self.runner_up else ""))
        return "\n".join(lines)
