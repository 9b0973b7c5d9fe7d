"""``fully_shard``: wrap a plain PyTorch module in one of the four sharding strategies.

The module keeps its class behaviour and parameter names (its class is swapped for a subclass
that also derives from ``FullyShardedModule``, as FSDP2 does), so user code and checkpoints see
the same names. What changes is what ``parameters()`` yields: the optimizer-facing main weights
(this rank's fp32 shard), which an unmodified ``torch.optim`` optimizer updates in place.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .allocators import Allocator, make_allocator
from .wrap.build_units import build_units, initialize_units_from_meta, install_extension_params, prepare_model
from .checkpoint.state_dict import load_model_state_dict, model_state_dict
from .runtime.engine import Engine
from .wrap.experts import expert_names_refusal
from .group.grad_buffer import reserve_gradient_segment
from .group.main_segment import compact
from .group.layout import default_alignment  # noqa: F401  (fully_shard.default_alignment, as before)
from .mixed_precision import MixedPrecisionPolicy
from .offload.host_link import HostLink, release_shards_after_gathers
from .offload.policy import OffloadPolicy, choose_offloaded
from .offload.backward_steps import install_backward_steps
from .runtime.param_swap import ParamSlots
from .plan.resolve import AutoStrategy, resolve_auto_strategy
from .wrap.rank_agreement import agree_on_wrap
from .strategy import STRATEGY_NAMES, ShardingStrategy
from .summon import summon_full_params
from .wrap.checks import check_outer_sharding, group_device, sync_start_values, wrap_communicators
from .wrap.options import WrapOptions


class ShardedParameter(NamedTuple):
    """A parameter as the wrapper holds it (see ``FullyShardedModule.sharded_parameters``)."""

    name: str
    module_param: nn.Parameter     # what forward and backward use (whole or 0-element, per strategy)
    main_param: nn.Parameter       # what the optimizer steps: this rank's main-weight piece
    shape: torch.Size
    # data-parallel rank r holds rows [row_splits[r], row_splits[r + 1]) of the main weight and
    # its gradient; None where every rank holds all of them (no_shard)
    row_splits: Optional[tuple] = None


class FullyShardedModule:
    """Mixin that a wrapped module's class gains; every method here acts on the whole model."""

    _fsdp_engine: Engine

    # -- what the optimizer sees -------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's main-weight shards, under the original parameter names, listed as torch lists
        the module's own parameters (``recurse``, ``remove_duplicate``: a tied weight under each of
        its names with ``remove_duplicate=False``) whatever the module's attributes hold now (the
        compute weights in forward and backward, or always with ``dtensor_params=False``).
        ``parameters(recurse)`` is torch's, over this."""
        main_of = self._fsdp_main_of
        seen: set = set()
        for name, param in nn.Module.named_parameters(self, prefix=prefix, recurse=recurse, remove_duplicate=False):
            main = main_of.get(id(param))
            if main is None or (remove_duplicate and id(main) in seen):
                continue
            seen.add(id(main))
            yield name, main

    def sharded_parameters(self) -> Iterator[ShardedParameter]:
        """One record per parameter: its name, the module's own parameter (what forward uses),
        the optimizer-facing main parameter, the original shape and which rows each rank holds."""
        for group in self._fsdp_engine.groups:
            sharded = group.strategy.optim_sharded
            for index, (name, param, main, shape) in enumerate(zip(group.param_names, group.params, group.main_params,
                                                                    group.shapes)):
                yield ShardedParameter(name, param, main, torch.Size(shape),
                                       group.layout.row_splits(index) if sharded else None)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._fsdp_engine.strategy

    @property
    def process_group(self):
        return self._fsdp_engine.comm.group

    # -- gradient synchronisation (FSDP2's words) -------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; DDP and ZeRO-1 reduce only outside this context.

        ZeRO-2/3 reduce-scatter every micro-batch by design (that is what keeps their gradient
        memory sharded), so for them this context changes nothing."""
        engine = self._fsdp_engine
        previous = engine.requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward accumulates gradients locally (DDP, ZeRO-1) until it is True again or
        ``reduce_gradients()`` is called (FSDP2's name; ``no_sync()`` is the scoped form)."""
        self._fsdp_engine.requires_gradient_sync = bool(requires_gradient_sync)

    def set_gradient_divide_factor(self, factor: Optional[float]) -> None:
        """Reduced gradients are the sum over ranks divided by ``factor``; ``None`` (default) is the
        data-parallel size, i.e. the mean torch DDP gives; ``1.0`` gives the sum."""
        self._fsdp_engine.set_gradient_divide_factor(factor)

    def reduce_gradients(self, async_op: bool = False) -> None:
        """Reduce gradients accumulated under ``no_sync()`` now. ``async_op=True`` only issues the
        collectives; ``wait_gradient_reduction()`` then makes the gradients final."""
        if async_op:
            self._fsdp_engine.start_gradient_reduction()
        else:
            self._fsdp_engine.finish_gradient_reduction()

    def wait_gradient_reduction(self) -> None:
        """Make every gradient final: reduce what is still local, wait for every reduce in flight,
        point the main parameters' ``.grad`` at the results. Idempotent."""
        self._fsdp_engine.finish_gradient_reduction()

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient this rank holds by ``factor`` (e.g. 1 / tokens in the batch)."""
        self._fsdp_engine.scale_gradients(factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (recovering from a failed backward first); ``set_to_none``
        also sets the main parameters' ``.grad`` to None, as ``nn.Module.zero_grad``."""
        engine = self._fsdp_engine
        engine.zero_grads(release=set_to_none)
        if set_to_none:
            for group in engine.groups:
                for main in group.main_params:
                    main.grad = None

    # -- weights (FSDP2's words) ---------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Make the replicated compute weights current: ZeRO-1/2 start (or with ``async_op=False``
        finish) the all-gather of main weights that changed; DDP casts them. ZeRO-3 gathers each
        unit when it runs; for whole weights outside forward use ``summon_full_params()``."""
        self._fsdp_engine.weights.refresh(wait=not async_op)

    def reshard(self) -> None:
        """Free ZeRO-3 weights gathered outside the schedule (a no-op for the other strategies)."""
        for unit in self._fsdp_engine.units:
            unit.reshard()

    def broadcast_parameters(self, src_rank: int = 0) -> None:
        """Make every rank hold group rank ``src_rank``'s model (parameters and buffers), as torch
        DDP does at construction. Sharded strategies hold one logical copy, so only their buffers
        move."""
        engine = self._fsdp_engine
        with torch.no_grad():
            if not engine.strategy.optim_sharded:
                for group_comm in (engine.comm, engine.experts):
                    params = [m for g in engine.groups if g.comm is group_comm for m in g.main_params]
                    if params:
                        group_comm.broadcast(params, src_rank, label="parameters (broadcast_parameters)")
                engine.weights.reload()
            buffers = [b for b in self.buffers() if b.numel()]
            if buffers:
                engine.comm.broadcast(buffers, src_rank, label="buffers (broadcast_parameters)")

    def summon_full_params(self, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False):
        """Context manager: inside it the module's parameters hold their full weights (main-weight
        precision, every strategy); see ``megatron_fsdp_v2.summon.summon_full_params``."""
        return summon_full_params(self, recurse=recurse, writeback=writeback, rank0_only=rank0_only,
                                  offload_to_cpu=offload_to_cpu, with_grads=with_grads)

    def reset_iteration(self) -> None:
        """Skip the current step after an exception in forward or backward: wait for issued
        collectives, free temporaries, discard the gradients accumulated since the last optimizer
        step. Runs by itself at the next forward or ``zero_grad()`` after a failed backward."""
        self._fsdp_engine.reset_iteration()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global norm over all ranks' shards is at most ``max_norm``.

        Returns the norm before clipping: the value ``torch.nn.utils.clip_grad_norm_`` gives on the
        unsharded DDP model, computed once in fp32."""
        return self._fsdp_engine.clip_grad_norm_(max_norm, norm_type)

    def comm_stats(self) -> dict:
        """Calls and bytes of each collective over the (shard) group since the last
        ``reset_comm_stats()``, and under ``"bytes_by_dtype"`` which dtypes those bytes were
        (comm/collectives.py, ``CommStats.as_dict``); with hybrid sharding also
        ``"across_replicas"``: those over the outer group, counted apart; with expert parameters
        ``"experts"``: those over their group."""
        engine = self._fsdp_engine
        stats = engine.comm.stats.as_dict()
        if engine.replicas is not None:
            stats["across_replicas"] = engine.replicas.stats.as_dict()
        if engine.experts is not None:
            stats["experts"] = engine.experts.stats.as_dict()
        if engine.world is not None:
            stats["whole_world"] = engine.world.stats.as_dict()
        return stats

    def reset_comm_stats(self) -> None:
        engine = self._fsdp_engine
        for group_comm in (engine.comm, engine.replicas, engine.experts, engine.world):
            if group_comm is not None:
                group_comm.stats.reset()

    def persistent_bytes(self) -> dict:
        """Device bytes this rank keeps between steps (weights, main weights, grads; not optimizer
        state) by role and ``"total"``; with offload also the host bytes (``"host_main_weights"``,
        ``"host_grads"``, ``"host_grad_staging"``, ``"host_total"``), which ``"total"`` leaves out."""
        total: dict = {}
        for group in self._fsdp_engine.groups:
            for role, nbytes in group.exporter.persistent_bytes().items():
                total[role] = total.get(role, 0) + nbytes
        host = sum(v for k, v in total.items() if k.startswith("host_"))
        total["total"] = sum(v for k, v in total.items() if not k.startswith("host_"))
        if any(k.startswith("host_") for k in total):
            total["host_total"] = host
        return total

    def set_offload(self, offload: OffloadPolicy) -> None:
        """Offload as ``fully_shard(..., offload=offload)`` would have, after wrapping: for a caller
        that learns the policy later (Megatron's ``get_optimizer``). Call it before building the
        optimizer: the main parameters stay the same objects (their ``.data`` moves to the host)."""
        engine = self._fsdp_engine
        if not isinstance(offload, OffloadPolicy):
            raise TypeError(f"offload must be an OffloadPolicy, got {type(offload).__name__}.")
        if any(g.offloaded is not None for g in engine.groups):
            raise ValueError("offload: this model already offloads groups; set the policy once.")
        if engine.replicas is not None and offload.fraction > 0:
            raise ValueError("offload: CPU offload with hybrid sharding is not supported.")
        if offload.fraction > 0 and any(g.mesh is not None for g in engine.groups):
            raise ValueError("offload: set_offload needs plain-tensor main parameters (dtensor_params=False); "
                             "with DTensor parameters pass offload= to fully_shard instead.")
        sizes = [g.main_shard.numel() * g.main_shard.element_size() for g in engine.groups]
        chosen = choose_offloaded(sizes, offload.fraction)
        link = HostLink(engine.groups[0].device, offload) if chosen else None
        left_segment = any(engine.groups[index].main_in_segment for index in chosen)
        for index in sorted(chosen):
            engine.groups[index].offloading.offload_main(link)
        if left_segment:
            compact(engine.groups)
        if chosen:        # fewer gradient buffers on the device than the wrap reserved for
            reserve_gradient_segment([g.grads for g in engine.groups if g.grads_allocated_later],
                                     engine.groups[0].device, replace=True)
        install_backward_steps(engine, offload)
        release_shards_after_gathers(engine.units, offload)

    # -- full (unsharded) state dict ---------------------------------------------------------
    def full_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """{original name: full tensor} of every parameter (main-weight precision) and buffer,
        identical on every rank. Gathers one group at a time."""
        out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        for group in self._fsdp_engine.groups:
            full_main = group.exporter.gather_full_main()
            for index, names in enumerate(group.all_names):
                value = group.exporter.full_param(full_main, index).clone()
                for name in names:
                    out[name] = value
        for name, buffer in self._fsdp_buffers():
            out[name] = buffer.detach().clone()
        return OrderedDict(sorted(out.items(), key=lambda kv: self._fsdp_name_order.get(kv[0], 1 << 30)))

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Load {original name: full tensor}; each rank keeps only its shard (``load_state_dict``
        takes full tensors too; this name mirrors ``full_state_dict``)."""
        return load_model_state_dict(self, state_dict, strict=strict)

    # -- sharded state dict for torch.distributed.checkpoint (see checkpoint/state_dict.py) ----------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Original names and shapes; each rank's values hold only its shard (``FlatRangeShard``
        views of its main weights), so ``dcp.save(model.state_dict(), checkpoint_id=path)`` writes
        shards and ``dcp.load`` fills them in place, at any dp size and strategy."""
        if args:
            raise TypeError(f"state_dict takes destination, prefix and keep_vars by keyword only, got {len(args)} "
                            f"positional argument(s).")
        if self._fsdp_engine.experts is not None:
            raise expert_names_refusal("state_dict")
        values = model_state_dict(self, prefix=prefix, keep_vars=keep_vars)
        if destination is None:
            return values
        destination.update(values)
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load this model's own state dict after ``dcp.load`` (or full tensors, e.g. an export);
        ``ValueError`` names missing, unexpected and mis-shaped keys."""
        return load_model_state_dict(self, state_dict, strict=strict, assign=assign)

    def _fsdp_buffers(self):
        for name, buffer in nn.Module.named_buffers(self):
            owner_name, _, leaf = name.rpartition(".")
            owner = self.get_submodule(owner_name) if owner_name else self
            if leaf not in owner._non_persistent_buffers_set:
                yield name, buffer


def _auto_strategy(module, options: WrapOptions, groups) -> ShardingStrategy:
    """``sharding_strategy="auto"`` (plan/resolve.py); what the plan does not cover is refused
    before its one collective, on every rank alike."""
    nested = [name for name, m in module.named_modules() if isinstance(m, FullyShardedModule)]
    outer = options.outer_sharding_strategy
    refused = (["expert parameters (expert_process_group)"] if groups.experts is not None else []) + \
        ([f"outer_sharding_strategy={outer!r} (HFSDP)"] if outer != "no_shard" else []) + \
        ([f"submodules wrapped by earlier fully_shard calls ({nested[:3]})"] if nested else [])
    if refused:
        raise ValueError(f"sharding_strategy='auto' plans flat and hybrid (HSDP) sharding of one fully_shard call; "
                         f"got {', '.join(refused)}: pass one of {list(STRATEGY_NAMES)}.")
    return resolve_auto_strategy(module, options, groups.comm, groups.replicas, group_device(groups.comm))


def fully_shard(
    module: nn.Module,
    *,
    sharding_strategy: Union[str, ShardingStrategy],
    process_group: Optional[dist.ProcessGroup] = None,
    unit_modules: Optional[Sequence[type]] = None,
    mixed_precision: Optional[MixedPrecisionPolicy] = None,
    allocator: Union[str, Allocator] = "storage_freeing",
    check_for_nan_in_grad: bool = False,
    broadcast_buffers: bool = True,
    unused_param_grads: str = "none",
    dtensor_params: bool = True,
    init_fn: Optional[Callable[[nn.Module], None]] = None,
    expert_process_group: Optional[dist.ProcessGroup] = None,
    expert_params: Optional[Callable[[str, nn.Parameter], bool]] = None,
    persistent_grads: bool = False,
    outer_sharding_strategy: str = "no_shard",
    reduce_root_per_child: bool = False,
    auto_strategy: Optional[AutoStrategy] = None,
    offload: Optional[OffloadPolicy] = None,
    reshard_after_forward: Optional[bool] = True,
) -> nn.Module:
    """Shard ``module`` over ``process_group`` with a Megatron sharding strategy; returns it.

    Args:
        sharding_strategy: ``"no_shard"`` (DDP), ``"optim"`` (ZeRO-1), ``"optim_grads"`` (ZeRO-2)
            or ``"optim_grads_params"`` (ZeRO-3); ``"auto"``: the one that sends the fewest bytes
            per step among those whose planned memory (``megatron_fsdp_v2.plan``) fits
            ``auto_strategy``'s budget, the same on every rank; logged with the runner-up.
        process_group: the data-parallel group (default: the world); or, for hybrid sharding
            (HSDP), an ``(outer, inner)`` pair of groups or a 2-D DeviceMesh ``(replicate, shard)``:
            shards within ``inner``, gradients averaged across ``outer`` once per step
            (comm/replicas.py, [Note: hybrid sharding]).
        unit_modules: module classes whose every instance is its own unit (all-gather/reshard and
            gradient-reduction granularity); the rest of the model is the root unit.
        mixed_precision: dtypes of compute weights, main weights, grads and grad collectives.
        allocator: ``"storage_freeing"`` or ``"trace_pool"`` (or an ``Allocator``) for temporaries.
        check_for_nan_in_grad: after each reduce, raise naming the first parameter whose reduced
            gradient holds NaN/Inf (one device-to-host sync per step).
        broadcast_buffers: overwrite the buffers (e.g. BatchNorm statistics) with rank 0's before
            a forward, by torch DDP's rule for its switch of the same name (default on): the first
            forward and every forward after a grad-enabled forward outside ``no_sync()``
            (runtime/buffer_broadcast.py, [Note: buffers as DDP]).
        unused_param_grads: ``"none"`` (torch DDP / FSDP2): a parameter no rank used keeps
            ``.grad = None``, so optimizers skip it; ``"zeros"``: it gets a zero gradient
            (Megatron DDP's ``main_grad`` semantics).
        dtensor_params: ``True``: with the sharded strategies, ``parameters()`` are DTensors
            (``Shard(0)`` over ``process_group``, this rank's whole rows; row_sharded.py) with the
            original shapes, so ``torch.nn.utils.clip_grad_norm_`` gives the global norm and
            ``torch.distributed.checkpoint.state_dict`` works; ``False``: plain tensors holding this
            rank's rows ``[rows_here, *shape[1:]]`` (what Megatron's optimizer expects; clip with
            ``model.clip_grad_norm_``). ``no_shard`` parameters are always plain whole tensors.
        init_fn: for a module built on the meta device: called on every submodule (children before
            their parent) instead of its ``reset_parameters()`` (wrap/meta_init.py, [Note: initializing
            from meta]); ignored for a module whose parameters exist.
        expert_process_group: mixture-of-experts: the expert-data-parallel group (the ranks holding
            the same experts); the parameters ``expert_params(name, param)`` selects are sharded and
            reduced over it, the rest over ``process_group`` (wrap/experts.py, [Note: expert parameters]).
        expert_params: which parameters are experts (given with ``expert_process_group``).
        outer_sharding_strategy: hybrid sharding only: ``"no_shard"`` (HSDP: each replica keeps all
            main weights and optimizer state of its shard) or ``"optim"`` (HFSDP, Megatron's
            ``outer_dp_sharding_strategy``: main weights, gradients and optimizer state sharded over
            inner x outer, compute weights gathered within the inner group; inner strategy
            ``optim``, ``optim_grads`` or ``optim_grads_params``; comm/replicas.py, [Note: sharding across replicas
            (HFSDP)]).
        reduce_root_per_child: the root unit's parameters form one group per top-level child
            module (and one for the root's own) instead of one. ZeRO-3: a group whose gradients
            are complete lets its gathered weights go (a GPT's output layer at the start of
            backward); ZeRO-2/3: it also reduces then when its reduced shard is smaller than the
            gradients it holds (else at the end of backward), so the output layer's gradients are
            not held through the activation peak. The root is still gathered as one unit.
        persistent_grads: ``False`` (FSDP2's behaviour): the reduced-gradient buffers live as long as
            the optimizer's ``.grad`` views of them, so ``zero_grad(set_to_none=True)`` frees them and
            the next backward allocates them again as late as possible; ``True``: kept between
            steps (Megatron DDP's ``main_grad``) (group/grad_buffer.py, [Note: gradient buffers live as
            long as .grad]).
        auto_strategy: with ``sharding_strategy="auto"`` only: the budget, activation reserve,
            optimizer and micro-batches it plans for (``AutoStrategy()`` by default: the device's
            whole memory, Adam, one micro-batch). Not for expert parameters, HFSDP or nested calls.
        offload: ``OffloadPolicy(fraction=f)``: the main weights (and so the optimizer state) of
            whole parameter groups holding at least ``f`` of the main-weight bytes, the last in
            forward order first, live in (pinned) host memory; their reduced gradients are copied
            there as each reduce lands and they step on the CPU through the same optimizer
            (their main parameters are host tensors; e.g. ``torch.optim.AdamW(..., fused=True)``
            runs the fused kernel per device); updated weights return on a side stream, waited
            for by the next forward's gathers (offload/host_link.py, [Note: offload by fraction]).

        reshard_after_forward: ZeRO-3 only (FSDP2's argument of the same name, bool or None):
            ``True`` (default): every unit gives its gathered weights back after its forward and
            gathers them again for its backward, the strategy table's two all-gathers per unit;
            ``None`` (FSDP2's default): every unit but the root, whose weights stay gathered from
            its forward to the end of its backward (one gather of the root per micro-batch, its
            weights held through the forward); ``False``: no unit (one gather per unit and
            micro-batch, ZeRO-2's weight memory during the step). Other strategies hold whole
            weights anyway.

    A module built on the meta device (``with torch.device("meta"):``) is materialized on the
    process group's device one initializer at a time, each rank keeping only its shards: see
    docs/user_guide.md, "Models that do not fit on one GPU". Every argument in one table: docs/api.md.

    Submodules already wrapped by an earlier ``fully_shard`` call become units of this one, each
    keeping its own ``mixed_precision`` (FSDP2's nesting: wrap the blocks, then the root). Every
    rank starts from rank 0's parameters and buffers.

    Hooks on ``model.parameters()`` (runtime/grad_hooks.py, [Note: hooks on sharded parameters]):
    ``register_post_accumulate_grad_hook(hook)`` runs ``hook(param)`` once ``param.grad`` holds the
    reduced gradient (the end of a backward outside ``no_sync()``, or ``reduce_gradients()``), as
    FSDP2 does, so an optimizer may step there; ``register_hook`` is refused at the next forward.
    """
    options = WrapOptions(sharding_strategy, unit_modules, mixed_precision, allocator, check_for_nan_in_grad,
                          broadcast_buffers, unused_param_grads, dtensor_params, init_fn, expert_params,
                          persistent_grads, outer_sharding_strategy, reduce_root_per_child, auto_strategy, offload,
                          reshard_after_forward)
    strategy = options.check(module, FullyShardedModule, process_group)
    alloc = make_allocator(allocator)
    groups = wrap_communicators(process_group, expert_process_group, expert_params)
    if strategy is None:
        strategy = _auto_strategy(module, options, groups)
    world = check_outer_sharding(outer_sharding_strategy, strategy, groups.comm, groups.replicas, dtensor_params)
    model = prepare_model(module, strategy, groups, expert_params, unit_modules, FullyShardedModule)
    agree_on_wrap(module, groups, model, strategy, alloc, options)
    if not model.from_meta:        # a meta model is initialized the same on every rank (same RNG state)
        sync_start_values(module, groups, model.experts)
    units = build_units(model, strategy, groups, world, alloc, options)
    if model.from_meta:
        initialize_units_from_meta(module, units, model.pending, model.device, init_fn)
    install_extension_params(module, units)
    engine = _install_engine(module, units, strategy, alloc, groups, world, dtensor_params)
    engine.check_for_nan_in_grad = bool(check_for_nan_in_grad)
    engine.broadcast_buffers = bool(broadcast_buffers)
    engine.unused_grads_are_none = options.unused_grads_are_none
    install_backward_steps(engine, offload)
    release_shards_after_gathers(engine.units, offload)
    return module


def _install_engine(module: nn.Module, units: list, strategy, alloc, groups, world, dtensor_params: bool) -> Engine:
    """Swap the module's class for its FullySharded subclass and start the engine's hooks; between
    steps the module's attributes hold the main parameters (runtime/param_swap.py)."""
    main_by_param = {id(param): main for unit in units for group in unit.groups
                     for param, main in zip(group.params, group.main_params)}
    main_params = OrderedDict()
    name_order = {}
    for name, param in nn.Module.named_parameters(module, remove_duplicate=False):
        name_order.setdefault(name, len(name_order))
        if id(param) in main_by_param and not any(m is main_by_param[id(param)] for m in main_params.values()):
            main_params[name] = main_by_param[id(param)]
    for name, _ in nn.Module.named_buffers(module):
        name_order.setdefault(name, len(name_order))
    cls = module.__class__
    module.__class__ = type(f"FullySharded{cls.__name__}", (FullyShardedModule, cls), {})
    module._fsdp_main_params = main_params
    # id(a module's parameter: compute or main) -> main parameter (what named_parameters yields)
    module._fsdp_main_of = {**main_by_param, **{id(main): main for main in main_by_param.values()}}
    module._fsdp_name_order = name_order
    engine = Engine(module, units, strategy, alloc, groups.comm, groups.replicas, groups.experts, world)
    module._fsdp_engine = engine
    engine.param_slots = ParamSlots(module, main_by_param, swaps=dtensor_params)
    engine.param_slots.hold_main()
    for group_comm in groups.all() + ([world] if world is not None else []):
        group_comm.stats.reset()
    return engine
