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
from .checkpoint import load_model_state_dict, model_state_dict
from .comm import Communicator
from .engine import Engine, Unit
from .mixed_precision import MixedPrecisionPolicy, full_precision_param_ids, resolve_dtypes
from .nested import absorb_wrapped_submodules
from .optimizer_hook import mark_replaced
from .param_group import ParamGroup
from .rank_agreement import check_ranks_agree
from .experts import check_expert_arguments, check_expert_group_inside, expert_names_refusal, expert_param_ids
from .replicas import split_process_group
from .row_sharded import mesh_of_group
from .strategy import ShardingStrategy, get_strategy
from .meta_init import has_meta_state, initialize_meta_model, replace_meta_parameters
from .summon import summon_full_params
from .units import assign_units
from .wrap_checks import (check_hybrid_groups, check_outer_sharding, check_params, check_process_group,
                          check_same_model_on_all_ranks, group_device, sync_module_states)


def default_alignment(device: torch.device) -> int:
    """Elements each parameter's offset is rounded up to: 1 on CPU (no padding), 64 on GPUs so
    every parameter view starts on a 128-byte boundary that vectorised kernels like."""
    return 64 if device.type == "cuda" else 1


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
        """This rank's main-weight shards, under the original parameter names."""
        for name, main in self._fsdp_main_params.items():
            yield (f"{prefix}.{name}" if prefix else name), main

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, main in self.named_parameters():
            yield main

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
        self._fsdp_engine.refresh_weights(wait=not async_op)

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
                engine.mark_main_weights_changed()
                engine.refresh_weights(wait=True)
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
        ``reset_comm_stats()``; with hybrid sharding also ``"across_replicas"``: those over the
        outer group, counted apart; with expert parameters ``"experts"``: those over their group."""
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
        """Bytes this rank keeps between steps (weights, main weights, grads; not optimizer state)."""
        total: dict = {}
        for group in self._fsdp_engine.groups:
            for role, nbytes in group.persistent_bytes().items():
                total[role] = total.get(role, 0) + nbytes
        total["total"] = sum(total.values())
        return total

    # -- full (unsharded) state dict ---------------------------------------------------------
    def full_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """{original name: full tensor} of every parameter (main-weight precision) and buffer,
        identical on every rank. Gathers one group at a time."""
        out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        for group in self._fsdp_engine.groups:
            full_main = group.gather_full_main()
            for index, names in enumerate(group.all_names):
                value = group.full_param(full_main, index).clone()
                for name in names:
                    out[name] = value
        for name, buffer in self._fsdp_buffers():
            out[name] = buffer.detach().clone()
        return OrderedDict(sorted(out.items(), key=lambda kv: self._fsdp_name_order.get(kv[0], 1 << 30)))

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Load {original name: full tensor}; each rank keeps only its shard (``load_state_dict``
        takes full tensors too; this name mirrors ``full_state_dict``)."""
        return load_model_state_dict(self, state_dict, strict=strict)

    # -- sharded state dict for torch.distributed.checkpoint (see checkpoint.py) ----------------
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


def _initialize_from_meta(module: nn.Module, units: list, pending: dict, device: torch.device, init_fn) -> None:
    """Run meta_init's initializers, writing each parameter's values into its group's main weights,
    then rebuild the compute weights from them."""
    where = {id(p): (g, i) for unit in units for g in unit.groups for i, p in enumerate(g.params)}

    def write(param, full):
        group, index = where[id(param)]
        group.write_main_values(index, full)

    def restore(param):
        group, index = where[id(param)]
        group.repoint_param(index)

    initialize_meta_model(module, pending, write, restore, device, init_fn)
    for unit in units:
        for group in unit.groups:
            if not group.strategy.weights_sharded or group.levels is not None:   # ZeRO-3 gathers at use (HFSDP: from its inner shard)
                group.rebuild_compute_weights(async_op=False)
                group.wait_refresh()


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
) -> nn.Module:
    """Shard ``module`` over ``process_group`` with a Megatron sharding strategy; returns it.

    Args:
        sharding_strategy: ``"no_shard"`` (DDP), ``"optim"`` (ZeRO-1), ``"optim_grads"`` (ZeRO-2)
            or ``"optim_grads_params"`` (ZeRO-3).
        process_group: the data-parallel group (default: the world); or, for hybrid sharding
            (HSDP), an ``(outer, inner)`` pair of groups or a 2-D DeviceMesh ``(replicate, shard)``:
            shards within ``inner``, gradients averaged across ``outer`` once per step
            (replicas.py, [Note: hybrid sharding]).
        unit_modules: module classes whose every instance is its own unit (all-gather/reshard and
            gradient-reduction granularity); the rest of the model is the root unit.
        mixed_precision: dtypes of compute weights, main weights, grads and grad collectives.
        allocator: ``"storage_freeing"`` or ``"trace_pool"`` (or an ``Allocator``) for temporaries.
        check_for_nan_in_grad: after each reduce, raise naming the first parameter whose reduced
            gradient holds NaN/Inf (one device-to-host sync per step).
        broadcast_buffers: overwrite the buffers (e.g. BatchNorm statistics) with rank 0's before
            a forward, by torch DDP's rule for its switch of the same name (default on): the first
            forward and every forward after a grad-enabled forward outside ``no_sync()``
            (engine.py, [Note: buffers as DDP]).
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
            their parent) instead of its ``reset_parameters()`` (meta_init.py, [Note: initializing
            from meta]); ignored for a module whose parameters exist.
        expert_process_group: mixture-of-experts: the expert-data-parallel group (the ranks holding
            the same experts); the parameters ``expert_params(name, param)`` selects are sharded and
            reduced over it, the rest over ``process_group`` (experts.py, [Note: expert parameters]).
        expert_params: which parameters are experts (given with ``expert_process_group``).
        outer_sharding_strategy: hybrid sharding only: ``"no_shard"`` (HSDP: each replica keeps all
            main weights and optimizer state of its shard) or ``"optim"`` (HFSDP, Megatron's
            ``outer_dp_sharding_strategy``: main weights, gradients and optimizer state sharded over
            inner x outer, compute weights gathered within the inner group; inner strategy
            ``optim``, ``optim_grads`` or ``optim_grads_params``; replicas.py, [Note: sharding across replicas
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
            steps (Megatron DDP's ``main_grad``) (grad_buffer.py, [Note: gradient buffers live as
            long as .grad]).

    A module built on the meta device (``with torch.device("meta"):``) is materialized on the
    process group's device one initializer at a time, each rank keeping only its shards: see
    README "Models that do not fit on one GPU".

    Submodules already wrapped by an earlier ``fully_shard`` call become units of this one, each
    keeping its own ``mixed_precision`` (FSDP2's nesting: wrap the blocks, then the root). Every
    rank starts from rank 0's parameters and buffers.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
    if isinstance(module, FullyShardedModule):
        raise ValueError(f"module: {type(module).__name__} is already wrapped by fully_shard; wrap a module once.")
    strategy = get_strategy(sharding_strategy)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision must be a MixedPrecisionPolicy or None, got {type(mixed_precision).__name__}.")
    if unused_param_grads not in ("none", "zeros"):
        raise ValueError(f"unused_param_grads must be 'none' or 'zeros', got {unused_param_grads!r}.")
    if not isinstance(dtensor_params, bool):
        raise TypeError(f"dtensor_params must be True or False, got {dtensor_params!r}.")
    if not isinstance(reduce_root_per_child, bool):
        raise TypeError(f"reduce_root_per_child must be True or False, got {reduce_root_per_child!r}.")
    if not isinstance(persistent_grads, bool):
        raise TypeError(f"persistent_grads must be True or False, got {persistent_grads!r}.")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable taking a module, or None, got {type(init_fn).__name__}.")
    alloc = make_allocator(allocator)
    shard_group, replicate_group = split_process_group(process_group)
    check_expert_arguments(expert_process_group, expert_params, replicate_group is not None)
    check_process_group(shard_group)
    comm = Communicator(shard_group)
    expert_comm = None
    if expert_process_group is not None:
        check_process_group(expert_process_group)
        expert_comm = Communicator(expert_process_group)
        check_expert_group_inside(expert_comm, comm)
    replicas = None
    if replicate_group is not None:
        check_process_group(replicate_group)
        replicas = Communicator(replicate_group)
        check_hybrid_groups(comm, replicas)
    world = check_outer_sharding(outer_sharding_strategy, strategy, comm, replicas)
    # Units (and their policies) of earlier fully_shard calls on submodules: their parameters are
    # made whole again here, then sharded with the rest.
    inner_policies = absorb_wrapped_submodules(module, strategy, comm, FullyShardedModule)
    if inner_policies and replicas is not None:
        raise ValueError("process_group: nested fully_shard calls with hybrid sharding are not supported; wrap "
                         "the model once with unit_modules=[...] and the (outer, inner) groups.")
    from_meta = all(p.is_meta for p in module.parameters()) and has_meta_state(module)
    experts = expert_param_ids(module, expert_params)
    if expert_params is not None and not experts:
        raise ValueError(f"expert_params: selected no parameter of {type(module).__name__} (it is called as "
                         "expert_params(name, parameter) on every parameter); pass expert_process_group and "
                         "expert_params only for a model with expert parameters.")
    if experts and (from_meta or inner_policies):
        raise ValueError("expert_process_group: expert parameters are supported on a model whose parameters exist "
                         "and that no earlier fully_shard call wrapped parts of; "
                         + ("this one is on the meta device (every expert-parallel rank would initialize its "
                            "experts alike)." if from_meta else "wrap the model once with unit_modules=[...]."))
    pending = replace_meta_parameters(module, group_device(comm)) if from_meta else {}
    device = check_params(module)
    specs = assign_units(module, unit_modules, unit_instances=[m for m, _ in inner_policies])
    policy_of = {id(m): policy for m, policy in inner_policies}
    check_same_model_on_all_ranks(module, comm, device)
    if replicas is not None:
        check_same_model_on_all_ranks(module, replicas, device)
    agreed = {
        "sharding_strategy": strategy.name,
        "units": ",".join(spec.fqn or "<root>" for spec in specs),
        "mixed_precision": repr(mixed_precision),
        "nested unit policies": ",".join(f"{type(m).__name__}:{p!r}" for m, p in inner_policies),
        "allocator": type(alloc).__name__,
        "broadcast_buffers": str(bool(broadcast_buffers)),
        "unused_param_grads": unused_param_grads,
        "check_for_nan_in_grad": str(bool(check_for_nan_in_grad)),
        "built on the meta device": str(from_meta),
        "dtensor_params": str(dtensor_params),
        "persistent_grads": str(persistent_grads),
        "outer_sharding_strategy": outer_sharding_strategy,
        "reduce_root_per_child": str(reduce_root_per_child),
        "expert parameters": ",".join(n for n, p in module.named_parameters() if id(p) in experts),
    }
    for group_comm in (comm, replicas, expert_comm):
        if group_comm is not None:
            check_ranks_agree(group_comm, device, agreed)
    if not from_meta:        # a meta model is initialized the same on every rank (same RNG state)
        sync_module_states(module, comm, skip=experts)   # inner groups first: each gets its rank 0's ...
        if replicas is not None:
            sync_module_states(module, replicas)   # ... then every replica gets replica 0's: global rank 0's
        if expert_comm is not None:                 # expert-parallel peers keep their own experts
            sync_module_states(module, expert_comm, only=experts)

    alignment = default_alignment(device)
    shard_comm = world if world is not None else comm   # HFSDP: main weights sharded over the world
    mesh = mesh_of_group(shard_comm.group, device) if dtensor_params and strategy.optim_sharded else None
    expert_mesh = (mesh_of_group(expert_comm.group, device)
                   if expert_comm is not None and dtensor_params and strategy.optim_sharded else None)
    units: list[Unit] = []
    for unit_index, spec in enumerate(specs):
        policy = policy_of.get(id(spec.module), mixed_precision)
        full_precision = full_precision_param_ids(spec.module, policy)
        buckets: "OrderedDict[tuple, list]" = OrderedDict()
        for first_name, names, param in spec.params:
            child = first_name.split(".", 1)[0] if reduce_root_per_child and spec.is_root and "." in first_name else ""
            key = (param.dtype, param.requires_grad, id(param) in full_precision, id(param) in experts, child)
            buckets.setdefault(key, []).append((first_name, names, param))
        groups = []
        for (dtype, requires_grad, keep_precision, expert, child), entries in buckets.items():
            tag = (f"{spec.fqn or '<root>'}{'/' + child if child else ''}/{str(dtype).replace('torch.', '')}/"
                   f"{'grad' if requires_grad else 'frozen'}"
                   f"{'/full_precision' if keep_precision else ''}{'/experts' if expert else ''}")
            group = ParamGroup(tag, [e[2] for e in entries], [e[0] for e in entries], strategy,
                               expert_comm if expert else shard_comm,
                               resolve_dtypes(dtype, policy, requires_grad, keep_precision), alloc, device,
                               alignment, expert_mesh if expert else mesh,
                               levels=(comm, replicas) if world is not None else None)
            group.all_names = [e[1] for e in entries]
            group.grads.persistent = persistent_grads
            group.param_dtype = dtype
            groups.append(group)
            for first_name, _, param in entries:
                mark_replaced(param, first_name)
        unit = Unit(unit_index, spec.module, spec.fqn, groups)
        unit.mixed_precision = policy
        units.append(unit)
    if from_meta:
        _initialize_from_meta(module, units, pending, device, init_fn)

    main_by_param = {}
    for unit in units:
        for group in unit.groups:
            for param, main in zip(group.params, group.main_params):
                main_by_param[id(param)] = main
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
    module._fsdp_name_order = name_order
    module._fsdp_engine = Engine(module, units, strategy, alloc, comm, replicas, expert_comm, world)
    module._fsdp_engine.check_for_nan_in_grad = bool(check_for_nan_in_grad)
    module._fsdp_engine.broadcast_buffers = bool(broadcast_buffers)
    module._fsdp_engine.unused_grads_are_none = unused_param_grads == "none"
    for group_comm in (comm, replicas, expert_comm, world):
        if group_comm is not None:
            group_comm.stats.reset()
    return module
