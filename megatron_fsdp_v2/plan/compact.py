"""The plan's compact table: what decides a strategy, within 100 columns.

``python -m megatron_fsdp_v2.plan`` prints it by default; ``str(Plan)`` (``--wide``) is the full
table, every kind of bytes and every collective. Kept here, per candidate: the persistent bytes
(``kept``), the planned ``peak`` (the larger of our temporaries' peak and the optimizer step's,
and ``peak +act`` with activations: what a budget must hold, ``fit_bytes``), the bytes moved per step
(sent over the network plus offload's host-link copies: what ``auto`` minimizes), the pinned host
bytes with offload, and against a budget whether the plan fits and which one is chosen.
"""

from __future__ import annotations

import textwrap

from .report import format_bytes

__all__ = ["COMPACT_WIDTH", "compact_table"]

#: The widest a line of the compact table may be.
COMPACT_WIDTH = 100


def _columns(plan) -> list:
    """``(header, cell of a candidate)`` of the columns this plan needs: optional ones only when
    their inputs were given (activations, offload, a budget), so the common case stays narrow."""
    columns = [("strategy", lambda c: c.name), ("kept", lambda c: format_bytes(c.persistent_bytes)),
               ("peak", lambda c: format_bytes(max(c.peak_bytes, c.step_peak_bytes)))]
    if any(c.activation_bytes is not None for c in plan.candidates):
        columns.append(("peak +act", lambda c: format_bytes(c.fit_bytes)))
    columns.append(("moved/step", lambda c: format_bytes(c.moved_bytes)))
    if any(c.offload_fraction is not None for c in plan.candidates):
        columns.append(("host kept", lambda c: format_bytes(c.host_bytes)))
    if plan.budget_bytes is not None:
        columns.append(("fits", lambda c: _fits(plan, c)))
    return columns


def _fits(plan, candidate) -> str:
    """``chosen`` / ``yes`` / ``no``: the budget check ``auto`` makes (``fit_bytes``)."""
    if candidate is plan.chosen:
        return "chosen"
    return "yes" if candidate.fit_bytes <= plan.budget_bytes else "no"


def compact_table(plan) -> str:
    """The ``Plan``'s table narrowed to the columns above, with its legend wrapped to fit."""
    columns = _columns(plan)
    with_activations = any(c.activation_bytes is not None for c in plan.candidates)
    rows = [[header for header, _ in columns]] + [[cell(c) for _, cell in columns] for c in plan.candidates]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    legend = (f"per rank, one step of {plan.micro_batches} micro-batch(es), {plan.optimizer} ({plan.optimizer_kernel} "
              "kernel); kept: between steps; peak: kept + our temporaries, or at the optimizer step kept + its "
              "kernel's temporaries where more; moved/step: sent (ring algorithms) + host-link copies; "
              + ("peak +act: with the given activations" if with_activations else
                 "activations not included") + "; allocated bytes, not reserved (docs/planning.md); --wide or "
              "--json: every column")
    lines += textwrap.wrap(legend, COMPACT_WIDTH)
    if plan.budget_bytes is not None:
        lines += textwrap.wrap(f"budget {format_bytes(plan.budget_bytes)}: chosen {plan.chosen.name}"
                               + (f", runner-up {plan.runner_up.name}" if plan.runner_up else ""), COMPACT_WIDTH)
    return "\n".join(lines)
