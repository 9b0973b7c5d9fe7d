"""``plan``: per-rank memory and communication of ``fully_shard`` strategies, before launch.

The units, groups, dtypes and flat layouts are the ones ``fully_shard`` would build (groups.py
runs its code on shapes alone); memory.py sums them per kind, schedule.py replays one step's
temporaries and collectives. A model on the meta device is enough: no process group, no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from ..group.layout import default_alignment
from ..mixed_precision import MixedPrecisionPolicy
from ..offload.policy import OffloadPolicy
from ..strategy import STRATEGY_NAMES, ShardingStrategy, get_strategy
from .auto import choose
from .groups import planned_units
from .memory import OPTIMIZER_STATE_COPIES, rank_persistent_bytes
from .offload import backward_upload_transient, check_offload, host_transfers, offloaded_groups, upload_transients
from .optimizer_step import check_step_kernel, step_temporary_bytes
from .phases import check_activation_bytes, step_phases
from .report import Plan, StrategyPlan
from ..wrap.options import WrapOptions
from .schedule import ring_bytes, step_comm, step_temporaries

__all__ = ["plan", "plan_candidates"]


def _shapes(world_size: int, hybrid_shape) -> list:
    """Candidate (outer, inner) shapes; ``None`` in the list: flat over the world."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}.")
    choices = hybrid_shape if isinstance(hybrid_shape, list) else [hybrid_shape]
    out = []
    for shape in choices:
        if shape is None:
            out.append(None)
            continue
        if (not isinstance(shape, tuple) or len(shape) != 2 or
                not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)):
            raise ValueError(f"hybrid_shape must be None, an (outer, inner) pair of positive ints or a list of "
                             f"them, got {shape!r}.")
        if shape[0] * shape[1] != world_size:
            raise ValueError(f"hybrid_shape {shape} must multiply to world_size={world_size}.")
        out.append(shape)
    return out


def _check(module, optimizer, micro_batches, mixed_precision) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
    if getattr(module, "_fsdp_engine", None) is not None:     # wrapped by fully_shard already
        raise ValueError("module: plan takes the model before fully_shard wraps it (a meta-device copy is enough).")
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZER_STATE_COPIES)}, got {optimizer!r}.")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}.")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision must be a MixedPrecisionPolicy or None, got {type(mixed_precision).__name__}.")


def _buffer_bytes(module: nn.Module) -> list:
    """``(dtype, bytes)`` of each per-dtype broadcast ``broadcast_buffers`` sends (comm/collectives.py
    coalesces by dtype)."""
    by_dtype: dict = {}
    for buffer in module.buffers():
        if buffer.numel():
            by_dtype[buffer.dtype] = by_dtype.get(buffer.dtype, 0) + buffer.numel() * buffer.element_size()
    return list(by_dtype.items())


@dataclass(frozen=True)
class _Job:
    """What every candidate of one ``plan`` call shares."""

    optimizer: str
    optimizer_kernel: str
    micro_batches: int
    persistent_grads: bool
    activation_bytes: Optional[int]
    buffers: list
    uploads_in_backward: bool = False     # OffloadPolicy(step_in_backward=True)
    # with uploads in backward, the root's groups too (reduce_root_per_child, shards kept: the output
    # layer's at the start of backward; with release_after_gather the root's go up after the step)
    root_uploads_in_backward: bool = False


def _candidate(units: list, strategy: ShardingStrategy, shape, world_size: int, fraction, job: _Job) -> StrategyPlan:
    outer, inner = shape if shape is not None else (1, world_size)
    groups = [g for u in units for g in u.groups]
    offloaded = offloaded_groups(groups, fraction)
    k = job.micro_batches
    ranks = tuple(rank_persistent_bytes(groups, strategy, r, job.optimizer, offloaded, k) for r in range(inner))
    comm = step_comm(units, strategy, k, inner, None if shape is None else outer, job.buffers)
    wire = ring_bytes(comm, inner) + (ring_bytes(comm["across_replicas"], outer) if shape else 0)
    temporaries = step_temporaries(units, strategy, inner, k)
    full_grads = [] if strategy.grads_sharded else [g.layout.total_numel * g.dtypes.grad.itemsize if g.requires_grad
                                                   else 0 for g in groups]
    accumulation = sum(full_grads[i] for i in offloaded) if full_grads else 0
    temporaries["peak"] += accumulation          # offloaded DDP/ZeRO-1: the device buffer lands on the host
    root_groups = 0 if job.root_uploads_in_backward else sum(len(u.groups) for u in units if u.is_root)
    phases = step_phases(units, strategy, inner, max(ranks, key=lambda r: r["total"]), k, job.persistent_grads,
                         upload_transients(groups, offloaded, strategy), accumulation,
                         backward_upload_transient(groups, offloaded, strategy, root_groups, job.uploads_in_backward))
    kernel_bytes = tuple(step_temporary_bytes(groups, strategy, r, job.optimizer, job.optimizer_kernel, offloaded)
                         for r in range(inner))
    return StrategyPlan(strategy.name, (outer, inner), ranks, temporaries, comm, wire, fraction,
                        host_transfers(groups, offloaded, strategy, k), phases, job.activation_bytes,
                        job.optimizer_kernel, kernel_bytes)


def plan_candidates(module: nn.Module, strategies, world_size: int, hybrid_shape, options: WrapOptions, *,
                    optimizer: str, micro_batches: int, device: str, offload_fractions=None,
                    activation_bytes: Optional[int] = None, optimizer_kernel: str = "foreach") -> list[StrategyPlan]:
    """One ``StrategyPlan`` per (hybrid shape, strategy, offload fraction), in that order; the
    wrap settings are ``fully_shard``'s (``options``: a ``WrapOptions``, its strategy unused)."""
    offload = options.offload
    _check(module, optimizer, micro_batches, options.mixed_precision)
    if isinstance(strategies, (str, ShardingStrategy)):
        strategies = [strategies]
    strategies = [get_strategy(s, argument="strategies") for s in strategies]
    fractions = check_offload(offload, offload_fractions)
    if not isinstance(options.persistent_grads, bool):
        raise TypeError(f"persistent_grads must be True or False, got {options.persistent_grads!r}.")
    job = _Job(optimizer, check_step_kernel(optimizer_kernel), micro_batches, options.persistent_grads,
               check_activation_bytes(activation_bytes),
               _buffer_bytes(module) if options.broadcast_buffers else [],
               isinstance(offload, OffloadPolicy) and offload.step_in_backward,
               options.reduce_root_per_child and not (isinstance(offload, OffloadPolicy) and offload.release_after_gather))
    alignment = default_alignment(torch.device(device))
    out = []
    for shape in _shapes(world_size, hybrid_shape):
        if shape is not None and any(fractions):
            raise ValueError(f"offload: CPU offload with hybrid sharding is not supported (fully_shard refuses it); "
                             f"got hybrid_shape {shape} with offload fraction(s) {[f for f in fractions if f]}.")
        inner = shape[1] if shape is not None else world_size
        units = {each: planned_units(module, options.unit_modules, options.mixed_precision, inner, alignment,
                                     options.reduce_root_per_child, per_parameter=each,
                                     reshard_after_forward=options.reshard_after_forward)
                 for each in {s.shards_each_parameter for s in strategies}}
        for strategy in strategies:
            out += [_candidate(units[strategy.shards_each_parameter], strategy, shape, world_size, f, job)
                    for f in fractions]
    return out


def plan(module: nn.Module, strategies: Union[str, Sequence] = STRATEGY_NAMES, *, world_size: int = 1,
         hybrid_shape=None, mixed_precision: Optional[MixedPrecisionPolicy] = None, optimizer: str = "adam",
         micro_batches: int = 1, unit_modules: Optional[Sequence[type]] = None, device: str = "cuda",
         reduce_root_per_child: bool = False, broadcast_buffers: bool = True,
         budget_bytes: Optional[int] = None, offload: Optional[OffloadPolicy] = None,
         offload_fractions: Optional[Sequence[float]] = None, activation_bytes: Optional[int] = None,
         persistent_grads: bool = False, reshard_after_forward: Optional[bool] = True,
         optimizer_kernel: str = "foreach") -> Plan:
    """Per-rank memory and communication of one training step under each strategy, before launch.

    Args:
        module: the model as ``fully_shard`` would take it; a copy built under
            ``torch.device("meta")`` is enough (only shapes, dtypes and module structure are read).
        strategies: a strategy name or several (default: all four).
        world_size: data-parallel ranks.
        hybrid_shape: ``None`` (flat over ``world_size``), ``(outer, inner)`` for hybrid sharding
            (HSDP: shard over ``inner``, replicate over ``outer``), or a list of these to compare.
        mixed_precision, unit_modules, reduce_root_per_child, broadcast_buffers: as ``fully_shard``.
        optimizer: ``"adam"`` / ``"adamw"`` (2 state tensors per element), ``"sgd_momentum"`` (1)
            or ``"sgd"`` (torch's default momentum 0: none).
        micro_batches: per optimizer step (the first ones under ``no_sync()``).
        optimizer_kernel: the optimizer's kernel, whose step temporaries must fit too:
            ``"foreach"`` (torch's default on CUDA: one main-dtype copy of the rank's pieces for
            Adam), ``"fused"`` (``fused=True``: none) or ``"single"`` (``foreach=False``: a few
            copies of the largest piece); plan/optimizer_step.py.
        device: ``"cuda"`` (parameters aligned to 64 elements, as ``fully_shard`` does on GPUs) or
            ``"cpu"``.
        budget_bytes: if given, ``Plan.chosen`` is the candidate fitting it (``fit_bytes``) that
            moves the fewest bytes per step (network and host link; ``runner_up`` the next);
            ``NoPlanFitsError`` names the smallest when none fits.
        offload: ``OffloadPolicy(fraction=f)`` as ``fully_shard`` takes it: the groups it puts on
            the host, their pinned host bytes and the copies per step (plan/offload.py).
        offload_fractions: instead of ``offload``, several fractions to compare (one candidate
            per strategy and fraction; 0 is no offload): the choice may then offload.
        activation_bytes: the activation peak of one forward and backward measured without any
            wrapper; adds ``peak_with_activations`` (the peak of the step, [Note: the peak with
            activations]), which the budget is then compared to (pass the device's memory).
        persistent_grads: as ``fully_shard``: gradients kept through ``zero_grad``.
        reshard_after_forward: as ``fully_shard`` (ZeRO-3: which units stay gathered from their
            forward to their backward).

    Not covered: expert parameters, ``outer_sharding_strategy="optim"`` (HFSDP), nested
    ``fully_shard`` calls, offload with hybrid sharding; without ``activation_bytes``, activations
    (leave room for them in ``budget_bytes``).
    """
    options = WrapOptions("auto", unit_modules=unit_modules, mixed_precision=mixed_precision,
                          broadcast_buffers=broadcast_buffers, persistent_grads=persistent_grads,
                          reduce_root_per_child=reduce_root_per_child, offload=offload,
                          reshard_after_forward=reshard_after_forward)
    candidates = plan_candidates(module, strategies, world_size, hybrid_shape, options, optimizer=optimizer,
                                 micro_batches=micro_batches, device=device, offload_fractions=offload_fractions,
                                 activation_bytes=activation_bytes, optimizer_kernel=optimizer_kernel)
    chosen = runner_up = None
    if budget_bytes is not None:
        chosen, runner_up = choose(candidates, budget_bytes)
    return Plan(tuple(candidates), micro_batches, optimizer, budget_bytes, chosen, runner_up, optimizer_kernel)
