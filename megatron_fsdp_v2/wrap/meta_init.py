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
  Modules without one are skipped; a parameter that no initializer touches stays uninitialized,
  which raises naming it.
* Which parameters an initializer touches: found before anything is allocated, by running every
  initializer once on meta stand-ins of the parameters (under ``torch.device("meta")`` and
  ``fork_rng``: no memory, no random number drawn) and noting the ones its ops read or write; an
  initializer that fails on meta counts as touching its whole subtree. (Counting a module's whole
  subtree instead made the root, which ``init_fn`` visits like any module, hold every parameter
  until the end: the full model materialized, and parameters it never wrote stored as garbage.)
* Memory: before an initializer runs, the parameters it touches that are not yet materialized get
  full-size storage in the dtype the model was built in (not the wrapper's compute dtype, which
  the placeholders may carry by then: values are drawn as eager construction draws them); after
  the last initializer that touches a parameter, its values go into the main-weight shard and the
  full-size storage is dropped (the parameter keeps its shape on one element until all ran). So
  besides the persistent shards a rank holds at most the parameters that one initializer and
  those before it still to be finished touch (a leaf layer, or e.g. an attention block whose
  initializer rewrites its children's), never the model. Where the wrapper keeps the whole
  parameter in that dtype on that device (its main piece at dp 1, or under ``no_shard``), that
  piece is the storage the initializers write (``home``): nothing is allocated and nothing copied,
  so at dp 1 the wrap holds the main weights alone, as FSDP2's ``to_empty`` + ``reset_parameters``.
  At dp > 1 the whole parameter is still materialized while it initializes (FSDP2 initializes its
  DTensor shards in place, with values that are not eager construction's).
* Tensor classes that gather themselves (FSDP2's extension protocol, e.g. torchao's float8
  weights) keep their class: the placeholder is the class around its one element, and its data
  (a Python attribute of the class, which ``.data =`` does not reach) is set through
  ``extensions/protocol.py:set_data``.
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
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..extensions.protocol import TensorClass, data_of, has_protocol, set_data

__all__ = ["has_meta_state", "initialize_meta_model", "replace_meta_parameters"]


def has_meta_state(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def replace_meta_parameters(module: nn.Module, device: torch.device) -> dict:
    """Swap each meta parameter (every slot holding it, so ties stay tied) for a placeholder of
    the same shape, dtype, ``requires_grad``, attributes and class (a tensor subclass gathered
    through FSDP2's extension protocol keeps it) on ``device`` backed by one element.
    Returns ``{id(placeholder): (name, shape, dtype)}`` of the parameters still to initialize (the
    dtype they were built in: the wrapper may re-type the placeholders to its compute dtype)."""
    replaced: dict = {}
    pending: dict = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for name, param in list(owner._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = replaced.get(id(param))
            if new is None:
                backing = torch.zeros((), dtype=param.dtype, device=device).expand(param.shape)
                if has_protocol(param):          # keeps its class (e.g. torchao float8): gathered through it
                    backing = TensorClass(param).rewrap(backing)
                new = nn.Parameter(backing, requires_grad=param.requires_grad)
                for key, value in vars(param).items():
                    setattr(new, key, value)
                replaced[id(param)] = new
                pending[id(new)] = (f"{owner_name}.{name}" if owner_name else name, tuple(param.shape), param.dtype)
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


class _Touches(TorchDispatchMode):
    """The storages that the ops run under it read or write."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in pytree.tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.storages.add(t.untyped_storage()._cdata)
        return func(*args, **(kwargs or {}))


def _touched_by_steps(module: nn.Module, steps: list, pending: dict) -> list:
    """Per step, the ids of the parameters still to initialize that its initializer reads or
    writes, found by running every initializer once on meta stand-ins of them (nothing is
    allocated, no random number drawn). A step that fails on meta counts as touching all of its
    subtree's. So a parameter is materialized by the first initializer that uses it and written
    after the last, whatever runs in between: with ``init_fn`` every module is a step, and the
    root's (which writes nothing) no longer keeps the whole model materialized."""
    stand_ins, slots = {}, []
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and id(param) in pending:
                if id(param) not in stand_ins:
                    _, shape, dtype = pending[id(param)]
                    stand_ins[id(param)] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                                        requires_grad=param.requires_grad)
                slots.append((owner, name, param))
                owner._parameters[name] = stand_ins[id(param)]
    param_of = {s.untyped_storage()._cdata: param_id for param_id, s in stand_ins.items()}
    out = []
    try:
        for _, m, run in steps:
            touches = _Touches()
            try:
                # meta: a factory without a device makes no memory; fork_rng: the random state the
                # real run starts from is the caller's, whatever an initializer draws here
                with torch.random.fork_rng(devices=_rng_devices()), torch.device("meta"), torch.no_grad(), touches:
                    run()
                out.append({param_of[key] for key in touches.storages if key in param_of})
            except Exception:                                    # noqa: BLE001 -- judged conservatively
                out.append({param_of[p.untyped_storage()._cdata] for p in m.parameters()
                            if p.untyped_storage()._cdata in param_of})
    finally:
        for owner, name, param in slots:
            owner._parameters[name] = param
    return out


def _rng_devices() -> list:
    """The accelerator devices whose random state an initializer could draw from (fork_rng's list)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def _post_order(module: nn.Module, prefix: str = "", seen: Optional[set] = None) -> list:
    seen = set() if seen is None else seen
    out = []
    for name, child in module.named_children():
        if id(child) not in seen:
            seen.add(id(child))
            out += _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    return out + [(prefix, module)]


def _materialize(param: nn.Parameter, entry: tuple, device: torch.device, home: Optional[Callable],
                 in_place: dict) -> None:
    """Give ``param`` full-size storage in the dtype it was built in: where the wrapper keeps its
    whole values (``home``), else a new tensor on ``device``."""
    _, shape, dtype = entry
    values = home(param, dtype) if home is not None else None
    if values is None:
        values = torch.empty(shape, dtype=dtype, device=device)
    else:
        in_place[id(param)] = values
    set_data(param, values)


def _still_home(values: torch.Tensor, home: Optional[torch.Tensor]) -> bool:
    """Whether ``values`` is still the wrapper's storage ``home`` (nothing left to write)."""
    return home is not None and values.data_ptr() == home.data_ptr() and values.shape == home.shape


def initialize_meta_model(module: nn.Module, pending: dict, write: Callable, restore: Callable,
                          device: torch.device, init_fn: Optional[Callable] = None,
                          home: Optional[Callable] = None) -> None:
    """Run the initializers ([Note: initializing from meta]); ``write(param, full)`` stores a
    parameter's final values, ``restore(param)`` points it back at what the wrapper holds;
    ``home(param, dtype)``: where the wrapper keeps the whole of ``param`` in ``dtype`` (its
    initializers then write there, and nothing is written after), or None."""
    steps = [(name, m, _initializer(m, init_fn)) for name, m in _post_order(module)]
    steps = [(name, m, run) for name, m, run in steps if run is not None]
    touched = _touched_by_steps(module, steps, pending)
    last_toucher: dict = {}
    for index, ids in enumerate(touched):
        for param_id in ids:
            last_toucher[param_id] = index
    params = {id(p): p for p in module.parameters() if id(p) in pending}
    materialized: set = set()
    in_place: dict = {}                    # id(param) -> the wrapper's storage its initializers write
    written: list = []
    with torch.no_grad():
        for index, (name, m, run) in enumerate(steps):
            for param_id in touched[index] - materialized:
                _materialize(params[param_id], pending[param_id], device, home, in_place)
                materialized.add(param_id)
            for key, buffer in list(m._buffers.items()):     # its own buffers: its initializer fills them
                if buffer is not None and buffer.is_meta:
                    m._buffers[key] = torch.empty_like(buffer, device=device)
            run()
            for param_id in touched[index]:
                if last_toucher[param_id] == index:
                    param = params[param_id]
                    if not _still_home(data_of(param), in_place.get(param_id)):   # (an initializer may set .data)
                        write(param, data_of(param))
                    _, shape, dtype = pending.pop(param_id)
                    # until every initializer ran: the full shape (a later one may read it) on one element
                    set_data(param, torch.zeros((), dtype=dtype, device=device).expand(shape))
                    written.append(param)
    for param in written:
        restore(param)
    if pending:
        names = sorted(entry[0] for entry in pending.values())
        raise ValueError(f"module: parameters {names[:20]} were built on the meta device but no initializer "
                         f"covers them (no reset_parameters() on their modules, or on an ancestor, reads or "
                         f"writes them); pass init_fn=... to fully_shard.")
    left = [f"{n}.{k}" if n else k for n, m in module.named_modules() for k, b in m._buffers.items()
            if b is not None and b.is_meta]
    if left:
        raise ValueError(f"module: buffers {left[:20]} are still on the meta device after initialization; pass "
                         f"init_fn=... to fully_shard that fills them (e.g. rotary frequencies).")
