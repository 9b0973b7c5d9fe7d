"""``summon_full_params``: the whole weights on the module's parameters, outside forward.

Outside forward and backward a wrapped module's own parameters hold only what the strategy keeps:
ZeRO-3 leaves them as 0-element tensors (a logged weight norm would read 0.0), and with a
low-precision policy ZeRO-1/2 hold the compute copy. FSDP1 offered ``summon_full_params`` for
this; ours gathers the main weights (full precision, every strategy), points every parameter at
its full tensor for the duration of the context, and on exit optionally writes what the caller
changed back into this rank's main-weight shard, then refreshes the compute weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from .runtime.param_swap import register_in_place_of
from .runtime.phase import Phase
from .group.shard_order import own_from_natural


@contextlib.contextmanager
def summon_full_params(module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False):
    """Inside the context, ``module``'s parameters (as its submodules hold them, e.g.
    ``module.layer.weight``) are the full tensors in main-weight precision, equal on every rank.

    Args (FSDP1's):
        module: a module returned by ``fully_shard`` (the Megatron adapter's wrapper has its own
            ``summon_full_params`` method, which passes its ``.module``).
        recurse: accepted for FSDP1 compatibility; the whole model is always gathered (one call
            covers every unit).
        writeback: copy in-place changes back into the main weights on exit (each rank keeps its
            shard of what it holds; change every rank the same way). ``False`` discards them.
        rank0_only: only data-parallel rank 0 sees the full weights (the others keep what they
            hold); needs ``writeback=False``, as in FSDP1.
        offload_to_cpu: the full tensors live on the CPU (saves device memory for large models).
        with_grads: also give each parameter its full reduced gradient as ``.grad``.

    Collective: every rank of the data-parallel group must enter it together. Not allowed during
    forward or backward (the module's own all-gathers own the parameters then).

    Inside it grad mode is off, as under ``torch.no_grad()``: FSDP1 allows no forward or backward
    in its ``summon_full_params`` either, and a graph built on full tensors that leave the module
    on exit could only mislead. So reading a weight builds no graph (``float(p.norm())`` without
    torch's "requires_grad=True to a scalar" warning) and in-place edits need no ``no_grad()``;
    ``p.requires_grad`` still says which parameters train.
    """
    engine = _engine_of(module)
    if rank0_only and writeback:
        raise ValueError("summon_full_params: rank0_only=True needs writeback=False (the other ranks hold no "
                         "full copy to write back), got writeback=True.")
    if not engine.phase.is_(Phase.IDLE):
        raise RuntimeError(f"summon_full_params() called during {engine.phase.phase.value}; call it between steps.")
    engine.wait_gradient_reduces()
    receives = not rank0_only or engine.comm.rank == 0
    held_main = engine.param_slots.holding_main and receives
    if receives:
        engine.param_slots.hold_compute()      # the full weights go on the compute parameters
    restore = []
    stand_ins = []                          # (compute parameter, the plain full one registered meanwhile)
    gathered = []
    with torch.no_grad():
        for group in engine.groups:
            group.wait_unshard()
            group.wait_refresh()
            full_main = group.exporter.gather_full_main()
            full_grad = group.exporter.gather_full_grad() if with_grads else None
            if offload_to_cpu:
                full_main = full_main.cpu()
                full_grad = None if full_grad is None else full_grad.cpu()
            gathered.append((group, full_main))
            if not receives:
                continue
            for index, param in enumerate(group.params):
                frozen = full_grad is None or not group.reduced[index]     # frozen since wrapping: None
                grad = None if frozen else group.exporter.full_param(full_grad, index)
                if group.extension is not None:      # a class that gathers itself: a plain parameter instead
                    stand_in = nn.Parameter(group.exporter.full_param(full_main, index), requires_grad=param.requires_grad)
                    stand_in.grad = grad
                    register_in_place_of(module, param, stand_in)
                    stand_ins.append((param, stand_in))
                    continue
                restore.append((param, param.data, param.grad))
                param.data = group.exporter.full_param(full_main, index)
                param.grad = grad
    try:
        with torch.no_grad():
            yield module
    finally:
        with torch.no_grad():
            for param, data, grad in restore:
                param.data = data
                param.grad = grad
            for param, stand_in in stand_ins:
                register_in_place_of(module, stand_in, param)
            if held_main:
                engine.param_slots.hold_main()
            if writeback:
                for group, full_main in gathered:
                    group.main_shard.copy_(own_from_natural(full_main, group.layout, group.comm.rank)
                                           if group.strategy.optim_sharded
                                           else full_main)
                engine.weights.reload()


def _engine_of(module):
    engine = getattr(module, "_fsdp_engine", None) if isinstance(module, torch.nn.Module) else None
    if engine is not None:
        return engine
    raise TypeError(f"module: expected a module wrapped by fully_shard, got {type(module).__name__}.")
