"""Megatron's own checkpointing (``megatron.core.dist_checkpointing``; ``--ckpt-format torch_dist``,
Megatron-LM's default) for ``FullyShardedDataParallel`` chunks and the optimizers ``get_optimizer``
builds.

Megatron-LM's ``save_checkpoint`` asks the *unwrapped* model (``unwrap_model`` strips our wrapper
and ``Float16Module``) for ``sharded_state_dict(metadata=...)`` and the optimizer for
``sharded_state_dict(model_sd, metadata=...)``, writes both with ``dist_checkpointing.save``; its
``load_checkpoint`` builds the same dicts with ``is_loading=True``, fills them with
``dist_checkpointing.load`` and hands the result to ``ddp_model.load_state_dict`` and
``optimizer.load_state_dict``. Megatron's ``DistributedOptimizer`` on its ``use_megatron_fsdp``
path only knows Megatron-FSDP's DTensor format, so ``get_optimizer`` gives each of its leaf
optimizers ``ShardedOptimizerCheckpoint`` and the wrapper gives the unwrapped module
``ShardedModelCheckpoint``; both build on the core's DCP state dicts (checkpoint.py).

[Note: our shards as Megatron ShardedTensors]
The values are the ones ``dcp.save`` gets from the core (checkpoint.py, [Note: the checkpoint
format]); the keys are Megatron's own. ``megatron_layout`` reads, once, while the parameters are
still whole, where the module's own ``sharded_state_dict`` puts each parameter: transformer layers
are stacked under one key (``decoder.layers.mlp.linear_fc1.weight``, global shape
``(num_layers, *shape)``, the layer number an offset on the leading axis). Each value becomes:

* a ``FlatRangeShard`` (one rank's flat range of a parameter or of its per-element optimizer state)
  -> ``{"box0": ShardedTensor, "box1": ...}``, one ShardedTensor per box of the range
  (checkpoint/dcp_format.py, [Note: flat ranges as DCP chunks]), shaped ``(1, *box)`` under a stacked key, with
  ``axis_fragmentations=None``: Megatron's uneven sharding, which it hands to DCP chunk by chunk.
  The data are views of the main weights / optimizer state. A rank that owns no element of a
  tensor leaves its key out: Megatron saves rank 0's non-tensor leftovers (an empty dict or list
  too) as common state and merges every load into them, so an empty entry would clash with the
  tensor another strategy loads there (and lists of boxes would have to have equal lengths);
* a replicated tensor (``no_shard`` weights, buffers, Adam's ``step``) -> one ShardedTensor whose
  replica id's data-parallel element is the data-parallel rank, so rank 0 writes it; 0-d tensors
  travel as shape ``(1,)``;
* with tensor parallelism each value sits at its rank's slice of the whole tensor (offset and
  global shape from Megatron's entry) with Megatron's replica id (``(0, tp_rank, dp)`` for a
  tensor-parallel replica such as a layer norm), the data-parallel element ours;
* optimizer hyperparameters and the optimizer's class name -> common state (rank 0's
  ``common.pt``), as Megatron stores its own.

Megatron's ``_extra_state`` objects are passed through and tied aliases it leaves out
(``output_layer.weight``) are left out, so a model checkpoint has exactly Megatron DDP's keys and
global shapes: Megatron DDP checkpoints load into every strategy and ours into Megatron DDP
(model state; the weights are saved in main precision). Since the keys and shapes do not depend on
the layout, checkpoints reshard across data-parallel, tensor- and pipeline-parallel sizes and
strategies. Optimizer state is written in Megatron DDP + DistributedOptimizer's layouts
(distopt_format.py): ``fully_reshardable`` unless Megatron-LM's ``save_checkpoint`` asks for
``dp_reshardable``, so Megatron's own ``load_checkpoint`` reads every checkpoint written here. Our
own optimizer layout, which ``save_dist_checkpoint`` wrote by default before, is read and no longer
written: format 2 under ``optimizer.state.<Megatron key>.<key>`` at the parameter's stacked-layer
offset and tensor-parallel slice, format 1 (before pipeline parallelism) under
``optimizer.state.<param name>.<key>`` (``read_optimizer_layout`` tells them apart).
``dist_checkpointing.load`` returns the same structure with tensors in place of ShardedTensors;
``from_loaded`` turns a box dict back into this rank's ``FlatRangeShard`` and the core's loaders copy
it into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from collections import OrderedDict
from typing import NamedTuple, Optional

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from ...checkpoint.dcp_format import FlatRangeShard
from ...checkpoint.integrity import verification_scope, verify_directory, write_directory_manifest
from ...checkpoint.safe_reader import SafeFileSystemReader
from ...checkpoint.state_dict import CLASS_KEY, load_optimizer_state_dict, model_state_dict, optimizer_state_dict
from . import distopt_format
from .loaded_values import from_loaded
from .placement import Placement

__all__ = ["FORMAT_KEY", "Placement", "ShardedModelCheckpoint", "ShardedOptimizerCheckpoint", "from_loaded",
           "install_model_checkpointing", "install_optimizer_checkpointing", "load_dist_checkpoint",
           "read_optimizer_layout", "safe_dcp_reading", "MegatronLayout", "megatron_layout", "model_sharded_state_dict",
           "model_values_from_loaded", "save_dist_checkpoint", "to_sharded"]

logger = logging.getLogger(__name__)

#: Marks an optimizer sharded state dict as ours; its value is the format version.
FORMAT_KEY = "megatron_fsdp_v2_format"
FORMAT_VERSION = 2      # 2: optimizer state under Megatron's (stacked) parameter keys; 1: parameter names


def _with_data_parallel_replica(replica_id, dp_replica: int):
    """Megatron's replica id with its data-parallel element (the last) set to ``dp_replica``."""
    if isinstance(replica_id, tuple) and replica_id:
        return replica_id[:-1] + (dp_replica,)
    return dp_replica


def to_sharded(key: str, value: torch.Tensor, dp_rank: int, placement: Optional[Placement] = None,
               tp_rank: int = 0, shard_replica: int = 0):
    """One value of a core DCP state dict -> what Megatron's ``dist_checkpointing`` saves for it,
    at ``placement`` (default: ``key``, no prepended axes, the whole tensor, replicated over the
    tensor-parallel group: tensor-parallel rank ``tp_rank`` is a replica). ``shard_replica``: which
    copy of this rank's shard it holds (distributed-optimizer instances hold the same shards; 0
    writes them)."""
    key, lead_offsets, lead_shape, slice_offsets, slice_shape, replica_id = \
        placement or Placement(key, replica_id=(0, tp_rank, 0))
    lead = (1,) * len(lead_shape)   # the prepended axes are part of each piece's shape (size 1 there)
    local_shape = tuple(value.shape) or (1,)          # a 0-d tensor travels as shape (1,)
    whole_shape = tuple(slice_shape) or local_shape
    slice_offsets = tuple(slice_offsets) or (0,) * len(local_shape)
    if isinstance(value, FlatRangeShard):
        boxes = {}
        for i, (offsets, sizes, piece) in enumerate(value.pieces()):
            if not value.shape:
                offsets, sizes = (0,), (1,)
            piece = piece.reshape(lead + tuple(sizes))
            offsets = tuple(a + b for a, b in zip(offsets, slice_offsets))
            boxes[f"box{i}"] = ShardedTensor(key=key, data=piece, dtype=piece.dtype, local_shape=tuple(piece.shape),
                                             global_shape=lead_shape + whole_shape, global_offset=lead_offsets + offsets,
                                             axis_fragmentations=None,
                                             replica_id=_with_data_parallel_replica(replica_id, shard_replica))
        return boxes
    if isinstance(value, torch.Tensor):
        data = value.detach().reshape(lead + local_shape)
        fragments = tuple(whole // part for whole, part in zip(whole_shape, local_shape))
        return ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
                             global_shape=lead_shape + whole_shape, global_offset=lead_offsets + slice_offsets,
                             axis_fragmentations=lead_shape + fragments,
                             replica_id=_with_data_parallel_replica(replica_id, dp_rank))
    raise TypeError(f"{key}: only tensors can be checkpointed, got {type(value).__name__}.")


class MegatronLayout(NamedTuple):
    """What ``megatron_layout`` read from a module's own Megatron ``sharded_state_dict()``."""

    placements: dict        # parameter name -> Placement
    extra_objects: dict     # state-dict key -> ShardedObject (``*._extra_state``, e.g. None for local layers)


def megatron_layout(module: torch.nn.Module) -> MegatronLayout:
    """Read ``module``'s own Megatron ``sharded_state_dict()`` while its parameters are still whole
    (before sharding): the Placement of every parameter it saves as one ShardedTensor (its key,
    stacked-layer axes and tensor-parallel slice; tied names it leaves out get none), and its ``_extra_state`` objects
    (static without FP8, which the wrapper rejects), so that our checkpoints carry Megatron's keys
    and load into Megatron's DDP and back. A module without Megatron's ``sharded_state_dict``
    gives an empty layout (plain parameter names)."""
    build = getattr(module, "sharded_state_dict", None)
    if build is None:
        return MegatronLayout({}, {})
    try:
        entries = build()
    except Exception as exc:  # noqa: BLE001 - any failure only costs the Megatron key names
        logger.warning("megatron_fsdp_v2: %s.sharded_state_dict() failed (%s: %s); checkpoints use parameter "
                       "names instead of Megatron's keys (still complete and reshardable, but not loadable by "
                       "Megatron's own DDP).", type(module).__name__, type(exc).__name__, exc)
        return MegatronLayout({}, {})
    names = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault((param.data_ptr(), tuple(param.shape)), name)
    placements, extras = {}, {}
    for state_key, entry in entries.items():
        if isinstance(entry, ShardedObject) and state_key.endswith("._extra_state"):
            extras[state_key] = entry
        if not isinstance(entry, ShardedTensor) or entry.data is None:
            continue
        name = names.get((entry.data.data_ptr(), tuple(entry.data.shape)))
        lead = entry.prepend_axis_num
        if name is None or getattr(entry, "flattened_range", None) is not None:
            continue
        whole, offsets = tuple(entry.global_shape[lead:]), tuple(entry.global_offset[lead:])
        if len(whole) != entry.data.dim() or any(o + n > w for o, n, w in zip(offsets, entry.data.shape, whole)):
            continue
        placements[name] = Placement(entry.key, tuple(entry.global_offset[:lead]), tuple(entry.global_shape[:lead]),
                                     offsets, whole, entry.replica_id)
    return MegatronLayout(placements, extras)


def holds_nothing(template) -> bool:
    """A ``FlatRangeShard`` of which this rank owns no element: ``to_sharded`` gives an empty box
    dict, which ``dist_checkpointing.load`` drops from the result."""
    return isinstance(template, FlatRangeShard) and not template.boxes


_SWAPPED: dict = {}     # (mixin, class) -> the subclass _with_mixin made


def _with_mixin(obj, mixin: type) -> None:
    """Give ``obj`` the methods of ``mixin`` by swapping its class for a subclass whose own dict
    holds them (a second base would change the instance layout of Megatron's optimizers, which
    Python refuses for ``__class__`` assignment). The subclass keeps the original class name:
    Megatron logs it."""
    cls = type(obj)
    if getattr(cls, "_fsdp_v2_mixin", None) is mixin:
        return
    swapped = _SWAPPED.get((mixin, cls))
    if swapped is None:
        methods = {k: v for k, v in vars(mixin).items() if callable(v) and not k.startswith("__")}
        swapped = type(cls.__name__, (cls,), {**methods, "_fsdp_v2_mixin": mixin, "__module__": cls.__module__,
                                              "__doc__": f"{cls.__doc__ or ''}\n\n{mixin.__doc__}"})
        _SWAPPED[(mixin, cls)] = swapped
    obj.__class__ = swapped


# ---------------------------------------------------------------- model
class ShardedModelCheckpoint:
    """Gives the module Megatron-LM's checkpointing sees (``unwrap_model`` of our wrapper) a
    ``sharded_state_dict`` built from the wrapper's shards, not from its own (possibly freed)
    compute weights. Installed by ``FullyShardedDataParallel``."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        wrapper = self._fsdp_v2_wrapper()
        if wrapper is None:
            raise RuntimeError("sharded_state_dict: the FullyShardedDataParallel wrapper of this module is gone.")
        return wrapper.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)


def install_model_checkpointing(module: torch.nn.Module, wrapper) -> None:
    """Route ``module.sharded_state_dict`` to ``wrapper`` (``module``: what ``unwrap_model`` returns)."""
    _with_mixin(module, ShardedModelCheckpoint)
    object.__setattr__(module, "_fsdp_v2_wrapper", weakref.ref(wrapper))


def model_sharded_state_dict(values: "OrderedDict[str, torch.Tensor]", dp_rank: int, prefix: str = "",
                             sharded_offsets: tuple = (), layout: Optional[MegatronLayout] = None,
                             tp_rank: int = 0, shard_replica: int = 0, expert_keys: frozenset = frozenset(),
                             expert_dp_rank: int = 0) -> dict:
    """``sharded_state_dict`` of a model whose core DCP values are ``values`` (keys as
    ``state_dict()`` gives them), at Megatron's own placements where ``layout`` has them, with its
    ``_extra_state`` objects; tied aliases Megatron leaves out are left out too. Values under
    ``expert_keys`` are replicated over the expert-data-parallel group, where this rank is
    ``expert_dp_rank`` (Megatron's expert replica ids: ``(pp, tp, expert dp rank)``)."""
    if sharded_offsets:
        raise ValueError(f"sharded_state_dict: FullyShardedDataParallel takes every offset (pipeline stages and "
                         f"virtual chunks included) from the module's own sharded_state_dict; pass "
                         f"sharded_offsets=(), got {sharded_offsets!r}.")
    placements, extras = layout or MegatronLayout({}, {})
    out, placed = {}, set()
    for key, value in values.items():
        placement = placements.get(key)
        if placement is None and id(value) in placed:
            continue            # a tied alias of a parameter Megatron saves under another name
        if placement is not None:
            placed.add(id(value))
            placement = placement._replace(key=prefix + placement.key)
        rank = expert_dp_rank if key in expert_keys else dp_rank
        out[prefix + key] = to_sharded(prefix + key, value, rank, placement, tp_rank, shard_replica)
    out.update((prefix + key, dataclasses.replace(obj, key=prefix + obj.key)) for key, obj in extras.items())
    return _drop_empty(out)


def _drop_empty(sharded: dict) -> dict:
    """Leave out values of which this rank holds nothing: an empty dict would land in rank 0's
    common state and clash, at load time, with a tensor of another strategy's layout."""
    return {key: value for key, value in sharded.items() if not (isinstance(value, dict) and not value)}


def model_values_from_loaded(values: "OrderedDict[str, torch.Tensor]", state_dict: dict) -> "OrderedDict":
    """``state_dict`` as ``load_state_dict`` got it (full tensors, or ``dist_checkpointing.load``'s
    result for ``sharded_state_dict()``) -> values the core's ``load_state_dict`` takes."""
    out = OrderedDict()
    for key, value in state_dict.items():
        template = values.get(key)
        if template is not None and (isinstance(value, dict) or (isinstance(value, torch.Tensor)
                                                                 and value.shape != template.shape)):
            value = from_loaded(key, template, value)
        out[key] = value
    # A dist_checkpointing.load result (box dicts) lacks the keys this rank holds nothing of (see
    # _drop_empty). A dict of full tensors is the same on every rank, so its missing keys must be
    # reported by every rank alike (a rank that went on would wait in the weight refresh).
    if any(isinstance(v, dict) for v in state_dict.values()):
        out.update((key, from_loaded(key, template, {})) for key, template in values.items()
                   if key not in out and holds_nothing(template))
    return out


# ---------------------------------------------------------------- optimizer
class ShardedOptimizerCheckpoint:
    """A Megatron optimizer (``DistributedOptimizer`` / ``FP32Optimizer`` leaf) over our main
    weights that checkpoints through ``dist_checkpointing``: Megatron's own ``sharded_state_dict``
    only knows Megatron-FSDP's DTensors on this path. Installed by ``get_optimizer``."""

    # install_optimizer_checkpointing sets _fsdp_v2_model (the fully_shard root whose main weights
    # it steps) and _fsdp_v2_dp_rank.

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, sharding_type=None,
                           metadata=None, **unused):
        """Saving: Megatron DDP + DistributedOptimizer's layout (distopt_format.py), the type
        ``metadata["distrib_optim_sharding_type"]`` asks for, ``fully_reshardable`` when it asks for
        none (recorded there: Megatron-LM saves ``metadata`` as the checkpoint's content metadata).
        Loading: the requests for the layout the checkpoint holds, Megatron's or our own of
        earlier versions (``_our_layout``). With no state yet (before the first step, or
        ``is_loading``), the state torch.optim would create is used."""
        values = optimizer_state_dict(self._fsdp_v2_model, self.optimizer)
        if not is_loading:
            target = self._target_format(metadata)
            if metadata is not None:
                metadata["distrib_optim_sharding_type"] = target
            return distopt_format.saving_dict(self, values, model_state_dict(self._fsdp_v2_model), target, to_sharded)
        # dist_checkpointing.load fills these in place: load_state_dict installs them
        self._fsdp_v2_loading_template = values
        source = self._source_format(metadata)
        if source is not None:      # Megatron DDP + DistributedOptimizer's own layout (distopt_format.py)
            return distopt_format.loading_requests(self, values, source, to_sharded)
        return self._our_layout(values)

    def _our_layout(self, values) -> dict:
        """``{FORMAT_KEY: 2, "state": {...}, "param_groups": {...}[, "grad_scaler": ...]}`` at our own
        optimizer layout (state under ``optimizer.state.<Megatron key>.<key>``; format 1: under
        parameter names; see the module note): what ``save_dist_checkpoint`` wrote by default before
        ``fully_reshardable`` took its place, read here, no longer written."""
        state = _drop_empty({k: to_sharded(f"optimizer.{k}", v, self._replica_rank(k), self._state_placement(k, v),
                                           self._fsdp_v2_tp_rank, self._fsdp_v2_shard_replica)
                             for k, v in values.items() if k.startswith("state.")})
        groups = {k: v for k, v in values.items() if k.startswith("param_groups.")}
        out = {FORMAT_KEY: FORMAT_VERSION, "state": state, "param_groups": groups, CLASS_KEY: values[CLASS_KEY]}
        if getattr(self, "grad_scaler", None) is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    def _source_format(self, metadata) -> Optional[str]:
        """The Megatron distributed-optimizer sharding type to read, ``None`` for ours: what
        ``load_dist_checkpoint`` (or the launcher) found in the checkpoint's keys, else what
        Megatron-LM's ``load_checkpoint`` passes from the checkpoint's content metadata (ours
        record ``FORMAT_KEY`` there)."""
        found = getattr(self, "_fsdp_v2_source", "unknown")
        if found != "unknown":
            return found
        metadata = metadata or {}
        if FORMAT_KEY in metadata:
            return None
        kind = metadata.get("distrib_optim_sharding_type")
        return kind if kind in distopt_format.MEGATRON_TYPES or kind == distopt_format.DP_ZERO else None

    @staticmethod
    def _target_format(metadata) -> str:
        """The layout to write: the distributed-optimizer type ``metadata["distrib_optim_sharding_type"]``
        asks for (Megatron-LM's ``save_checkpoint`` with ``--use-distributed-optimizer``:
        ``dp_reshardable``, or ``fully_reshardable`` with --dist-ckpt-optim-fully-reshardable), else
        ``fully_reshardable``: Megatron DDP + DistributedOptimizer loads either with no extra flag,
        and ``fully_reshardable`` reshards at every dp, tp and pp size."""
        kind = (metadata or {}).get("distrib_optim_sharding_type")
        if kind is None:
            return distopt_format.FULLY_RESHARDABLE
        if kind not in distopt_format.MEGATRON_TYPES:
            raise ValueError(f"optimizer.sharded_state_dict: sharding type {kind!r} is not written here; "
                             f"pick one of {list(distopt_format.MEGATRON_TYPES)} (Megatron DDP + DistributedOptimizer's "
                             f"layouts), or --ckpt-format fsdp_dtensor through examples/pretrain_gpt.py.")
        return kind

    def _replica_rank(self, key: str) -> int:
        """The data-parallel element of a replicated value's replica id: the expert-data-parallel
        rank for an expert parameter's state (``state.<param name>.<state key>``), else the
        data-parallel rank."""
        name = key[len("state."):].rsplit(".", 1)[0]
        return self._fsdp_v2_expert_dp_rank if name in self._fsdp_v2_expert_names else self._fsdp_v2_dp_rank

    def _state_placement(self, key: str, value) -> Optional[Placement]:
        """Where optimizer state ``key`` (``state.<param name>.<state key>``) lives in the checkpoint:
        under its parameter's Megatron key (``optimizer.state.<megatron key>.<state key>``, with the
        stacked-layer axes, so pipeline stages and virtual chunks never collide and any other
        pipeline layout finds it); per-element state also at the parameter's tensor-parallel slice
        and with its replica id (a tied output layer's copy is not the main replica), scalar state
        (``step``) one element per stacked layer, a replica on every tensor-parallel rank.
        Parameters Megatron does not place keep ``optimizer.state.<param name>``, as does every
        parameter in format 1 (``read_optimizer_layout``)."""
        name, sub = key[len("state."):].rsplit(".", 1)
        found = self._fsdp_v2_slices.get(name)
        if found is None or getattr(self, "_fsdp_v2_format", FORMAT_VERSION) == 1:
            return None
        placement, local_shape = found
        target = f"optimizer.state.{placement.key}.{sub}"
        if tuple(value.shape) == local_shape and sub != "step":
            return placement._replace(key=target)
        replica = placement.replica_id[0] if isinstance(placement.replica_id, tuple) else 0
        return Placement(target, placement.prepend_offsets, placement.prepend_shape,
                         replica_id=(replica, self._fsdp_v2_tp_rank, 0))

    def load_state_dict(self, state_dict):
        """Load what ``dist_checkpointing.load`` returned for ``sharded_state_dict()``."""
        if isinstance(state_dict, dict) and distopt_format.REQUESTS in state_dict:
            templates = (self.__dict__.pop("_fsdp_v2_loading_template", None)
                         or optimizer_state_dict(self._fsdp_v2_model, self.optimizer))
            templates.pop(CLASS_KEY, None)
            values = distopt_format.values_from_loaded(self, state_dict, templates)
            load_optimizer_state_dict(self._fsdp_v2_model, self.optimizer, OrderedDict(values))
            distopt_format.restore_hyperparameters(self.optimizer, state_dict["optimizer"]["param_groups"])
            if getattr(self, "grad_scaler", None) is not None and isinstance(state_dict.get("grad_scaler"), dict):
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
            return
        if not isinstance(state_dict, dict) or state_dict.get(FORMAT_KEY) not in (1, FORMAT_VERSION):
            got = state_dict.get(FORMAT_KEY) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"optimizer.load_state_dict: expected the dict sharded_state_dict() builds, filled by "
                             f"dist_checkpointing.load ({FORMAT_KEY}={FORMAT_VERSION}), got {FORMAT_KEY}={got!r}; "
                             "Megatron's other optimizer formats do not hold this optimizer's sharded state.")
        templates = (self.__dict__.pop("_fsdp_v2_loading_template", None)
                     or optimizer_state_dict(self._fsdp_v2_model, self.optimizer))
        loaded_state, loaded_groups = state_dict.get("state", {}), state_dict.get("param_groups", {})
        templates.pop(CLASS_KEY, None)      # common state; absent from checkpoints saved before it was
        missing = [k for k, t in templates.items()
                   if k not in loaded_state and k not in loaded_groups and not holds_nothing(t)]
        unexpected = [k for k in loaded_state if k not in templates]
        if missing or unexpected:
            raise ValueError(f"optimizer.load_state_dict: the checkpoint does not match the optimizer: missing keys "
                             f"{missing[:20]}, unexpected keys {unexpected[:20]}.")
        values = OrderedDict(
            (k, loaded_groups[k] if k.startswith("param_groups.") else from_loaded(k, t, loaded_state.get(k, {})))
            for k, t in templates.items())
        if isinstance(state_dict.get(CLASS_KEY), torch.Tensor):
            values[CLASS_KEY] = state_dict[CLASS_KEY]
        load_optimizer_state_dict(self._fsdp_v2_model, self.optimizer, values)
        if getattr(self, "grad_scaler", None) is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def reload_model_params(self, state_dict=None):
        """Nothing to do: our main weights are the model's weights (``load_state_dict`` writes them
        and refreshes the compute weights); Megatron's version raises on this path."""


class MultiChunkOptimizerCheckpoint:
    """A Megatron optimizer stepping the main weights of several model chunks (virtual pipeline
    stages): it trains, but its checkpoint is refused on every rank, naming why, instead of being
    written under names that collide between chunks."""

    def _refuse(self, *unused, **unused_kw):
        raise NotImplementedError(
            f"optimizer checkpoint: this {type(self).__name__} steps the parameters of {self._fsdp_v2_chunk_count} "
            "model chunks (virtual pipeline stages); FullyShardedDataParallel checkpoints optimizers of one chunk "
            "each (virtual_pipeline_model_parallel_size 1). Save the model alone, or train without virtual stages.")

    sharded_state_dict = _refuse
    load_state_dict = _refuse


def install_optimizer_checkpointing(optimizer, chunks) -> None:
    """Give every leaf of ``optimizer`` (a Megatron optimizer over ``chunks``' main weights)
    ``ShardedOptimizerCheckpoint``."""
    leaves = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    owners = {id(main): chunk for chunk in chunks for main in chunk.parameters()}
    for leaf in leaves:
        inner = getattr(leaf, "optimizer", None)
        if inner is None:       # a stub optimizer (no parameters on this rank)
            continue
        mine = {id(owners[id(p)]): owners[id(p)] for g in inner.param_groups for p in g["params"] if id(p) in owners}
        if len(mine) > 1:       # virtual pipeline stages: Megatron builds one optimizer over all chunks
            _with_mixin(leaf, MultiChunkOptimizerCheckpoint)
            leaf._fsdp_v2_chunk_count = len(mine)
            continue
        if not mine:
            raise ValueError(f"get_optimizer: a {type(leaf).__name__} steps no main weight of the given chunks.")
        (chunk,) = mine.values()
        _with_mixin(leaf, ShardedOptimizerCheckpoint)
        leaf._fsdp_v2_model = chunk.module
        leaf._fsdp_v2_dp_rank, leaf._fsdp_v2_shard_replica = chunk.checkpoint_replica_ranks()
        leaf._fsdp_v2_expert_names, leaf._fsdp_v2_expert_dp_rank = chunk.expert_checkpoint_replicas()
        leaf._fsdp_v2_tp_rank = chunk.tensor_parallel_rank()
        leaf._fsdp_v2_slices = chunk.tensor_parallel_slices()
        leaf._fsdp_v2_shapes = {e.name: tuple(e.shape) for e in chunk.module.sharded_parameters()}
        leaf._fsdp_v2_mp_rank, leaf._fsdp_v2_buckets, leaf._fsdp_v2_bucket_dtype = chunk.megatron_buffer_layout()
        leaf._fsdp_v2_dp_size = torch.distributed.get_world_size(chunk.dp_cp_group)


# ---------------------------------------------------------------- one call each
def save_dist_checkpoint(path: "str | os.PathLike", model, optimizer=None,
                         sharding_type: str = distopt_format.FULLY_RESHARDABLE) -> None:
    """Write ``{"model": model.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict(...)}``
    with ``dist_checkpointing.save`` into directory ``path`` (created; must be empty), the layout of
    Megatron-LM's ``--ckpt-format torch_dist``, plus the sha256 manifest of its files
    (``.checksums.json``, checked by ``load_dist_checkpoint``). For loops other than Megatron-LM's.
    The optimizer goes in Megatron DDP + DistributedOptimizer's layout ``sharding_type``
    (distopt_format.py), which Megatron's own ``load_checkpoint`` reads with no extra flag:
    ``"fully_reshardable"`` (the default) loads at every dp, tp and pp size, into Megatron's DDP and
    ours; ``"dp_reshardable"`` only at the tensor/pipeline layout it was saved with."""
    from megatron.core import dist_checkpointing

    if sharding_type not in distopt_format.MEGATRON_TYPES:
        raise ValueError(f"save_dist_checkpoint: sharding_type must be one of {list(distopt_format.MEGATRON_TYPES)}, "
                         f"got {sharding_type!r}.")
    path = os.fspath(path)
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd}
    metadata = {"distrib_optim_sharding_type": sharding_type}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=metadata)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, path, content_metadata=metadata)
    write_directory_manifest(path)         # checksums of every shard file and .metadata


def read_optimizer_layout(optimizer, path: str) -> None:
    """Which optimizer layout the checkpoint holds: Megatron DDP + DistributedOptimizer's
    (``dp_reshardable`` / ``fully_reshardable``, distopt_format.py; a ``dp_reshardable`` one whose
    buckets do not match this layout is refused on every rank) or ours. Checkpoints of format 1 keep optimizer state under parameter names (``decoder.layers.0...``),
    format 2 under Megatron's stacked keys (``decoder.layers...`` with the layer as an offset): a
    leaf whose stacked parameters appear only under their names in the checkpoint reads format 1
    (written before pipeline parallelism, so at pipeline size 1, where the names are global)."""
    metadata = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    keys = list(metadata)
    owners = {k.rsplit(".", 1)[0] for k in keys}
    source = distopt_format.sharding_type_in_keys(keys)
    problems = []
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        leaf._fsdp_v2_source = source
        dtype = distopt_format.bucket_dtype_in_keys(keys, getattr(leaf, "_fsdp_v2_mp_rank", 0))
        if dtype is not None:
            leaf._fsdp_v2_bucket_dtype = dtype
        if source == distopt_format.DP_RESHARDABLE and hasattr(leaf, "_fsdp_v2_buckets"):
            problems.append(distopt_format.bucket_mismatch(leaf, metadata))
    if source == distopt_format.DP_RESHARDABLE:    # the same on every rank: all of them agree here
        _refuse_on_every_rank(source, [p for p in problems if p])
    if source is not None:
        return
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        slices = getattr(leaf, "_fsdp_v2_slices", None)
        if not slices:
            continue
        stacked = [(name, placement.key) for name, (placement, _) in slices.items() if placement.key != name]
        by_key = any(f"optimizer.state.{key}" in owners for _, key in stacked)
        by_name = any(f"optimizer.state.{name}" in owners for name, _ in stacked)
        leaf._fsdp_v2_format = 1 if by_name and not by_key else FORMAT_VERSION


def _refuse_on_every_rank(source: Optional[str], problems: list) -> None:
    """Raise the first rank's reason on every rank when any rank cannot read the checkpoint's
    optimizer layout (the ranks may differ: each checks its own model-parallel group)."""
    failed = torch.tensor([1 if problems else 0])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if failed.item():
        why = problems[0] if problems else ("another rank's model-parallel group does not match the checkpoint's "
                                            "buckets")
        raise ValueError(distopt_format.refusal(source, why))


@contextlib.contextmanager
def safe_dcp_reading():
    """Within it, Megatron's ``dist_checkpointing`` reads DCP files through ``SafeFileSystemReader``
    (checkpoint/safe_reader.py): its own reader unpickles ``.metadata`` with plain pickle, and its common state
    and ShardedObjects (DCP byte entries) with ``torch.load(weights_only=False)``, both through the
    reader its ``_get_filesystem_reader`` returns (megatron-core 0.19). Megatron's common state holds
    only tensors, numbers, strings and containers here, which torch's weights-only allow-list
    accepts. (Megatron-LM's own ``load_checkpoint`` stores argparse arguments and RNG states there,
    which it does not.)"""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    def safe_reader(checkpoint_dir, cache_metadata: bool = False, async_strategy: str = "mcore"):
        return SafeFileSystemReader(checkpoint_dir)

    modules = [m for m in (serialization, torch_strategy) if hasattr(m, "_get_filesystem_reader")]
    if torch_strategy not in modules:
        raise RuntimeError("megatron.core.dist_checkpointing.strategies.torch has no _get_filesystem_reader (a "
                           "megatron-core other than 0.19?), so its reader cannot be made safe; not loading.")
    saved = [m._get_filesystem_reader for m in modules]
    for module in modules:
        module._get_filesystem_reader = safe_reader
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module._get_filesystem_reader = original


def load_dist_checkpoint(path: "str | os.PathLike", model, optimizer=None) -> None:
    """Load what ``save_dist_checkpoint`` (or Megatron-LM, or Megatron's DDP for the model part)
    wrote, at any data-parallel size and strategy. Files are read through ``SafeFileSystemReader``
    (``safe_dcp_reading``), so nothing outside torch's weights-only allow-list is unpickled; where
    the directory has a checksum manifest (``save_dist_checkpoint`` writes one), every file is
    checked first, once, and a mismatch raises on every rank naming the file."""
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict()
    state = {"model": model_sd}
    with verification_scope():             # verified before Megatron reads, and not again by its readers
        verify_directory(path)
        if optimizer is not None:
            read_optimizer_layout(optimizer, os.fspath(path))
            with safe_dcp_reading():       # as Megatron-LM's load_checkpoint: the saving run's metadata
                metadata = dist_checkpointing.load_content_metadata(os.fspath(path)) or {}
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=dict(metadata))
        with safe_dcp_reading():
            loaded = dist_checkpointing.load(state, os.fspath(path))
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
