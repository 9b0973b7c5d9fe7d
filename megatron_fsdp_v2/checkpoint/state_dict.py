"""Sharded model and optimizer state dicts for torch.distributed.checkpoint (DCP), under the
original names and shapes; save_load.py saves and loads them atomically.

[Note: the checkpoint format]
Keys are the original module's names and values keep the original shapes, so a checkpoint reads
like a plain model's: sharded values are ``FlatRangeShard`` (see dcp_format.py, [Note: flat
ranges as DCP chunks]); replicated ones (no_shard weights, buffers, Adam's ``step``,
hyperparameters) are plain tensors that DCP writes once. Optimizer keys:
``state.<param name>.<state key>`` (per-element state is sharded like its parameter),
``param_groups.<i>.<hyperparameter>`` (numbers, bools, tuples and tensors, stored as tensors, so
nothing is pickled) and ``class`` (the optimizer's class name as UTF-8 bytes, so a load into
another optimizer can name both). ``save_checkpoint`` prefixes them with ``model.`` and
``optimizer.``. How a save is committed atomically: commit.py; checksums: integrity.py; what a load
never unpickles: safe_reader.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from .dcp_format import FlatRangeShard
from ..row_sharded import RowShardedTensor, local_piece


__all__ = ["load_model_state_dict", "load_optimizer_state_dict", "model_state_dict", "optimizer_param_names",
           "optimizer_state_dict"]

# ---------------------------------------------------------------- shards <-> state-dict values
def _sharded_module(model) -> nn.Module:
    """``model`` itself, checked: these functions take a module ``fully_shard`` wrapped (the Megatron
    adapter's wrappers go through ``megatron_fsdp_v2.megatron.checkpoint_targets``)."""
    if isinstance(model, nn.Module) and hasattr(model, "_fsdp_engine"):
        return model
    raise TypeError(f"model must be a module wrapped by fully_shard, got {type(model).__name__}; for Megatron's "
                    f"FullyShardedDataParallel use megatron_fsdp_v2.megatron.save_checkpoint / load_checkpoint.")


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """``optimizer`` itself, checked: a ``torch.optim.Optimizer``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; for Megatron's "
                    f"optimizers use megatron_fsdp_v2.megatron.save_checkpoint / load_checkpoint.")


def _owned_range(group, index: int) -> tuple[int, int]:
    """Which flattened elements of parameter ``index`` this rank keeps in its main weights."""
    if group.strategy.optim_sharded:
        piece = group.layout.shard_slice(index, group.comm.rank)
        return piece.param_start, piece.param_end
    return 0, group.layout.numels[index]


def _to_value(group, index: int, local: torch.Tensor) -> torch.Tensor:
    """A tensor laid out like ``group.main_params[index]`` (the main weights or optimizer state
    built from them) -> the state-dict value DCP sees: the tensor itself (whole, or a
    RowShardedTensor), or for plain sharded pieces a ``FlatRangeShard``. Both declare the same
    chunk: this rank's rows."""
    shape = tuple(group.shapes[index])
    if not group.strategy.optim_sharded:
        return local
    if math.prod(shape) == 0:
        return local_piece(local).new_zeros(shape)
    if group.mesh is not None and shape:
        return local if isinstance(local, RowShardedTensor) else group.main.facing_optimizer(local_piece(local), index)
    return FlatRangeShard(shape, local_piece(local).reshape(-1), _owned_range(group, index)[0])


def _to_local(group, index: int, value: torch.Tensor, key: str) -> torch.Tensor:
    """A state-dict value (ours, another DTensor, or a full tensor) -> this rank's part, laid out
    like ``group.main_locals[index]``."""
    start, end = _owned_range(group, index)
    if isinstance(value, RowShardedTensor):
        if value.row_splits != group.layout.row_splits(index):
            raise ValueError(f"{key}: holds rows split {value.row_splits} over ranks but this model splits them "
                             f"{group.layout.row_splits(index)}; dcp.load into this model's own state dict instead.")
        flat = value.to_local().reshape(-1)
    elif isinstance(value, FlatRangeShard):
        if (value.flat_start, value.flat_end) != (start, end):
            raise ValueError(f"{key}: holds flattened elements [{value.flat_start}, {value.flat_end}) but this rank "
                             f"owns [{start}, {end}); dcp.load into this model's own state dict instead.")
        flat = value.local_flat
    else:
        full = value.full_tensor() if isinstance(value, DTensor) else value   # torch.chunk pieces: gather
        flat = full.detach().reshape(-1)[start:end]
    return flat.view(group.main_locals[index].shape)


def _each_param(model):
    for group in model._fsdp_engine.groups:
        for index, names in enumerate(group.all_names):
            yield group, index, names


def _describe(value) -> object:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _show(keys: list, total: Optional[int] = None) -> str:
    """At most 20 keys, and how many more there are (of ``total``, default ``len(keys)``)."""
    total = len(keys) if total is None else total
    return str(keys[:20]) + (f" and {total - 20} more" if total > 20 else "")


def _raise_if_mismatched(what: str, expected: dict, got: dict, aliases: dict, strict: bool = True) -> list:
    """Compare {key: shape}; ``aliases`` maps a tied name to all its names. Returns the missing keys."""
    missing = [k for k in expected if k not in got and not any(a in got for a in aliases.get(k, ()))]
    unexpected = [k for k in got if k not in expected]
    misshaped = [f"{k}: expected {expected[k]}, got {got[k]}" for k in got if k in expected and got[k] != expected[k]]
    if misshaped or (strict and (missing or unexpected)):
        raise ValueError(f"{what} does not match the model: missing keys {_show(missing)}, "
                         f"unexpected keys {_show(unexpected)}, mis-shaped keys {_show(misshaped)}.")
    return missing


# ---------------------------------------------------------------- model
def model_state_dict(model, prefix: str = "", keep_vars: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """``model.state_dict()``: every parameter (all tied names) and persistent buffer under its
    original name and shape, in main-weight precision; sharded values share this rank's main weights:
    RowShardedTensors (DTensors, what ``torch.distributed.checkpoint.state_dict`` expects) or, with
    ``dtensor_params=False`` and for 0-d parameters, ``FlatRangeShard``. ``keep_vars`` returns
    replicated parameters undetached."""
    model = _sharded_module(model)
    values = {}
    for group, index, names in _each_param(model):
        main = group.main_params[index]
        value = _to_value(group, index, main if keep_vars and not group.strategy.optim_sharded else main.detach())
        for name in names:
            values[name] = value
    for name, buffer in model._fsdp_buffers():
        values[name] = buffer if keep_vars else buffer.detach()
    order = model._fsdp_name_order
    return OrderedDict((prefix + k, v) for k, v in sorted(values.items(), key=lambda kv: order.get(kv[0], 1 << 30)))


def _model_shapes(model) -> tuple[dict, dict]:
    shapes, aliases = {}, {}
    for group, index, names in _each_param(model):
        for name in names:
            shapes[name] = tuple(group.shapes[index])
            aliases[name] = names
    for name, buffer in model._fsdp_buffers():
        shapes[name] = tuple(buffer.shape)
    return shapes, aliases


def load_model_state_dict(model, state_dict: dict, strict: bool = True, assign: bool = False) -> _IncompatibleKeys:
    """``model.load_state_dict()``: values may be this model's own (filled by ``dcp.load``) or full
    tensors (``torch.load`` of an export); each rank copies its part into its main weights, then the
    compute weights are refreshed."""
    model = _sharded_module(model)
    if assign:
        raise ValueError("load_state_dict: assign=True is not supported (main weights are views of flat buffers), "
                         "got assign=True; use the default assign=False.")
    shapes, aliases = _model_shapes(model)
    got = {k: _describe(v) for k, v in state_dict.items()}
    missing = _raise_if_mismatched("load_state_dict: state_dict", shapes, got, aliases, strict)
    params = {name: (group, index) for group, index, names in _each_param(model) for name in names}
    buffers = dict(model._fsdp_buffers())
    with torch.no_grad():
        for key, value in state_dict.items():
            if key in params:
                group, index = params[key]
                group.main_locals[index].copy_(_to_local(group, index, value, key))
            elif key in buffers:
                buffers[key].copy_(value)
    model._fsdp_engine.weights.reload()
    return _IncompatibleKeys(missing, [k for k in state_dict if k not in shapes])


# ---------------------------------------------------------------- optimizer
def _optimizer_params(model, optimizer) -> list:
    """(position in optimizer.state_dict(), param, name, hyperparameters, group, index) per param."""
    model = _sharded_module(model)
    where = {id(m): (g, i) for g in model._fsdp_engine.groups for i, m in enumerate(g.main_params)}
    name_of = {id(m): n for n, m in model._fsdp_main_params.items()}
    out, foreign = [], 0
    for hparams in optimizer.param_groups:
        for p in hparams["params"]:
            if id(p) in where:
                out.append((len(out) + foreign, p, name_of[id(p)], hparams, *where[id(p)]))
            else:
                foreign += 1
    if foreign:
        raise ValueError(f"optimizer: {foreign} of its parameters are not main weights of this model; build the "
                         f"optimizer from model.parameters() after fully_shard.")
    return out


def _is_per_element(key: str, shape, param_shape) -> bool:
    """Per-element state (Adam moments, momentum) is sharded like its parameter; ``step`` (named as
    torch.optim itself special-cases it) and other scalars are replicated."""
    return key != "step" and tuple(shape) == tuple(param_shape)


def _state_value(group, index, main, name: str, key: str, local) -> torch.Tensor:
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"optimizer state {name}.{key}: only tensors can be checkpointed, got {type(local).__name__}.")
    if "." in key:
        raise ValueError(f"optimizer state {name}.{key}: state keys must not contain '.', got {key!r}.")
    if _is_per_element(key, local.shape, main.shape):
        return _to_value(group, index, local)
    if group.strategy.optim_sharded and local.dim() > 0:
        raise ValueError(f"optimizer state {name}.{key} has shape {tuple(local.shape)}, neither the parameter's "
                         f"(sharded) shape {tuple(main.shape)} nor a scalar; it cannot be sharded.")
    return local


def _fresh_state(optimizer, hparams: dict, p) -> dict:
    """The state torch.optim creates at the first step, built without stepping (a warm-up step advances
    Adam's step counter: NVIDIA/Megatron-LM#5974 made updates 1.34x too small that way). Only for optimizers whose state we know."""
    if not p.requires_grad:
        return {}
    if isinstance(optimizer, torch.optim.SGD):
        return {"momentum_buffer": torch.zeros_like(p)} if hparams.get("momentum", 0) else {}
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        on_device = hparams.get("capturable") or hparams.get("fused")
        state = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        if hparams.get("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(p)
        return state
    initial_state = getattr(optimizer, "initial_state", None)     # optimizers that say (optim/muon.py)
    if callable(initial_state):
        return initial_state(p)
    raise ValueError(f"optimizer_state_dict: {type(optimizer).__name__} has no state yet and its state layout is "
                     f"unknown (known: Adam, AdamW, SGD, and optimizers with an initial_state(param) method); use "
                     f"load_checkpoint(), which reads it from the checkpoint.")


def _encode_hparam(value) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, (int, float)):
        return torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                          for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None   # None, strings, ...: configuration, not training state; not saved


def _decode_hparam(tensor: torch.Tensor, current):
    """Back to the type the live optimizer uses for this hyperparameter."""
    if isinstance(current, torch.Tensor):
        return tensor.to(dtype=current.dtype, device=current.device)
    if isinstance(current, (bool, int, float)):
        return type(current)(tensor.item())
    return type(current)(tensor.tolist())


CLASS_KEY = "class"
_CLASS_BYTES = 64       # fixed: DCP needs the same shape on save and load, whatever the two classes are


def _encode_class(optimizer) -> torch.Tensor:
    """The optimizer's class name as UTF-8 in a zero-padded uint8 tensor (a tensor, so nothing is pickled)."""
    name = bytearray(type(optimizer).__name__.encode()[:_CLASS_BYTES])
    encoded = torch.zeros(_CLASS_BYTES, dtype=torch.uint8)
    encoded[:len(name)] = torch.frombuffer(name, dtype=torch.uint8)
    return encoded


def _decode_class(value) -> str:
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        return bytes(value.tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
    return "an optimizer it does not name"


def _state_keys_needed(optimizer, hparams: dict, p) -> Optional[set]:
    """The per-parameter state keys ``optimizer.step`` reads once a parameter has state (None:
    unknown). torch's Adam/AdamW raise ``KeyError: 'step'`` at their first step if a loaded state
    lacks one; SGD silently restarts momentum."""
    if isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)) or \
            callable(getattr(optimizer, "initial_state", None)):
        return set(_fresh_state(optimizer, hparams, p))
    live = optimizer.state.get(p)
    return set(live) if live else None


def _missing_state(optimizer, params: list, loaded: dict) -> list:
    """``state.<name>.<key>`` entries ``optimizer`` needs that ``loaded`` ({param name: its loaded
    state keys}) lacks. A parameter without any loaded state is fine when others have some: it had
    no gradient before the save, and the optimizer creates its state at its first step."""
    any_state = any(loaded.values())
    missing = []
    for _, p, name, hparams, _, _ in params:
        needed, have = _state_keys_needed(optimizer, hparams, p), loaded.get(name, set())
        if needed and (have or not any_state):
            missing += [f"state.{name}.{key}" for key in sorted(needed - have)]
    return missing


def _optimizer_mismatch(what: str, saved_class: str, optimizer, missing: list, total: int) -> ValueError:
    return ValueError(f"{what}: the checkpoint's optimizer state was saved by {saved_class} and does not fit "
                      f"{type(optimizer).__name__}: missing keys {_show(missing, total)} (the optimizer class and "
                      f"hyperparameters such as momentum or amsgrad decide which state keys exist); build the "
                      f"optimizer the checkpoint was saved with, or load the model only (optimizer=None).")


def optimizer_param_names(model, optimizer) -> list:
    """The names (as ``optimizer_state_dict`` keys them) of the parameters ``optimizer`` steps, in its order."""
    return [name for _, _, name, *_ in _optimizer_params(model, _torch_optimizer(optimizer))]


def optimizer_state_dict(model, optimizer) -> "OrderedDict[str, torch.Tensor]":
    """The optimizer's state for DCP, under parameter names (see the note at the top). ``model``
    and ``optimizer`` may be wrappers (the Megatron adapter, Megatron's optimizers)."""
    optimizer = _torch_optimizer(optimizer)
    sd: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    params = _optimizer_params(model, optimizer)
    stateless = not any(optimizer.state.get(p) for _, p, *_ in params)
    for _, p, name, hparams, group, index in params:
        state = _fresh_state(optimizer, hparams, p) if stateless else optimizer.state.get(p, {})
        for key, local in state.items():
            if local is not None:
                sd[f"state.{name}.{key}"] = _state_value(group, index, p, name, key, local)
    for i, hparams in enumerate(optimizer.param_groups):
        for key, value in hparams.items():
            encoded = None if key == "params" else _encode_hparam(value)
            if encoded is not None:
                sd[f"param_groups.{i}.{key}"] = encoded
    sd[CLASS_KEY] = _encode_class(optimizer)
    return sd


def load_optimizer_state_dict(model, optimizer, state_dict: dict) -> None:
    """Install a state dict of ``optimizer_state_dict``'s form (filled by ``dcp.load``) through
    ``optimizer.load_state_dict``. Hyperparameters the optimizer does not have are ignored. State
    of another optimizer (SGD's into AdamW) raises here, naming both classes and the missing keys,
    not at the first step."""
    optimizer = _torch_optimizer(optimizer)
    listed = _optimizer_params(model, optimizer)
    params = {name: (pos, p, group, index) for pos, p, name, _, group, index in listed}
    packed = optimizer.state_dict()
    groups, state, unexpected, misshaped, loaded = packed["param_groups"], {}, [], [], {}
    for key, value in state_dict.items():
        kind, _, rest = key.partition(".")
        if key == CLASS_KEY:
            continue
        if kind == "state" and "." in rest and rest.rsplit(".", 1)[0] in params:
            name, sub = rest.rsplit(".", 1)
            pos, p, group, index = params[name]
            loaded.setdefault(name, set()).add(sub)
            if not isinstance(value, torch.Tensor):
                misshaped.append(f"{key}: expected a tensor, got {type(value).__name__}")
            elif _is_per_element(sub, value.shape, group.shapes[index]):
                local = _to_local(group, index, value, key)
                in_place = isinstance(value, (FlatRangeShard, RowShardedTensor))    # dcp.load filled it
                state.setdefault(pos, {})[sub] = group.main.facing_optimizer(local if in_place else local.clone(), index)
            elif group.strategy.optim_sharded and value.dim() > 0:
                misshaped.append(f"{key}: expected {tuple(group.shapes[index])} or a scalar, got {tuple(value.shape)}")
            else:
                state.setdefault(pos, {})[sub] = value
        elif kind == "param_groups" and rest.partition(".")[0].isdigit() and int(rest.partition(".")[0]) < len(groups):
            i, _, hkey = rest.partition(".")
            if hkey in groups[int(i)] and hkey != "params":
                groups[int(i)][hkey] = _decode_hparam(value, groups[int(i)][hkey])
        else:
            unexpected.append(key)
    if unexpected or misshaped:
        raise ValueError(f"load_optimizer_state_dict: state_dict does not match the optimizer: unexpected keys "
                         f"{unexpected[:20]}, mis-shaped keys {misshaped[:20]}.")
    missing = _missing_state(optimizer, listed, loaded)
    if missing:
        raise _optimizer_mismatch("load_optimizer_state_dict", _decode_class(state_dict.get(CLASS_KEY)), optimizer,
                                  missing, len(missing))
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _optimizer_targets(model, optimizer, metadata: dict, prefix: str) -> tuple:
    """(tensors to ``dcp.load`` the checkpoint's optimizer entries into, {param name: its state
    keys in the checkpoint}), shaped from the checkpoint's metadata, so any optimizer (and state
    saved before some parameters had any) loads; existing state is reused. The optimizer's own
    class entry is not loaded (only an error message needs it)."""
    optimizer = _torch_optimizer(optimizer)
    params = {name: (p, hparams, group, index) for _, p, name, hparams, group, index in _optimizer_params(model, optimizer)}
    targets: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    unexpected, loaded = [], {}
    for key, md in metadata.items():
        rest = key[len(prefix):]
        if rest == CLASS_KEY:
            continue
        if rest.startswith("state.") and "." in rest[6:] and rest[6:].rsplit(".", 1)[0] in params:
            name, sub = rest[6:].rsplit(".", 1)
            loaded.setdefault(name, set()).add(sub)
            p, _, group, index = params[name]
            existing = optimizer.state.get(p, {}).get(sub)
            if _is_per_element(sub, md.size, group.shapes[index]):
                fits = isinstance(existing, torch.Tensor) and existing.shape == p.shape
                local = existing if fits else torch.zeros_like(p, dtype=md.properties.dtype)
            else:
                fits = isinstance(existing, torch.Tensor) and existing.shape == md.size
                local = existing if fits else torch.zeros(md.size, dtype=md.properties.dtype)
            targets[key] = _state_value(group, index, p, name, sub, local)
        elif rest.startswith("param_groups."):
            i, _, hkey = rest[13:].partition(".")
            if not (i.isdigit() and int(i) < len(optimizer.param_groups)):
                unexpected.append(key)
            elif hkey != "params" and _encode_hparam(optimizer.param_groups[int(i)].get(hkey)) is not None:
                targets[key] = _encode_hparam(optimizer.param_groups[int(i)][hkey])
        elif key.startswith(prefix):
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"checkpoint optimizer state does not match the optimizer: unexpected keys {unexpected[:20]} "
                         f"(state of parameters the model lacks, or more param_groups than {len(optimizer.param_groups)}).")
    return targets, loaded
