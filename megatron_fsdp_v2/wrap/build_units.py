"""The stages of ``fully_shard`` between its checks and the engine: find what the model is made of
(``prepare_model``: nested wraps absorbed, meta parameters, experts, units), then build every
unit's parameter groups, i.e. its buffers (``build_units``), and fill them from meta
(``initialize_units_from_meta``).

Each group's placement (host or device, offload/policy.py) is chosen from the groups' sizes before any
buffer exists, so an offloaded group's main weights are built on the host directly.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from .experts import expert_param_ids
from ..extensions.weights import ExtensionWeights
from ..group.layout import default_alignment
from .meta_init import has_meta_state, initialize_meta_model, replace_meta_parameters
from ..comm.replicas import HybridLevels
from ..mixed_precision import full_precision_param_ids, resolve_dtypes
from .nested import absorb_wrapped_submodules
from ..offload.host_link import HostLink
from ..offload.policy import choose_offloaded, offload_choice_bytes
from ..runtime.optimizer_hook import mark_replaced
from ..group.grad_buffer import reserve_gradient_segment
from ..group.main_segment import compact, joins_main_segment
from ..group.param_group import ParamGroup
from ..runtime.param_swap import register_in_place_of
from ..row_sharded import mesh_of_group
from ..runtime.unit_state import Unit
from .units import assign_units, group_specs
from .checks import WrapGroups, check_params, group_device

__all__ = ["PreparedModel", "build_units", "initialize_units_from_meta", "prepare_model"]


class PreparedModel(NamedTuple):
    """What ``fully_shard`` learned of the model before sharding it."""

    specs: list                    # units.UnitSpec per unit, the root first
    inner_policies: list           # (unit module, mixed-precision policy, reshard_after_forward) of earlier calls
    experts: frozenset             # ids of expert parameters
    from_meta: bool
    pending: dict                  # meta_init's record of the meta parameters replaced
    device: torch.device


def prepare_model(module: nn.Module, strategy, groups: WrapGroups, expert_params, unit_modules,
                  wrapped_class: type) -> PreparedModel:
    """Absorb nested wraps, replace meta parameters, select experts and assign units."""
    inner_policies = absorb_wrapped_submodules(module, strategy, groups.comm, wrapped_class)
    if inner_policies and groups.replicas is not None:
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
    pending = replace_meta_parameters(module, group_device(groups.comm)) if from_meta else {}
    device = check_params(module)
    specs = assign_units(module, unit_modules, unit_instances=[m for m, _, _ in inner_policies])
    return PreparedModel(specs, inner_policies, frozenset(experts), from_meta, pending, device)


def build_units(model: PreparedModel, strategy, groups: WrapGroups, world, allocator, options) -> list[Unit]:
    """Every unit with its ParamGroups (buffers laid out, main parameters made), the root first.
    ZeRO-3's main shards are built one group at a time, the smallest first (``_build_order``: each
    group's parameters freed as it is built, so the largest is built when the most original tensors
    are gone; at dp 1 on the host), then moved into one allocation (group/main_segment.py) before
    the main parameters are made; the gradient buffers to come get one segment of their pool
    (group/grad_buffer.py). ``options``: the call's ``options.WrapOptions``."""
    device, dtensor_params = model.device, options.dtensor_params
    shard_comm = world if world is not None else groups.comm   # HFSDP: main weights sharded over the world
    mesh = mesh_of_group(shard_comm.group, device) if dtensor_params and strategy.optim_sharded else None
    expert_mesh = (mesh_of_group(groups.experts.group, device)
                   if groups.experts is not None and dtensor_params and strategy.optim_sharded else None)
    plans = _group_plans(model, options.mixed_precision, options.reduce_root_per_child)
    to_host, link = _offload_choice(plans, options.offload, device)
    meshes: dict = {}            # the group's mesh handed to FSDP2's extension protocol, one per process group
    hybrid = world is not None

    def make_group(position: int, policy, gspec) -> ParamGroup:
        entries, comm = gspec.entries, groups.experts if gspec.expert else shard_comm
        dtypes = resolve_dtypes(gspec.dtype, policy, gspec.requires_grad, gspec.full_precision)
        group = ParamGroup(gspec.tag, [e[2] for e in entries], [e[0] for e in entries], strategy, comm, dtypes,
                           allocator, device, default_alignment(device), expert_mesh if gspec.expert else mesh,
                           levels=HybridLevels(groups.comm, groups.replicas) if hybrid else None,
                           offload=link if position in to_host else None, persistent_grads=options.persistent_grads,
                           main_segment=joins_main_segment(strategy, hybrid, device, comm.size, model.from_meta),
                           from_meta=model.from_meta,
                           extension=_extension(model, gspec, comm, meshes, dtypes, offloaded=position in to_host,
                                                hybrid=hybrid),
                           all_names=[e[1] for e in entries], param_dtype=gspec.dtype)
        for first_name, _, param in entries:
            mark_replaced(param, first_name)
        return group

    slots = [(policy, gspec) for policy, gspecs in plans for gspec in gspecs]     # by position in the model
    built: list = [None] * len(slots)
    for position in _build_order(slots, strategy):
        built[position] = make_group(position, *slots[position])
    compact(built)                                 # group/main_segment.py: one allocation per main dtype
    for group in built:
        if group.main_params is None:
            group.main.make_params()
    reserve_gradient_segment([g.grads for g in built if g.grads_allocated_later], device)
    return _assemble_units(model, plans, built, options.reshard_after_forward)


def _build_order(slots: list, strategy) -> list:
    """Group positions in the order their buffers are built. ZeRO-3: the fewest elements first (ties
    in model order), as FSDP2's idiom shards the blocks before the root that holds the embeddings: a
    ZeRO-3 group keeps less than the original tensors it frees (its shard), so the largest is built
    when the most of them are gone. The other strategies keep replicated weights, at dp 1 more than
    they free: model order, the root (often the largest) first."""
    order = list(range(len(slots)))
    if not strategy.weights_sharded:
        return order
    return sorted(order, key=lambda i: sum(e[2].numel() for e in slots[i][1].entries))


def _assemble_units(model: PreparedModel, plans: list, built: list, reshard_after_forward) -> list[Unit]:
    """The units, the root first, each with its groups in model order."""
    rule_of = {id(m): rule for m, _, rule in model.inner_policies}   # nested units keep their call's
    units, start = [], 0
    for unit_index, (spec, (policy, gspecs)) in enumerate(zip(model.specs, plans)):
        units.append(Unit(unit_index, spec.module, spec.fqn, built[start:start + len(gspecs)], policy,
                          rule_of.get(id(spec.module), reshard_after_forward)))
        start += len(gspecs)
    return units


def _extension(model: PreparedModel, gspec, comm, meshes: dict, dtypes, offloaded: bool,
               hybrid: bool) -> Optional[ExtensionWeights]:
    """A group of parameters that gather themselves: their classes and owners (extensions/weights.py).
    Not with offload or HFSDP: their gathers read a host copy or gather twice, which the protocol's
    one pre / one gather / one post does not describe."""
    if not gspec.extension:
        return None
    if offloaded or hybrid:
        name, kind = gspec.entries[0][0], type(gspec.entries[0][2]).__name__
        what = "offload (OffloadPolicy)" if offloaded else "outer_sharding_strategy='optim' (HFSDP)"
        raise ValueError(f"{'offload' if offloaded else 'outer_sharding_strategy'}: parameter {name!r} is a {kind} "
                         f"that gathers itself (FSDP2's all-gather extension, e.g. torchao float8); {what} is not "
                         "supported for such parameters; allowed: no offload of their groups, hybrid sharding with "
                         "outer_sharding_strategy='no_shard'.")
    if id(comm) not in meshes:
        meshes[id(comm)] = mesh_of_group(comm.group, model.device)
    return ExtensionWeights.for_entries(model.specs[0].module, gspec.entries, meshes[id(comm)], dtypes)


def install_extension_params(module: nn.Module, units: list) -> None:
    """Make the compute parameters of groups that gather themselves (one gather each, ZeRO-3's freed
    again) and register them where the original parameters were: the original tensors held a
    stale copy of the weights, and the compute parameter is the class's own (e.g. float8) tensor."""
    for group in (g for unit in units for g in unit.groups if g.extension is not None):
        if group.strategy.weights_sharded:
            group.unshard(async_op=False)
            group.reshard()
        else:
            group.rebuild_compute_weights(async_op=False)
            group.wait_refresh()
        for index, compute in enumerate(group.extension.compute_params):
            register_in_place_of(module, group.params[index], compute)
            group.params[index] = compute


def _group_plans(model: PreparedModel, mixed_precision, reduce_root_per_child: bool) -> list:
    """Per unit: (its policy, its groups' specs), before any buffer exists."""
    policy_of = {id(m): policy for m, policy, _ in model.inner_policies}
    plans = []
    for spec in model.specs:
        policy = policy_of.get(id(spec.module), mixed_precision)
        plans.append((policy, group_specs(spec, full_precision_param_ids(spec.module, policy), model.experts,
                                          reduce_root_per_child)))
    return plans


def _offload_choice(plans: list, offload, device: torch.device) -> tuple[frozenset, Optional[HostLink]]:
    """(positions of the groups whose main weights live on the host, the link they share)."""
    if offload is None:
        return frozenset(), None
    sizes = [offload_choice_bytes(sum(e[2].numel() for e in g.entries),
                                  resolve_dtypes(g.dtype, policy, g.requires_grad, g.full_precision).main)
             for policy, gspecs in plans for g in gspecs]
    to_host = choose_offloaded(sizes, offload.fraction)
    return to_host, (HostLink(device, offload) if to_host else None)


def initialize_units_from_meta(module: nn.Module, units: list, pending: dict, device: torch.device,
                               init_fn) -> None:
    """Run meta_init's initializers, writing each parameter's values into its group's main weights
    (directly where a main piece is the whole parameter), then rebuild the compute weights from them."""
    where = {id(p): (g, i) for unit in units for g in unit.groups for i, p in enumerate(g.params)}

    def write(param, full):
        group, index = where[id(param)]
        group.main.write_values(index, full)

    def restore(param):
        group, index = where[id(param)]
        group.repoint_param(index)

    def home(param, dtype):
        """The main piece, where it is the whole parameter in the dtype it was built in on ``device``
        (dp 1, or no_shard): its initializers write there, with no full-size temporary."""
        group, index = where[id(param)]
        local, shape = group.main_locals[index], group.shapes[index]
        whole = local.numel() == shape.numel() and local.dtype == dtype and local.device == device
        return local.view(shape) if whole else None

    initialize_meta_model(module, pending, write, restore, device, init_fn, home)
    for unit in units:
        for group in unit.groups:
            if group.keeps_compute_weights:      # flat ZeRO-3 gathers at use
                group.rebuild_compute_weights(async_op=False)
                group.wait_refresh()
