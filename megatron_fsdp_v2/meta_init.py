"""Wrapping a model built on the meta device: only this rank's shards are ever kept.

[Note: initializing from meta]
``fully_shard(module_on_meta)`` first swaps every meta parameter for a placeholder on the process
group's device that has the parameter's shape but one element of memory (a zero-stride view), so
the groups and their buffers can be laid out as usual. Then it initializes the model module by
module and copies each parameter's values into the group buffers as soon as no later initializer
can touch it:

* Order: the modules of ``named_modules()``, children before their parent (post-order). Eager
  construction runs a child's initialization inside its parent's ``__init__``, before anything
  the parent itself does at the end of it (``nn.MultiheadAttention`` zeroes its ``out_proj.bias``
  after ``out_proj`` initialized it), so this order replays eager construction: with the same seed,
  meta + ``fully_shard`` gives bitwise the weights of eager construction + ``fully_shard`` on the
  same device type. Every rank runs it from its own RNG state (the caller's), so ranks agree
  without a broadcast.
* Initializer of a module: ``init_fn(module)`` if given, else its ``reset_parameters()``, else its
  ``_reset_parameters()`` (torch's ``nn.MultiheadAttention`` and ``nn.Transformer`` name it so).
  Modules without one are skipped; their parameters are written by an ancestor's initializer or
  stay uninitialized, which raises naming them.
* Memory: before a module's initializer runs, the parameters of its subtree not yet initialized
  get full-size storage in their original dtype; after the last initializer that covers a
  parameter (its highest ancestor that has one), its values go into the main-weight shard and the
  full-size storage is dropped. So besides the persistent shards a rank holds at most the
  parameters of the largest subtree whose root has an initializer (a leaf layer, or e.g. an
  attention block), never the model.
* A tied parameter is one object: every module holding it initializes it, in that order, and the
  last writer wins (an ``Embedding`` and a later tied ``Linear`` head: the head's initialization;
  eager construction that ties ``embedding.weight = head.weight`` after building both gives the same).
* Buffers on meta are materialized at their module's initializer (``reset_parameters`` or
  ``init_fn`` must fill them, e.g. rotary frequencies); any left on meta raise naming them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

__all__ = ["has_meta_state", "initialize_meta_model", "replace_meta_parameters"]


def has_meta_state(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def replace_meta_parameters(module: nn.Module, device: torch.device) -> dict:
    """Swap each meta parameter (every slot holding it, so ties stay tied) for a placeholder of
    the same shape, dtype, ``requires_grad`` and attributes on ``device`` backed by one element.
    Returns ``{id(placeholder): (name, shape)}`` of the parameters still to initialize."""
    replaced: dict = {}
    pending: dict = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for name, param in list(owner._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = replaced.get(id(param))
            if new is None:
                backing = torch.zeros((), dtype=param.dtype, device=device)
                new = nn.Parameter(backing.expand(param.shape), requires_grad=param.requires_grad)
                for key, value in vars(param).items():
                    setattr(new, key, value)
                replaced[id(param)] = new
                pending[id(new)] = (f"{owner_name}.{name}" if owner_name else name, tuple(param.shape))
            owner._parameters[name] = new
    return pending


def _initializer(module: nn.Module, init_fn: Optional[Callable]) -> Optional[Callable]:
    if init_fn is not None:
        return lambda: init_fn(module)
    for attr in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, attr, None)
        if callable(method):
            return method
    return None


def _post_order(module: nn.Module, prefix: str = "", seen: Optional[set] = None) -> list:
    seen = set() if seen is None else seen
    out = []
    for name, child in module.named_children():
        if id(child) not in seen:
            seen.add(id(child))
            out += _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    return out + [(prefix, module)]


def initialize_meta_model(module: nn.Module, pending: dict, write: Callable, restore: Callable,
                          device: torch.device, init_fn: Optional[Callable] = None) -> None:
    """Run the initializers ([Note: initializing from meta]); ``write(param, full)`` stores a
    parameter's final values, ``restore(param)`` points it back at what the wrapper holds."""
    steps = [(name, m, _initializer(m, init_fn)) for name, m in _post_order(module)]
    steps = [(name, m, run) for name, m, run in steps if run is not None]
    last_writer: dict = {}
    for index, (_, m, _) in enumerate(steps):
        for param in m.parameters():
            if id(param) in pending:
                last_writer[id(param)] = index
    live: dict = {}
    with torch.no_grad():
        for index, (name, m, run) in enumerate(steps):
            for param in m.parameters():
                if id(param) in pending and id(param) not in live:
                    param.data = torch.empty(pending[id(param)][1], dtype=param.dtype, device=device)
                    live[id(param)] = param
            for key, buffer in list(m._buffers.items()):     # its own buffers: its initializer fills them
                if buffer is not None and buffer.is_meta:
                    m._buffers[key] = torch.empty_like(buffer, device=device)
            run()
            for param in list(m.parameters()):
                if last_writer.get(id(param)) == index:
                    write(param, param.data)
                    restore(param)
                    live.pop(id(param), None)
                    pending.pop(id(param))
    if pending:
        names = sorted(name for name, _ in pending.values())
        raise ValueError(f"module: parameters {names[:20]} were built on the meta device but no initializer "
                         f"covers them (no reset_parameters() on their modules or an ancestor); pass "
                         f"init_fn=... to fully_shard.")
    left = [f"{n}.{k}" if n else k for n, m in module.named_modules() for k, b in m._buffers.items()
            if b is not None and b.is_meta]
    if left:
        raise ValueError(f"module: buffers {left[:20]} are still on the meta device after initialization; pass "
                         f"init_fn=... to fully_shard that fills them (e.g. rotary frequencies).")
