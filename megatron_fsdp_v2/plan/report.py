"""The plan's records and its table: what one strategy (and hybrid shape) costs a rank per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..comm import COLLECTIVES
from .phases import peak_with_activations

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
        offload_fraction: ``OffloadPolicy.fraction`` planned (None: no offload); the ranks' host
            kinds (``host_main_weights``, ``host_grads``, ``host_grad_staging``,
            ``host_optimizer_state``, ``host_total``) are pinned host memory.
        transfers: per step, ``{"d2h_grads": {"count", "bytes"}, "h2d_weights": {...}}`` over
            the host link (plan/offload.py).
        phases: our device bytes at ``forward_end``, ``last_unit_backward`` and ``step``
            (plan/phases.py, [Note: the peak with activations]).
        activation_bytes: the activation peak given to ``plan`` (None: not given).
        optimizer_kernel: the optimizer kernel planned for: ``"foreach"`` (torch's default on
            CUDA), ``"fused"`` or ``"single"``.
        step_temporaries: per shard rank, the device bytes that kernel's ``optimizer.step()``
            allocates beyond the kept bytes (plan/optimizer_step.py, [Note: the optimizer step's
            temporaries]); not in ``phases["step"]`` nor ``peak_bytes``, in ``step_peak_bytes``
            and so in ``fit_bytes``.

    Every number is allocated bytes (tensor sizes), not reserved memory: docs/planning.md,
    "Allocated, not reserved", says what the caching allocator adds.
    """

    strategy: str
    shape: tuple
    ranks: tuple
    temporaries: dict
    comm: dict
    wire_bytes: int
    offload_fraction: Optional[float] = None
    transfers: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)
    activation_bytes: Optional[int] = None
    optimizer_kernel: str = "foreach"
    step_temporaries: tuple = ()

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
    def peak_with_activations(self) -> Optional[int]:
        """With ``activation_bytes``: the planned peak of a step, activations included
        ([Note: the peak with activations]); None without."""
        if self.activation_bytes is None:
            return None
        return peak_with_activations(self.phases, self.peak_bytes, self.activation_bytes)

    @property
    def step_temporaries_bytes(self) -> int:
        """The largest rank's ``step_temporaries``."""
        return max(self.step_temporaries, default=0)

    @property
    def step_peak_bytes(self) -> int:
        """The optimizer step's peak: the kept bytes at the step plus the kernel's temporaries."""
        return self.phases["step"] + self.step_temporaries_bytes

    @property
    def fit_bytes(self) -> int:
        """What must fit the budget: ``peak_with_activations`` if activations were given, else
        ``peak_bytes``; and the optimizer step's peak."""
        with_activations = self.peak_with_activations
        return max(self.peak_bytes if with_activations is None else with_activations, self.step_peak_bytes)

    @property
    def host_bytes(self) -> int:
        """The largest rank's pinned host bytes (offload)."""
        return max(rank["host_total"] for rank in self.ranks)

    @property
    def transfer_bytes(self) -> int:
        return sum(t["bytes"] for t in self.transfers.values())

    @property
    def moved_bytes(self) -> int:
        """Bytes a rank moves per step: sent over the network (``wire_bytes``) and over the host link."""
        return self.wire_bytes + self.transfer_bytes

    @property
    def name(self) -> str:
        outer, inner = self.shape
        name = self.strategy if outer == 1 and "across_replicas" not in self.comm else f"{self.strategy} {outer}x{inner}"
        return name if self.offload_fraction is None else f"{name} offload {self.offload_fraction:g}"

    def row(self) -> list:
        rank = max(self.ranks, key=lambda r: r["total"])
        cells = [self.name] + [format_bytes(rank[k]) for k in
                               ("model_weights", "main_weights", "grads", "optimizer_state", "padding", "total")]
        cells += [format_bytes(self.temporaries[k]) for k in
                  ("gathered_weights", "reduce_inputs", "held_grads", "trace_pool", "peak")]
        cells += [format_bytes(self.peak_bytes), format_bytes(self.step_temporaries_bytes)]
        for name in COLLECTIVES[:3]:
            cells.append(f"{self.comm[name]['count']} / {format_bytes(self.comm[name]['bytes'])}")
        outer = self.comm.get("across_replicas")
        cells.append(f"{outer['all_reduce']['count']} / {format_bytes(outer['all_reduce']['bytes'])}" if outer else "-")
        cells.append(format_bytes(self.wire_bytes))
        cells += [format_bytes(self.host_bytes), format_bytes(self.transfer_bytes)]
        if self.activation_bytes is not None:
            cells.append(format_bytes(self.peak_with_activations))
        return cells

    def as_dict(self) -> dict:
        """Every number of the wide table, in bytes (``plan --json``): the records as they are, plus
        the derived totals, so a script reads the plan without parsing a table."""
        return {"name": self.name, "strategy": self.strategy, "shape": list(self.shape),
                "offload_fraction": self.offload_fraction, "ranks": [dict(r) for r in self.ranks],
                "temporaries": dict(self.temporaries), "comm": self.comm, "wire_bytes": self.wire_bytes,
                "transfers": self.transfers, "phases": dict(self.phases),
                "activation_bytes": self.activation_bytes, "optimizer_kernel": self.optimizer_kernel,
                "step_temporaries": list(self.step_temporaries),
                "step_temporaries_bytes": self.step_temporaries_bytes, "persistent_bytes": self.persistent_bytes,
                "peak_bytes": self.peak_bytes, "peak_with_activations": self.peak_with_activations,
                "step_peak_bytes": self.step_peak_bytes, "fit_bytes": self.fit_bytes,
                "host_bytes": self.host_bytes, "moved_bytes": self.moved_bytes}


#: What the table's bytes leave out of reserved memory (docs/planning.md, "Allocated, not reserved").
RESERVED_LEGEND = ("bytes allocated (tensor sizes), not reserved: not in them are the caching allocator's rounding "
                   "and cached free blocks, the gradient pool holding grads' bytes after zero_grad frees them, "
                   "NCCL's buffers, the CUDA context, CUDA graphs' pools; step temps: what the optimizer kernel's "
                   "step adds to the kept bytes (not in peak; fitted with them); docs/planning.md")

HEADER = ["strategy", "weights", "main", "grads", "optimizer", "(padding)", "kept", "gathered", "reduce in",
          "held grads", "trace pool", "temp peak", "peak", "step temps", "all-gather", "reduce-scatter", "all-reduce",
          "outer all-reduce", "sent/rank", "host kept", "host link"]


@dataclass(frozen=True)
class Plan:
    """Per-rank memory and communication of each candidate; ``str()`` is the table.

    ``chosen`` / ``runner_up``: with a budget, the candidate fitting it that moves the fewest
    bytes (ties: the smaller peak) and the next one (None if only one fits)."""

    candidates: tuple
    micro_batches: int
    optimizer: str
    budget_bytes: Optional[int] = None
    chosen: Optional[StrategyPlan] = None
    runner_up: Optional[StrategyPlan] = None
    optimizer_kernel: str = "foreach"

    def __getitem__(self, name: str) -> StrategyPlan:
        for candidate in self.candidates:
            if name in (candidate.name, candidate.strategy):
                return candidate
        raise KeyError(f"no candidate named {name!r}; candidates: {[c.name for c in self.candidates]}.")

    def as_dict(self) -> dict:
        """The plan as plain data (``python -m megatron_fsdp_v2.plan --json``)."""
        return {"micro_batches": self.micro_batches, "optimizer": self.optimizer,
                "optimizer_kernel": self.optimizer_kernel, "budget_bytes": self.budget_bytes,
                "chosen": self.chosen.name if self.chosen else None,
                "runner_up": self.runner_up.name if self.runner_up else None,
                "candidates": [c.as_dict() for c in self.candidates]}

    def __str__(self) -> str:
        with_activations = any(c.activation_bytes is not None for c in self.candidates)
        rows = [HEADER + (["peak +act"] if with_activations else [])] + [c.row() for c in self.candidates]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"per rank, one step of {self.micro_batches} micro-batch(es), {self.optimizer} "
                     f"({self.optimizer_kernel} kernel); "
                     "collectives: calls / bytes covered; sent/rank: ring algorithms; host link: offload's "
                     "copies per step; " + ("peak +act: with the given activations"
                                            if with_activations else "activations not included"))
        lines.append(RESERVED_LEGEND)
        if self.budget_bytes is not None:
            lines.append(f"budget {format_bytes(self.budget_bytes)}: chosen {self.chosen.name}"
                         + (f", runner-up {self.runner_up.name}" if self.runner_up else ""))
        return "\n".join(lines)
