"""Nested ``fully_shard`` calls: submodules wrapped earlier become units of the outer call.

FSDP2's spelling is ``for block in model.blocks: fully_shard(block)`` then ``fully_shard(model)``:
each earlier call marks a unit. Here each call builds a complete engine, so the outer call takes
the inner engines apart again: it gathers their weights back into the original parameters,
removes their hooks and class, and returns which modules were units with which mixed-precision
policy. The outer call then shards everything once, as if it had been given those units.

What cannot compose raises, naming the submodule: a different strategy or process group, or an
inner model in the middle of a step. Optimizers built on an inner model's parameters are stale
afterwards (the step check in ``runtime/optimizer_hook.py`` names them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..runtime.optimizer_hook import mark_replaced, unwatch_optimizer_steps
from ..runtime.phase import Phase


def _group_ranks(group) -> list[int]:
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] if group is not None \
        else list(range(dist.get_world_size()))


def _outermost_wrapped(module: nn.Module, wrapped_class: type) -> list[tuple[str, nn.Module]]:
    """Wrapped submodules not inside another wrapped submodule (those own the inner ones' units)."""
    found = []
    for fqn, sub in module.named_modules():
        if fqn and isinstance(sub, wrapped_class) and not any(fqn.startswith(f + ".") for f, _ in found):
            found.append((fqn, sub))
    return found


def absorb_wrapped_submodules(module: nn.Module, strategy, comm, wrapped_class: type) -> list:
    """Unwrap every submodule an earlier ``fully_shard`` wrapped; return ``[(unit module, policy,
    reshard_after_forward)]``: each unit keeps its own call's settings, as FSDP2's nesting does."""
    units = []
    for fqn, inner in _outermost_wrapped(module, wrapped_class):
        engine = inner._fsdp_engine
        if engine.strategy.name != strategy.name:
            raise ValueError(
                f"sharding_strategy: submodule {fqn!r} was wrapped with {engine.strategy.name!r}, this call asks "
                f"for {strategy.name!r}; nested fully_shard calls must use one strategy.")
        if _group_ranks(engine.comm.group) != _group_ranks(comm.group):
            raise ValueError(
                f"process_group: submodule {fqn!r} was wrapped over ranks {_group_ranks(engine.comm.group)}, this "
                f"call shards over {_group_ranks(comm.group)}; nested fully_shard calls must use one group.")
        if not engine.phase.is_(Phase.IDLE) or any(g.has_unreduced_grads for g in engine.groups):
            raise RuntimeError(
                f"module: submodule {fqn!r} is in the middle of a training step (gradients not yet reduced); "
                "wrap the parent before training.")
        units.extend((unit.module, unit.mixed_precision, unit.reshard_after_forward) for unit in engine.units)
        _unwrap(inner, engine)
    return units


def _unwrap(inner: nn.Module, engine) -> None:
    """Give ``inner`` its whole weights (original dtype) back and make it a plain module again."""
    engine.param_slots.release()
    with torch.no_grad():
        for group in engine.groups:
            group.wait_unshard()
            group.wait_refresh()
            full_main = group.exporter.gather_full_main()
            for index, param in enumerate(group.params):
                param.data = group.exporter.full_param(full_main, index).to(group.param_dtype).clone()
                param.grad = None
    for name, main in inner._fsdp_main_params.items():
        mark_replaced(main, name)
    engine.remove_hooks()
    unwatch_optimizer_steps(engine)
    inner.__class__ = type(inner).__bases__[-1]     # fully_shard made (FullyShardedModule, original class)
    for attr in ("_fsdp_engine", "_fsdp_main_params", "_fsdp_main_of", "_fsdp_name_order"):
        inner.__dict__.pop(attr, None)
