"""Choosing a candidate: the fewest bytes moved per step among those whose planned memory fits.

Bytes sent (ring algorithms) rather than bytes covered: an all-reduce sends twice what a
reduce-scatter of the same buffer does, so DDP and ZeRO-1 tie, as they do on the wire. Offload
candidates (``plan(..., offload_fractions=...)``) add what crosses the host link per step, so
offload is chosen only where it lets a plan fit or saves more network bytes than it copies.
Planned memory is ``fit_bytes``: the peak with activations when ``activation_bytes`` was given,
else the kept bytes plus our temporaries' peak, and at least the optimizer step's peak (its
kernel's temporaries on the kept bytes). Ties (bytes within ``PADDING_TIE`` of the fewest) go to
the smaller planned peak, then to the order of the strategy table (less sharding first). Every
input is the same on every rank (the model, checked by ``fully_shard``; the budget, agreed on
by the caller), so every rank chooses the same.
"""

from __future__ import annotations

from .report import StrategyPlan, format_bytes

__all__ = ["NoPlanFitsError", "PADDING_TIE", "choose"]

# Bytes within this fraction of the fewest tie: the layouts pad differently (no_shard's one buffer,
# the sharded strategies' torch.chunk pieces of every parameter: under 0.3% on LLM shapes), and a
# difference of padding must not buy a plan that keeps dp times the optimizer state.
PADDING_TIE = 0.01


class NoPlanFitsError(ValueError):
    """No candidate's planned memory fits the budget."""


def choose(candidates: list, budget_bytes: int) -> tuple[StrategyPlan, "StrategyPlan | None"]:
    """(chosen, runner-up) among ``candidates`` (in table order); raises ``NoPlanFitsError``
    naming the smallest plan when none fits."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}.")
    fitting = [c for c in candidates if c.fit_bytes <= budget_bytes]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.fit_bytes)
        activations = ("" if smallest.activation_bytes is None
                       else f"; with {format_bytes(smallest.activation_bytes)} of activations at the start of backward")
        raise NoPlanFitsError(
            f"budget_bytes: no sharding plan fits {format_bytes(budget_bytes)} ({budget_bytes} bytes) per rank; "
            f"the smallest is {smallest.name} at {format_bytes(smallest.fit_bytes)} ({smallest.fit_bytes} bytes: "
            f"{format_bytes(smallest.persistent_bytes)} kept + {format_bytes(smallest.temporaries['peak'])} "
            f"temporaries{activations}; its {smallest.optimizer_kernel} optimizer step "
            f"{format_bytes(smallest.step_peak_bytes)}). Use more ranks, a smaller model or a larger budget "
            f"(less activation reserve).")
    order = {id(c): i for i, c in enumerate(candidates)}
    fewest = min(c.moved_bytes for c in fitting)
    ranked = sorted(fitting, key=lambda c: (c.moved_bytes > fewest * (1 + PADDING_TIE), c.moved_bytes
                                            if c.moved_bytes > fewest * (1 + PADDING_TIE) else 0,
                                            c.fit_bytes, order[id(c)]))
    return ranked[0], (ranked[1] if len(ranked) > 1 else None)
