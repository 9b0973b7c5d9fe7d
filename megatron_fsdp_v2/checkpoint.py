"""Distributed checkpoints with torch.distributed.checkpoint (DCP): sharded model and optimizer
state dicts, atomic save/load helpers and a single-file full export.

[Note: the checkpoint format]
Keys are the original module's names and values keep the original shapes, so a checkpoint reads
like a plain model's: sharded values are ``FlatRangeShard`` (see dcp_format.py, [Note: flat
ranges as DCP chunks]); replicated ones (no_shard weights, buffers, Adam's ``step``,
hyperparameters) are plain tensors that DCP writes once. Optimizer keys:
``state.<param name>.<state key>`` (per-element state is sharded like its parameter),
``param_groups.<i>.<hyperparameter>`` (numbers, bools, tuples and tensors, stored as tensors, so
nothing is pickled) and ``class`` (the optimizer's class name as UTF-8 bytes, so a load into
another optimizer can name both). ``save_checkpoint`` prefixes them with ``model.`` and
``optimizer.``. How a save is committed atomically: checkpoint_commit.py; checksums:
checkpoint_integrity.py; what a load never unpickles: safe_reader.py.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from . import checkpoint_commit
from .checkpoint_integrity import ChecksummedFileSystemWriter, CheckpointCorruptError
from .collective_errors import gather_reports, raise_on_every_rank, raise_reported
from .dcp_format import FlatRangeShard
from .row_sharded import RowShardedTensor, local_piece
from .safe_reader import SafeFileSystemReader, TensorsOnlyLoadPlanner, UnsafeCheckpointError

from .experts import expert_names_refusal

__all__ = ["export_full_state_dict", "load_checkpoint", "load_optimizer_state_dict", "optimizer_state_dict",
           "save_checkpoint"]

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
        return local if isinstance(local, RowShardedTensor) else group.facing_optimizer(local_piece(local), index)
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
    model._fsdp_engine.refresh_weights(wait=True)
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
    raise ValueError(f"optimizer_state_dict: {type(optimizer).__name__} has no state yet and its state layout is "
                     f"unknown (known: Adam, AdamW, SGD); use load_checkpoint(), which reads it from the checkpoint.")


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
    if isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)):
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
                state.setdefault(pos, {})[sub] = group.facing_optimizer(local if in_place else local.clone(), index)
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


# ---------------------------------------------------------------- atomic save / load, export
def save_checkpoint(path: "str | os.PathLike", model, optimizer=None) -> None:
    """Save model (and optimizer) state under ``path`` atomically, with a checksum of every file:
    rank 0 first recovers from any crash of an earlier save, every rank writes its shards into
    ``path.tmp`` (``.checksums.json`` last), then rank 0 puts ``path.tmp`` in place of ``path``.
    A crash at any point leaves the newest complete checkpoint loadable (checkpoint_commit.py,
    [Note: committing a checkpoint directory]). A failure raises on every rank."""
    model = _sharded_module(model)
    if model._fsdp_engine.experts is not None:
        raise expert_names_refusal("save_checkpoint")
    path = os.fspath(path)
    group = _checkpoint_group(model)
    leader = dist.get_rank(group) == 0
    _on_leader(group, leader, lambda: checkpoint_commit.recover(path),
               f"save_checkpoint({path!r}): recovering from an earlier save")
    sd = OrderedDict((f"model.{k}", v) for k, v in model_state_dict(model).items())
    if optimizer is not None:
        sd.update((f"optimizer.{k}", v) for k, v in optimizer_state_dict(model, optimizer).items())
    tmp = checkpoint_commit.tmp_dir(path)
    try:
        dcp.save(sd, storage_writer=ChecksummedFileSystemWriter(tmp), process_group=group)
    except BaseException as exc:
        if leader:                 # DCP raised on every rank, after every rank stopped writing
            try:
                checkpoint_commit.remove(tmp)
            except OSError:
                pass               # incomplete (no manifest): the next save's recover deletes it
        if isinstance(exc, CheckpointException):    # a BaseException: `except Exception` would miss it
            raise RuntimeError(f"save_checkpoint: writing {path!r} failed on ranks {sorted(exc.failures)}; the "
                               f"previous checkpoint there is intact. {exc}") from exc
        raise
    _on_leader(group, leader, lambda: checkpoint_commit.commit(path),
               f"save_checkpoint({path!r}): committing {tmp!r}")


def _checkpoint_group(model):
    """The ranks that save and load one checkpoint together: the data-parallel group; with hybrid
    sharding every replica of every shard, which must then be the whole world (replicas write their
    identical shards once: DCP keeps one writer per chunk)."""
    engine = model._fsdp_engine
    if engine.replicas is None:
        return engine.comm.group
    if engine.comm.size * engine.replicas.size != dist.get_world_size():
        raise ValueError(f"save_checkpoint / load_checkpoint: with hybrid sharding the checkpoint is written by "
                         f"every replica of every shard, which must be the whole world ({dist.get_world_size()} "
                         f"ranks), got {engine.replicas.size} replicas x {engine.comm.size} shards.")
    return dist.group.WORLD


def _on_leader(group, leader: bool, step, what: str) -> None:
    """Run ``step()`` on the group's rank 0 only (directory renames); an exception there is raised
    on every rank, so none waits alone in the next collective."""
    error = None
    if leader:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    raise_on_every_rank(group, error, what)


class _LoadPlan:
    """What a rank found out about a checkpoint before reading any tensor of it."""

    def __init__(self, directory: str, reader: SafeFileSystemReader, metadata: dict):
        self.directory, self.reader, self.metadata = directory, reader, metadata
        self.state_dict: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self.missing: list = []          # optimizer state keys the live optimizer needs and the checkpoint lacks


def _plan_load(path: str, model, optimizer) -> _LoadPlan:
    directory = checkpoint_commit.newest_complete(path)
    reader = SafeFileSystemReader(directory, require_checksums=True)
    plan = _LoadPlan(directory, reader, reader.read_metadata().state_dict_metadata)
    model_md = {k[6:]: v for k, v in plan.metadata.items() if k.startswith("model.")}
    if not model_md:
        raise ValueError(f"checkpoint {directory!r} has no 'model.*' keys, so save_checkpoint did not write it; "
                         f"load a dcp.save(model.state_dict()) checkpoint with dcp.load and model.load_state_dict.")
    shapes, aliases = _model_shapes(model)
    got = {k: tuple(md.size) if isinstance(md, TensorStorageMetadata) else "non-tensor bytes"
           for k, md in model_md.items()}
    _raise_if_mismatched(f"checkpoint {directory!r}", shapes, got, aliases)
    plan.state_dict.update((f"model.{k}", v) for k, v in model_state_dict(model).items() if k in model_md)
    if optimizer is not None:
        optim_md = {k: v for k, v in plan.metadata.items() if k.startswith("optimizer.")}
        if not optim_md:
            raise ValueError(f"checkpoint {directory!r} has no optimizer state (no 'optimizer.*' keys); "
                             f"pass optimizer=None to load the model only.")
        bytes_keys = [k for k, md in optim_md.items() if not isinstance(md, TensorStorageMetadata)]
        if bytes_keys:
            raise UnsafeCheckpointError(f"checkpoint optimizer entries {bytes_keys[:20]} are pickled bytes, not "
                                        f"tensors; they are not unpickled.")
        targets, loaded = _optimizer_targets(model, optimizer, optim_md, "optimizer.")
        plan.state_dict.update(targets)
        torch_optimizer = _torch_optimizer(optimizer)
        plan.missing = _missing_state(torch_optimizer, _optimizer_params(model, torch_optimizer), loaded)
    return plan


def _read_failure(what: str, exc: CheckpointException) -> Exception:
    """DCP's ``CheckpointException`` (the same on every rank) -> our error, with each failing rank's message."""
    errors = {rank: failure[0] if isinstance(failure, tuple) else failure
              for rank, failure in sorted(exc.failures.items())}
    kinds = {type(e) for e in errors.values()}
    cls = next((k for k in (UnsafeCheckpointError, CheckpointCorruptError) if k in kinds), RuntimeError)
    return cls(f"{what} failed on group rank(s) {sorted(errors)}: " + "; ".join(str(e) for e in errors.values()))


def _saved_class(plan: _LoadPlan, group) -> str:
    """The checkpoint's optimizer class name (a 64-byte read by every rank)."""
    key = f"optimizer.{CLASS_KEY}"
    if key not in plan.metadata:
        return "an optimizer it does not name"
    target = torch.zeros(_CLASS_BYTES, dtype=torch.uint8)
    dcp.load({key: target}, storage_reader=plan.reader, planner=TensorsOnlyLoadPlanner(), process_group=group)
    return _decode_class(target)


def load_checkpoint(path: "str | os.PathLike", model, optimizer=None) -> None:
    """Load what ``save_checkpoint`` wrote, at any dp size and strategy: the newest complete
    checkpoint at ``path`` (after a crashed save, possibly ``path.tmp`` or ``path.old``; see
    checkpoint_commit.py). Before any tensor is read, every rank checks the checkpoint's keys and
    shapes against the model (ValueError naming missing, unexpected and mis-shaped keys), its
    optimizer state keys against the optimizer (naming both classes), and the size and sha256 of
    every file it reads (``CheckpointCorruptError`` naming the file and the rank that found it).
    Nothing is unpickled outside torch's weights-only allow-list. Any failure raises on every rank."""
    model = _sharded_module(model)
    if model._fsdp_engine.experts is not None:
        raise expert_names_refusal("load_checkpoint")
    path = os.fspath(path)
    group = _checkpoint_group(model)
    what = f"load_checkpoint({path!r})"
    plan, error = None, None
    try:
        plan = _plan_load(path, model, optimizer)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    reports = gather_reports(group, error, None if plan is None else (plan.directory, plan.missing[:20],
                                                                      len(plan.missing)))
    raise_reported(reports, error, what)
    directories = [extra[0] for _, extra in reports]
    if len(set(directories)) > 1:
        raise RuntimeError(f"{what}: the ranks see different newest checkpoints (by group rank: {directories}); is "
                           f"another job saving there?")
    shown, total = next(((extra[1], extra[2]) for _, extra in reports if extra[2]), ([], 0))
    try:
        if total:
            raise _optimizer_mismatch(what, _saved_class(plan, group), _torch_optimizer(optimizer), shown, total)
        dcp.load(plan.state_dict, storage_reader=plan.reader, planner=TensorsOnlyLoadPlanner(), process_group=group)
    except CheckpointException as exc:              # a BaseException, raised on every rank
        raise _read_failure(f"{what}: reading {plan.directory!r}", exc) from exc
    sd = plan.state_dict
    model.load_state_dict(OrderedDict((k[6:], v) for k, v in sd.items() if k.startswith("model.")), strict=False)
    if optimizer is not None:
        load_optimizer_state_dict(model, optimizer,
                                  OrderedDict((k[10:], v) for k, v in sd.items() if k.startswith("optimizer.")))


def export_full_state_dict(model, path: "str | os.PathLike", rank: int = 0) -> None:
    """Write ``{name: full tensor}`` (main-weight precision, all tied names, persistent buffers) to
    one ``torch.save`` file from ``rank``, for export or inference; ``torch.load(weights_only=True)``
    reads it. Gathers one group at a time; other ranks drop each gathered group at once."""
    model = _sharded_module(model)
    comm = model._fsdp_engine.comm
    if not isinstance(rank, int) or not 0 <= rank < comm.size:
        raise ValueError(f"rank must be a data-parallel rank in [0, {comm.size}), got {rank!r}.")
    replicas = model._fsdp_engine.replicas
    writer = comm.rank == rank and (replicas is None or replicas.rank == 0)   # hybrid: replica 0 writes
    full: dict = {}
    for group in model._fsdp_engine.groups:
        full_main = group.gather_full_main()
        if writer:
            for index, names in enumerate(group.all_names):
                value = group.full_param(full_main, index).clone()
                full.update((name, value) for name in names)
        del full_main
    if writer:
        full.update((name, buffer.detach().clone()) for name, buffer in model._fsdp_buffers())
        order = model._fsdp_name_order
        tmp = os.fspath(path) + ".tmp"
        torch.save(OrderedDict(sorted(full.items(), key=lambda kv: order.get(kv[0], 1 << 30))), tmp)
        os.replace(tmp, path)
    dist.barrier(group=_checkpoint_group(model))
