"""Megatron-FSDP's ``--ckpt-format fsdp_dtensor`` checkpoints, read into our wrapper at any dp size
and strategy, and written so that Megatron-FSDP loads them.

[Note: what Megatron-Core 0.19.2 writes under fsdp_dtensor]
``megatron/training/checkpointing.py:save_checkpoint`` with ``--use-megatron-fsdp --ckpt-format
fsdp_dtensor`` builds ``generate_state_dict``: ``{"args", "checkpoint_version", "iteration",
"model", "optimizer", "opt_param_scheduler", "rng_state", "rerun_state_machine"}``, runs
``preprocess_fsdp_dtensor_state_dict`` and hands it to plain ``torch.distributed.checkpoint.save``
(``FileSystemWriter``: ``.metadata`` and ``__<rank>_0.distcp``, no ``metadata.json``, which is how
``_get_checkpoint_format`` tells it from ``torch_dist``). DCP flattens the nesting with dots:

* ``model.module.<name>``: Megatron-FSDP's ``state_dict()``, its ``module.`` before the module's
  parameter name (also under bf16/fp16: ``Float16Module``'s state dict adds no prefix), layer numbers
  local to the pipeline stage. Each value is a DTensor of the parameter's global shape on the
  data-parallel mesh, ``Shard(0)``, whose local piece is whole rows (Megatron-FSDP snaps its flat
  shards to rows, ``chunk_size_factor``). The rank pieces are uneven, so
  ``preprocess_state_dict_for_uneven_dtensor`` gives each DTensor one DCP chunk at its first row
  (``gather_and_compute_chunk_metadata``); an empty piece writes nothing. The main weights (fp32
  under bf16). ``_extra_state`` entries are dropped (``handle_fp8_extra_state_case``);
  ``--swiglu`` splits ``linear_fc1`` into ``linear_fc1.weight_w`` / ``_v`` halves and MoE experts
  are renumbered to global indices (``handle_swiglu_in_state_dict``, ``handle_experts_in_state_dict``).
* ``optimizer.state.module.module.<name>.{exp_avg,exp_avg_sq}``: ``DistributedOptimizer
  .sharded_param_state_fsdp_dtensor`` -- the inner optimizer's state keyed by the parameter's name
  in the model chunk (Megatron-FSDP's adapter and Megatron-FSDP, plus ``Float16Module``'s
  ``module.`` under bf16/fp16), DTensors laid out like the weights;
  ``...<name>.step``: torch's Adam keeps a 0-d tensor per parameter (replicated);
* ``optimizer.param_to_group_meta.<prefix'><name>.<hyperparameter>``: every param group's
  hyperparameters per parameter, pickled objects (``lr``, ``betas``, ``wd_mult``, ...); Transformer
  Engine's FusedAdam keeps ``step`` here instead of in the state;
* ``args`` (the pickled argparse namespace), ``iteration``, ``checkpoint_version``, RNG and
  scheduler state: pickled objects, which this module never reads.

Loading: each rank declares its own shards under those keys (``FlatRangeShard``, the core's DCP
chunks) and DCP reads the overlap of the saved chunks, so any dp size and strategy loads.
Saving writes the same keys and ``args``/``iteration``/``checkpoint_version``, so
Megatron-LM's ``--load`` and Megatron-FSDP's loader (which declares its own chunks) read it.
Hyperparameters are not written: the loading run's are used (Megatron-LM's scheduler sets the
learning rate and weight decay every step), as for Megatron DDP's layouts (distopt_format.py).
"""

from __future__ import annotations

import argparse
import os
import re
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ...checkpoint.collective_errors import raise_on_every_rank
from ...checkpoint.integrity import ChecksummedFileSystemWriter, verification_scope
from ...checkpoint.safe_reader import SafeFileSystemReader
from ...checkpoint.state_dict import load_optimizer_state_dict, model_state_dict, optimizer_state_dict
from .dcp_checkpoint import checkpoint_targets

__all__ = ["FORMAT", "fsdp_dtensor_state_dict", "is_fsdp_dtensor_keys", "load_fsdp_dtensor_checkpoint",
           "load_fsdp_dtensor_training_state", "save_fsdp_dtensor_checkpoint"]

FORMAT = "fsdp_dtensor"
_MODEL, _STATE, _GROUP_META = "model.", "optimizer.state.", "optimizer.param_to_group_meta."
_WRAPPERS = re.compile(r"^(module\.)+")
#: Keys that only Megatron-FSDP's preprocessing writes, and the flag that made them.
_REFUSED = ((re.compile(r"\.linear_fc1\.(weight|bias)\d*_[wv]$"), "--swiglu (linear_fc1 split into _w / _v halves)"),
            (re.compile(r"\.mlp\.experts\."), "--num-experts (MoE experts)"),
            (re.compile(r"\.(query|key|value|z|beta|alpha)$"), "Gated DeltaNet's split in_proj / conv1d"))


def _bare(name: str) -> str:
    """A parameter name without the wrappers' ``module.`` prefixes (Megatron-FSDP's, Float16Module's,
    ours): the same module's name under every wrapping."""
    return _WRAPPERS.sub("", name)


def is_fsdp_dtensor_keys(keys) -> bool:
    """Whether a DCP checkpoint's keys are Megatron-FSDP's (``model.module.*`` weights), not the
    core's ``save_checkpoint`` (``model.<name>``, no wrapper prefix)."""
    return any(k.startswith(_MODEL + "module.") for k in keys)


def _checkpoint_names(keys) -> tuple:
    """({bare name: model key}, {bare name: {state key: checkpoint key}}, {bare name: group-meta step key})."""
    model, state, step = {}, {}, {}
    for key in keys:
        if key.startswith(_MODEL):
            model[_bare(key[len(_MODEL):])] = key
        elif key.startswith(_STATE) and "." in key[len(_STATE):]:
            name, sub = key[len(_STATE):].rsplit(".", 1)
            state.setdefault(_bare(name), {})[sub] = key
        elif key.startswith(_GROUP_META) and key.endswith(".step"):
            step[_bare(key[len(_GROUP_META):-len(".step")])] = key
    return model, state, step


def _check_layout(wrapper, metadata: dict, names: list) -> Optional[ValueError]:
    """Why this checkpoint cannot load into ``wrapper`` (None if it can): the same on every rank."""
    keys = list(metadata)
    for pattern, flag in _REFUSED:
        hits = [k for k in keys if k.startswith((_MODEL, _STATE)) and pattern.search(k)]
        if hits:
            return ValueError(f"fsdp_dtensor checkpoint: keys written by Megatron-FSDP under {flag}, e.g. {hits[0]!r}, "
                              f"are not read here; supported: dense GPT layers without --swiglu at tensor- and "
                              f"pipeline-parallel size 1. Convert it with Megatron-LM to --ckpt-format torch_dist "
                              f"(Megatron DDP) first.")
    config = getattr(wrapper, "config", None)
    for field, flag in (("gated_linear_unit", "--swiglu (gated_linear_unit)"), ("num_moe_experts", "--num-experts")):
        if getattr(config, field, None):
            return ValueError(f"fsdp_dtensor checkpoint: a model with {flag} is not supported (Megatron-FSDP splits or "
                              f"renumbers those keys); got {field}={getattr(config, field)!r}. Use --ckpt-format "
                              f"torch_dist for it.")
    sizes = _model_parallel_sizes(wrapper)
    if sizes != (1, 1):
        return ValueError(f"fsdp_dtensor checkpoint: loading at tensor/pipeline-parallel sizes {sizes} is not "
                          f"supported (Megatron-FSDP's keys carry stage-local layer numbers and tensor-parallel "
                          f"meshes); got {sizes}, allowed (1, 1). Use --ckpt-format torch_dist to change them.")
    model, _, _ = _checkpoint_names(keys)
    missing = [n for n in names if n not in model]
    if missing:
        return ValueError(f"fsdp_dtensor checkpoint does not match the model: missing parameters {missing[:10]}"
                          f"{' and more' if len(missing) > 10 else ''}; the checkpoint holds {sorted(model)[:10]}...")
    return None


def _model_parallel_sizes(wrapper) -> tuple:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 1
    return ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()


def _requests(module, torch_optimizer, metadata: dict) -> tuple:
    """(the flat dict DCP fills: checkpoint key -> our value, our model dict, our optimizer dict)."""
    model_names, state_names, step_names = _checkpoint_names(metadata)
    ours = model_state_dict(module)
    request = OrderedDict((model_names[_bare(n)], v) for n, v in ours.items() if _bare(n) in model_names)
    optim = None
    if torch_optimizer is not None:
        optim = optimizer_state_dict(module, torch_optimizer)
        for key in [k for k in optim if k.startswith("state.")]:
            name, sub = key[len("state."):].rsplit(".", 1)
            saved = state_names.get(_bare(name), {})
            if sub in saved:
                request[saved[sub]] = optim[key]
            elif sub == "step" and _bare(name) in step_names:
                request[step_names[_bare(name)]] = None     # FusedAdam's step, a pickled number
            elif not saved:
                del optim[key]          # no state saved for this parameter: it starts fresh, as it would have
    return request, ours, optim


def load_fsdp_dtensor_checkpoint(path: "str | os.PathLike", wrapper, optimizer=None) -> None:
    """Load a Megatron-FSDP ``fsdp_dtensor`` checkpoint (model, and Adam's moments and step when
    ``optimizer`` is given) into ``wrapper`` at any dp size and strategy. Read through
    ``SafeFileSystemReader``: ``args`` and the other pickled entries are never read. Unsupported
    layouts (``--swiglu``, MoE, tensor or pipeline parallelism) raise ``ValueError`` on every rank."""
    path = os.fspath(path)
    module, torch_optimizer = checkpoint_targets(wrapper, optimizer)
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    names = [n for n in model_state_dict(module)]
    error = None if is_fsdp_dtensor_keys(metadata) else ValueError(
        f"load_fsdp_dtensor_checkpoint({path!r}): not an fsdp_dtensor checkpoint (no 'model.module.*' keys).")
    error = error or _check_layout(wrapper, metadata, [_bare(n) for n in names])
    raise_on_every_rank(None, error, f"load_fsdp_dtensor_checkpoint({path!r})",
                        "load_fsdp_dtensor_checkpoint: checking the checkpoint")
    request, ours, optim = _requests(module, torch_optimizer, metadata)
    dcp.load(request, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=False))
    module.load_state_dict(ours)
    if optim is not None:
        _steps_from_group_meta(optim, request, _checkpoint_names(metadata)[2])
        load_optimizer_state_dict(module, torch_optimizer, optim)


def _steps_from_group_meta(optim: dict, request: dict, step_names: dict) -> None:
    """FusedAdam's ``step`` (a number in ``param_to_group_meta``) into our 0-d state tensors."""
    for key in [k for k in optim if k.startswith("state.") and k.endswith(".step")]:
        saved = step_names.get(_bare(key[len("state."):-len(".step")]))
        if saved is not None and request.get(saved) is not None:
            optim[key].fill_(float(request[saved]))


def _checkpoint_args(wrapper, args: Optional[argparse.Namespace]) -> argparse.Namespace:
    """What Megatron-LM's ``load_checkpoint`` reads from ``args`` (``check_checkpoint_args`` compares
    the model's sizes; ``consumed_train_samples`` restarts the data): the caller's Megatron-LM
    arguments, or the model's sizes from its config."""
    if args is not None:
        return args
    config = getattr(wrapper, "config", None)
    return argparse.Namespace(**{k: getattr(config, k) for k in ("num_layers", "hidden_size", "num_attention_heads")
                                 if hasattr(config, k)}, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def save_fsdp_dtensor_checkpoint(path: "str | os.PathLike", wrapper, optimizer=None, iteration: Optional[int] = None,
                                 args: Optional[argparse.Namespace] = None, extra: Optional[dict] = None) -> None:
    """Write ``wrapper`` (and ``optimizer``'s Adam state) in Megatron-FSDP's ``fsdp_dtensor`` layout,
    for Megatron-LM ``--use-megatron-fsdp --ckpt-format fsdp_dtensor --load``. Each rank writes its
    own rows; ``.checksums.json`` is added (Megatron ignores it). ``args``: Megatron-LM's arguments
    to store (pickled, as Megatron-LM does; default: the model's sizes, which its load checks).
    ``extra``: more top-level entries as Megatron-LM's ``save_checkpoint`` writes them
    (``opt_param_scheduler``, ``num_floating_point_operations_so_far``, ``rng_state``; the launcher's
    ``--save``). Asynchronously, through Megatron-LM's queue: async_request.py."""
    state = fsdp_dtensor_state_dict(f"save_fsdp_dtensor_checkpoint({os.fspath(path)!r})", wrapper, optimizer,
                                    iteration, args, extra)
    dcp.save(state, storage_writer=ChecksummedFileSystemWriter(os.fspath(path)))


def fsdp_dtensor_state_dict(what: str, wrapper, optimizer=None, iteration: Optional[int] = None,
                            args: Optional[argparse.Namespace] = None, extra: Optional[dict] = None) -> OrderedDict:
    """What ``save_fsdp_dtensor_checkpoint`` writes (its arguments; ``what`` names the caller in a
    refusal, raised on every rank): values are views of the live weights and optimizer state."""
    module, torch_optimizer = checkpoint_targets(wrapper, optimizer)
    # the model's keys: Megatron-FSDP's state_dict (Float16Module's state_dict adds no prefix); the
    # optimizer's: parameter names in the model chunk (Megatron-FSDP's adapter, Megatron-FSDP, Float16Module)
    model_prefix, state_prefix = "module.", "module.module." + getattr(wrapper, "_ckpt_prefix", "")
    error = _check_layout(wrapper, {}, [])
    raise_on_every_rank(None, error, what, "save_fsdp_dtensor_checkpoint: checking the layout")
    out = OrderedDict((f"{_MODEL}{model_prefix}{_bare(n)}", v) for n, v in model_state_dict(module).items()
                      if not n.endswith("._extra_state"))
    if torch_optimizer is not None:
        for key, value in optimizer_state_dict(module, torch_optimizer).items():
            if key.startswith("state."):
                name, sub = key[len("state."):].rsplit(".", 1)
                out[f"{_STATE}{state_prefix}{_bare(name)}.{sub}"] = value
                if sub == "step":       # where Transformer Engine's FusedAdam looks for it
                    out[f"{_GROUP_META}{state_prefix}{_bare(name)}.step"] = int(value.item())
    out.update(args=_checkpoint_args(wrapper, args), checkpoint_version=3.0,
               iteration=0 if iteration is None else int(iteration))
    clash = sorted(set(extra or {}) & (set(out) | {"model", "optimizer"}))
    if clash:
        raise ValueError(f"save_fsdp_dtensor_checkpoint: extra entries {clash} would replace the checkpoint's own.")
    out.update(extra or {})
    return out


def load_fsdp_dtensor_training_state(path: "str | os.PathLike", wrapper, optimizer=None,
                                     opt_param_scheduler=None) -> tuple:
    """What Megatron-LM's ``load_checkpoint`` does for the launcher's ``--load`` of an fsdp_dtensor
    checkpoint: the model and optimizer (``load_fsdp_dtensor_checkpoint``), then the scheduler's
    state; returns ``(iteration, num_floating_point_operations_so_far)``. The pickled ``args``, RNG
    and rerun states are not read (they need unpickling outside torch's weights-only allow-list)."""
    path = os.fspath(path)
    with verification_scope():       # the second reader checks no file the first one checked
        load_fsdp_dtensor_checkpoint(path, wrapper, optimizer)
        reader = SafeFileSystemReader(path)
        keys = reader.read_metadata().state_dict_metadata
        wanted = [k for k in keys if k in ("iteration", "num_floating_point_operations_so_far")
                  or (opt_param_scheduler is not None and k.startswith("opt_param_scheduler."))]
        values = OrderedDict((k, None) for k in wanted)
        dcp.load(values, storage_reader=reader)
    if opt_param_scheduler is not None and any(k.startswith("opt_param_scheduler.") for k in values):
        opt_param_scheduler.load_state_dict({k[len("opt_param_scheduler."):]: v for k, v in values.items()
                                             if k.startswith("opt_param_scheduler.")})
    return int(values.get("iteration") or 0), values.get("num_floating_point_operations_so_far") or 0
