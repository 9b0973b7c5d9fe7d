"""``fully_shard(sharding_strategy="auto")``: plan every strategy for the given groups and take
the one ``auto.choose`` picks, the same on every rank.

[Note: one choice on every rank]
The plan reads only the model's shapes and the arguments, which ``fully_shard`` checks to be the
same on every rank; the one input that can differ is the device's memory, so the budget is the
smallest over the data-parallel ranks (one scalar all-reduce per group, issued by every rank
before anything can raise). Every rank then computes the same plans and either takes the same
strategy or raises the same ``NoPlanFitsError``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..strategy import STRATEGY_NAMES, ShardingStrategy, get_strategy
from .auto import choose
from .memory import OPTIMIZER_STATE_COPIES
from .optimizer_step import check_step_kernel
from .planner import plan_candidates
from .report import format_bytes

__all__ = ["AutoStrategy", "resolve_auto_strategy"]

logger = logging.getLogger("megatron_fsdp_v2")


@dataclass(frozen=True)
class AutoStrategy:
    """What ``sharding_strategy="auto"`` plans for.

    Attributes:
        budget_bytes: memory per rank the model's states and our temporaries may take; ``None``:
            the device's total memory minus ``activation_reserve_bytes`` (the smallest over ranks).
        activation_reserve_bytes: left for activations and everything not ours (with
            ``budget_bytes=None`` only).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd_momentum"`` or ``"sgd"`` (its state is planned).
        micro_batches: per optimizer step.
        optimizer_kernel: ``"foreach"`` (torch's default on CUDA), ``"fused"`` or ``"single"``:
            the optimizer step's temporaries must fit too (plan/optimizer_step.py).
        activation_bytes: the model's activation peak, measured without any wrapper: plans are
            then compared by their peak with activations (``plan``'s ``activation_bytes``), so
            ``activation_reserve_bytes`` can be 0.
    """

    budget_bytes: Optional[int] = None
    activation_reserve_bytes: int = 0
    optimizer: str = "adam"
    micro_batches: int = 1
    activation_bytes: Optional[int] = None
    optimizer_kernel: str = "foreach"

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "activation_reserve_bytes", "micro_batches", "activation_bytes"):
            value = getattr(self, name)
            if value is None and name in ("budget_bytes", "activation_bytes"):
                continue
            low = 1 if name in ("budget_bytes", "micro_batches") else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"AutoStrategy.{name} must be an int >= {low}, got {value!r}.")
        if self.optimizer not in OPTIMIZER_STATE_COPIES:
            raise ValueError(f"AutoStrategy.optimizer must be one of {list(OPTIMIZER_STATE_COPIES)}, "
                             f"got {self.optimizer!r}.")
        check_step_kernel(self.optimizer_kernel, "AutoStrategy.optimizer_kernel")


def device_total_memory(device: torch.device) -> int:
    """Total bytes of ``device`` (a GPU's, or the host's physical memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _agreed_budget(options: AutoStrategy, comms: list, device: torch.device) -> int:
    """[Note: one choice on every rank]: the smallest budget over the ranks."""
    if options.budget_bytes is not None:
        mine = options.budget_bytes
    else:
        mine = device_total_memory(device) - options.activation_reserve_bytes
    value = torch.tensor([mine], dtype=torch.int64, device=device)
    for comm in comms:
        if comm is not None and comm.size > 1:
            comm.all_reduce(value, label="memory budget (sharding_strategy='auto')", op=dist.ReduceOp.MIN)
    budget = int(value.item())
    if budget <= 0:
        raise ValueError(f"auto_strategy: the budget is {budget} bytes (device memory minus "
                         f"activation_reserve_bytes={options.activation_reserve_bytes}); reserve less.")
    return budget


def resolve_auto_strategy(module: nn.Module, options, comm, replicas, device: torch.device) -> ShardingStrategy:
    """The strategy with the fewest bytes moved per step whose planned memory fits (auto.py), with
    the settings ``fully_shard`` was given (``options``: its ``WrapOptions``; ``options.auto_strategy``
    or ``AutoStrategy()`` says what to plan for)."""
    if not isinstance(options.auto_strategy, (AutoStrategy, type(None))):    # the same on every rank
        raise TypeError(f"auto_strategy must be an AutoStrategy or None, got {type(options.auto_strategy).__name__}.")
    auto = options.auto_strategy or AutoStrategy()
    budget = _agreed_budget(auto, [comm, replicas], device)
    shape = None if replicas is None else (replicas.size, comm.size)
    world = comm.size * (1 if replicas is None else replicas.size)
    candidates = plan_candidates(module, STRATEGY_NAMES, world, shape, options, optimizer=auto.optimizer,
                                 micro_batches=auto.micro_batches, device=device.type,
                                 activation_bytes=auto.activation_bytes, optimizer_kernel=auto.optimizer_kernel)
    chosen, runner_up = choose(candidates, budget)
    announce_choice(chosen, runner_up, budget, comm.rank == 0 and (replicas is None or replicas.rank == 0))
    return get_strategy(chosen.strategy)


def announce_choice(chosen, runner_up, budget: int, first_rank: bool) -> None:
    """Say which strategy ``auto`` took and the runner-up, on the first rank only (every rank
    chooses the same: one line per job). A warning, as the package's other notices are, so that
    it shows without any logging set up: the choice changes what the run costs."""
    if not first_rank:
        return

    def describe(c):
        return f"{c.name} (peak {format_bytes(c.fit_bytes)}, sends {format_bytes(c.wire_bytes)}/step)"
    logger.warning("megatron_fsdp_v2: sharding_strategy='auto' chose %s within %s per rank; runner-up: %s",
                   describe(chosen), format_bytes(budget), describe(runner_up) if runner_up else "none fits")
