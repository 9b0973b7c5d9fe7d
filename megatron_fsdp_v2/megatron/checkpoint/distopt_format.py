"""Megatron DDP + ``DistributedOptimizer`` optimizer checkpoints (megatron-core 0.19.2,
``--ckpt-format torch_dist``), read into and written from our optimizers' state.

[Note: Megatron's distributed-optimizer checkpoint layouts]
Megatron-LM's ``save_checkpoint`` asks ``DistributedOptimizer.sharded_state_dict`` for the
sharding type in ``metadata["distrib_optim_sharding_type"]`` (megatron/training/checkpointing.py:
``dp_reshardable`` by default, ``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``):

* ``fully_reshardable``: model space. Each state tensor (``param``: the fp32 main weight,
  ``exp_avg``, ``exp_avg_sq``) is saved like its parameter (same global shape, stacked-layer
  offset and tensor-parallel slice) under ``optimizer.state.<state key>.<Megatron key>``; the
  inner optimizer's ``param_groups`` (with Adam's ``step``, torch's Adam keeps it per group here)
  are common state under ``optimizer.param_groups``. Loads at any dp, tp and pp size.
* ``dp_reshardable``: bucket space. Each (tensor x pipeline)-parallel group ``i`` (its
  model-parallel rank) saves its DDP grad buffers' buckets as flat tensors
  ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<(param, grad dtype)>.bucket_idx_<b>.<state key>``
  of the bucket's unpadded length, each parameter's (tensor-parallel slice, flattened) state at
  its offset in the bucket. Megatron lays a bucket out the same at every dp size (parameters in
  reverse order, each start aligned to 64 elements, only the bucket end padded to
  ``lcm(dp, 128)``), so the offsets are computed once here (``bucket_offsets``, Megatron's own
  layout function on stand-ins of the parameters) and any dp size reads its ranges. The inner
  optimizer's state dict (``param_groups`` with ``step``) and ``per_bucket_numel_unpadded`` are
  ShardedObjects ``optimizer.distributed.dp_group_idx_<i>.{optimizer,per_bucket_numel_unpadded}``.
  Another tensor- or pipeline-parallel layout, or another DDP bucketing, lays the buckets out
  differently: refused, naming ``--dist-ckpt-optim-fully-reshardable``.

Megatron's deprecated ``dp_zero_gather_scatter`` (one pickled object per model-parallel group) is
refused the same way. The reverse direction (``saving_dict``) writes either layout from our state,
so Megatron's own ``load_checkpoint`` reads it: the fp32 main weights as ``param`` (each leaf
optimizer those of the parameters it steps), and for ``dp_reshardable`` zeros in the alignment
gaps (Megatron's load reads whole buckets) and the bucket sizes it checks. It is the only layout
our optimizers write (``fully_reshardable`` by default). A replicated value is written by data-
parallel rank 0, by expert-data-parallel rank 0 for an expert's; a parameter Megatron's layout
does not place (a module without its ``sharded_state_dict``) keeps its name as the key
(``placed``). Loading restores the numeric hyperparameters of the saved param groups where they
are this optimizer's one for one (``restore_hyperparameters``).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from ...checkpoint.dcp_format import FlatRangeShard
from .loaded_values import from_loaded
from .placement import Placement

__all__ = ["DP_RESHARDABLE", "FULLY_RESHARDABLE", "MEGATRON_TYPES", "RESHARDABLE_OPTION", "BucketSlot",
           "bucket_mismatch", "bucket_offsets", "loading_requests", "megatron_bucket_size", "refusal",
           "saving_dict", "sharding_type_in_keys", "values_from_loaded"]

DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
DP_ZERO = "dp_zero_gather_scatter"
#: The Megatron-LM option that writes a distributed-optimizer checkpoint every layout can load.
RESHARDABLE_OPTION = "--dist-ckpt-optim-fully-reshardable"
MEGATRON_TYPES = (DP_RESHARDABLE, FULLY_RESHARDABLE)
# Megatron's ChainedOptimizer (e.g. Muon for matrices + Adam for the rest) prefixes each leaf's keys
# with ``chained_<i>.``; the layout is read the same behind it.
_CHAINED = re.compile(r"^chained_\d+\.")
_BUCKET_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                         r"\.([A-Za-z_]+)$")


def sharding_type_in_keys(keys) -> Optional[str]:
    """The distributed-optimizer sharding type a checkpoint's tensor keys show, ``None`` for ours
    (``optimizer.state.<Megatron key>.<state key>``) or a checkpoint without optimizer state."""
    keys = [_CHAINED.sub("", k) for k in keys]
    if any(_BUCKET_KEY.match(k) for k in keys):
        return DP_RESHARDABLE
    if any(k.startswith("optimizer.state.param.") for k in keys):       # the fp32 main weights, model space
        return FULLY_RESHARDABLE
    if any(k.startswith("optimizer.distributed.dp_group_idx_") and k.split("/")[0].endswith(".param_state")
           for k in keys):
        return DP_ZERO
    return None


def bucket_dtype_in_keys(keys, mp_rank: int) -> Optional[str]:
    """The ``dtype_<...>`` part of model-parallel group ``mp_rank``'s bucket keys, if any."""
    for key in keys:
        found = _BUCKET_KEY.match(key)
        if found and int(found.group(1)) == mp_rank:
            return found.group(3)
    return None


def refusal(sharding_type: str, why: str) -> str:
    """The error text for a distributed-optimizer checkpoint this layout cannot load."""
    return (f"optimizer checkpoint: Megatron DistributedOptimizer state of sharding type {sharding_type!r} "
            f"cannot be loaded here: {why}. Re-save it from Megatron-LM with {RESHARDABLE_OPTION} "
            f"(sharding type {FULLY_RESHARDABLE!r}, model space: loads at any data-, tensor- and "
            "pipeline-parallel size), or load the model alone (--no-load-optim).")


class BucketSlot(NamedTuple):
    """Where one parameter's flattened (tensor-parallel-local) state sits in Megatron's buckets."""

    bucket: int
    start: int          # offset of its first element in the bucket
    numel: int


def bucket_offsets(params: list, bucket_size: Optional[int], ddp_config) -> tuple:
    """``params``: ``[(name, local shape, shared_embedding)]`` in Megatron DDP's order (the
    module's ``named_parameters()``, trainable ones) -> ``({name: BucketSlot}, per-bucket
    unpadded element counts)``, by Megatron's own ``_compute_per_buffer_param_layout`` on meta
    stand-ins (see the module note: offsets inside a bucket do not depend on the dp size; dp 1
    here)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    stand_ins = []
    for _, shape, shared in params:
        stand_in = torch.nn.Parameter(torch.empty(shape, device="meta"))
        if shared:
            stand_in.shared_embedding = True
        stand_ins.append(stand_in)
    layout = DistributedOptimizer._compute_per_buffer_param_layout(stand_ins, bucket_size, 1, ddp_config)
    slots = {}
    for (name, shape, _), stand_in in zip(params, stand_ins):
        start, end, bucket = layout.param_index_map[stand_in]
        slots[name] = BucketSlot(bucket, start - layout.bucket_indices[bucket][0], end - start)
    return slots, list(layout.per_bucket_numel_unpadded)


def bucket_tensor(key: str, value: FlatRangeShard, slot: BucketSlot, bucket_numel: int) -> ShardedTensor:
    """This rank's flat range of a parameter's state as a piece of Megatron's flat bucket tensor
    ``key`` (global shape ``(bucket_numel,)``)."""
    data = value.local_flat
    return ShardedTensor(key, data, data.dtype, tuple(data.shape), (bucket_numel,), (slot.start + value.flat_start,),
                         axis_fragmentations=None, flattened_range=None, allow_shape_mismatch=False,
                         replica_id=(0, 0, 0))


def bucket_object(mp_rank: int, name: str, data=None, dp_rank: int = 0) -> ShardedObject:
    """``optimizer.distributed.dp_group_idx_<mp_rank>.<name>``: one object per model-parallel group."""
    return ShardedObject(f"optimizer.distributed.dp_group_idx_{mp_rank}.{name}", data, (1,), (0,),
                         replica_id=(0, 0, dp_rank))


def bucket_key(mp_rank: int, bucket: int, state_key: str, dtype_name: str) -> str:
    return (f"optimizer.distributed.dp_group_idx_{mp_rank}.gbuf_idx_0.dtype_{dtype_name}.bucket_idx_{bucket}"
            f".{state_key}")


def buffer_dtype_name(param_dtype: torch.dtype, grad_dtype: torch.dtype) -> str:
    """How Megatron names a grad buffer's dtypes in its bucket keys: ``str((param, grad dtype))``."""
    return str((param_dtype, grad_dtype))


def step_from_param_groups(param_groups, sharding_type: str) -> float:
    """Adam's step count from the inner optimizer's saved ``param_groups`` (torch's Adam under
    Megatron's DistributedOptimizer: one ``step`` per group, all equal)."""
    steps = {float(g["step"]) for g in param_groups if isinstance(g, dict) and g.get("step") is not None}
    if len(steps) != 1:
        raise ValueError(f"optimizer checkpoint ({sharding_type}): expected one Adam step count in the saved "
                         f"param_groups, got {sorted(steps)}.")
    return steps.pop()


def lcm_padding(numel: int, dp: int, high_busbw: bool) -> int:
    """A bucket's padded length at dp size ``dp`` (Megatron's ``pad_bucket_end``)."""
    divisor = math.lcm(dp, 128, 2 ** 16) if high_busbw else math.lcm(dp, 128)
    return -(-numel // divisor) * divisor


# ---------------------------------------------------------------- a leaf optimizer's view
#: Where our requests for Megatron's per-parameter state travel in the optimizer's sharded dict
#: (apart from Megatron's own entries, which the common state merges into the loaded result).
REQUESTS = "megatron_fsdp_v2_requests"


def megatron_bucket_size(ddp_config, dp_size: int, pp_rank: int) -> Optional[int]:
    """The bucket size Megatron's DDP would use with these flags (distributed_data_parallel.py):
    ``--ddp-bucket-size`` or ``max(40M, 1M * dp)`` with ``--overlap-grad-reduce``, else one bucket;
    pipeline stages after the first never split."""
    if not ddp_config.overlap_grad_reduce or pp_rank > 0:
        return None
    return ddp_config.bucket_size or max(40000000, 1000000 * dp_size)


def _split(key: str) -> tuple:
    name, sub = key[len("state."):].rsplit(".", 1)
    return name, sub


def placed(leaf, name: str) -> Optional[tuple]:
    """``(Placement, this rank's shape)`` of parameter ``name`` in model space: Megatron's (its key,
    stacked-layer offset, tensor-parallel slice), or for a parameter Megatron's layout does not
    place (a module without Megatron's ``sharded_state_dict``) its name, the whole tensor;
    ``None`` for a name the model lacks."""
    found = leaf._fsdp_v2_slices.get(name)
    if found is not None:
        return found
    shape = getattr(leaf, "_fsdp_v2_shapes", {}).get(name)
    if shape is None:
        return None
    return Placement(name, replica_id=(0, leaf._fsdp_v2_tp_rank, 0)), shape


def _per_element(value, local_shape) -> bool:
    return isinstance(value, FlatRangeShard) or (isinstance(value, torch.Tensor) and tuple(value.shape) == local_shape)


def loading_requests(leaf, values: dict, sharding_type: str, to_sharded) -> dict:
    """``sharded_state_dict(is_loading=True)`` of ``leaf`` (a ShardedOptimizerCheckpoint) for a
    Megatron distributed-optimizer checkpoint of ``sharding_type``: this rank's ranges of every
    parameter's per-element state at Megatron's keys, and (``dp_reshardable``) the ShardedObjects
    holding the step and the bucket sizes."""
    if sharding_type not in MEGATRON_TYPES:
        raise ValueError(refusal(sharding_type, "only 'dp_reshardable' and 'fully_reshardable' are read"))
    requests, slots = {}, leaf._fsdp_v2_buckets[0] if sharding_type == DP_RESHARDABLE else {}
    for key, value in values.items():
        if not key.startswith("state."):
            continue
        name, sub = _split(key)
        found = placed(leaf, name) if sharding_type == FULLY_RESHARDABLE else leaf._fsdp_v2_slices.get(name)
        if sub == "step":
            continue                    # in the saved param_groups (common state / ShardedObject)
        if found is None or (sharding_type == DP_RESHARDABLE and name not in slots):
            raise ValueError(refusal(sharding_type, f"parameter {name!r} has no place in Megatron's layout"))
        placement, local_shape = found
        if not _per_element(value, local_shape):
            continue
        if sharding_type == FULLY_RESHARDABLE:
            target = placement._replace(key=f"optimizer.state.{sub}.{placement.key}")
            requests[key] = to_sharded(target.key, value, leaf._fsdp_v2_dp_rank, target, leaf._fsdp_v2_tp_rank,
                                       leaf._fsdp_v2_shard_replica)
            continue
        flat = value if isinstance(value, FlatRangeShard) else FlatRangeShard(value.shape, value.reshape(-1), 0)
        if flat.local_flat.numel():
            slot = slots[name]
            numel = leaf._fsdp_v2_buckets[1][slot.bucket]
            requests[key] = bucket_tensor(bucket_key(leaf._fsdp_v2_mp_rank, slot.bucket, sub, leaf._fsdp_v2_bucket_dtype),
                                          flat, slot, numel)
    out = {"param_state_sharding_type": sharding_type, REQUESTS: requests}
    if sharding_type == DP_RESHARDABLE:
        scaler = ("grad_scaler",) if getattr(leaf, "grad_scaler", None) is not None else ()
        for name in ("optimizer", "per_bucket_numel_unpadded") + scaler:
            out[name] = bucket_object(leaf._fsdp_v2_mp_rank, name, dp_rank=leaf._fsdp_v2_dp_rank)
    return out


def _saved_bucket_numels(saved) -> list:
    """``per_bucket_numel_unpadded`` as Megatron saves it (``[{(param, grad dtype): [n, ...]}]``)
    -> the element counts of buffer 0 and how many buffers there are."""
    if not isinstance(saved, list) or not saved or not all(isinstance(b, dict) for b in saved):
        return [], 0
    return [int(n) for numels in saved[0].values() for n in numels], len(saved)


def values_from_loaded(leaf, state_dict: dict, templates: dict) -> dict:
    """What ``dist_checkpointing.load`` returned for ``loading_requests`` -> values of the core's
    optimizer state dict (``templates``' keys): Megatron's moments at this rank's ranges, Adam's
    step from the saved param_groups, our own hyperparameters (Megatron-LM's scheduler sets lr and
    weight decay every step)."""
    sharding_type = state_dict["param_state_sharding_type"]
    inner = state_dict.get("optimizer")
    if sharding_type == DP_RESHARDABLE:
        saved, buffers = _saved_bucket_numels(state_dict.get("per_bucket_numel_unpadded"))
        if buffers != 1 or saved != list(leaf._fsdp_v2_buckets[1]):
            raise ValueError(refusal(sharding_type, (
                f"its DDP buckets hold {saved} elements ({buffers} grad buffers) and this model's tensor/pipeline-"
                f"parallel layout and bucketing (--ddp-bucket-size, --overlap-grad-reduce) give "
                f"{list(leaf._fsdp_v2_buckets[1])} (one buffer); bucket-space state loads at any dp size, but only "
                "at the tensor- and pipeline-parallel sizes and bucketing it was saved with")))
    if not isinstance(inner, dict) or "param_groups" not in inner:
        raise ValueError(refusal(sharding_type, f"its inner optimizer state (param_groups, step) is missing, got "
                                 f"{type(inner).__name__}"))
    step = step_from_param_groups(inner["param_groups"], sharding_type)
    loaded, out = state_dict.get(REQUESTS, {}), {}
    for key, template in templates.items():
        if not key.startswith("state."):
            out[key] = template
            continue
        name, sub = _split(key)
        if sub == "step":
            out[key] = torch.full_like(template, step)
        elif key not in loaded:
            if isinstance(template, FlatRangeShard) and not template.boxes:
                out[key] = template                     # this rank holds none of it
                continue
            raise ValueError(f"optimizer checkpoint ({sharding_type}): no saved {sub!r} for parameter {name!r}.")
        else:
            out[key] = _as_template(key, template, loaded[key], leaf)
    return out


#: What tells Megatron's param groups apart (optimizer/__init__.py ``_get_param_groups``).
_GROUP_IDENTITY = ("is_expert_parallel", "wd_mult", "lr_mult", "is_decoupled_lr")


def restore_hyperparameters(optimizer, saved_groups) -> bool:
    """The numeric hyperparameters of the saved ``param_groups`` (lr, weight decay, betas, eps,
    Megatron's multipliers, ...) into ``optimizer``'s groups, as Megatron's DistributedOptimizer
    restores its own; structural flags (amsgrad, fused, ...) stay as the optimizer was built. Only
    where the saved groups are this optimizer's, one for one (same count, same expert / multiplier
    keys in order); elsewhere (another expert-parallel layout groups them differently) this run's
    stay. Megatron-LM's scheduler sets lr and weight decay again every step. Returns whether it did."""
    groups = optimizer.param_groups
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups) or not all(
            isinstance(saved, dict) and all(saved.get(k) == group.get(k) for k in _GROUP_IDENTITY)
            for saved, group in zip(saved_groups, groups)):
        return False

    def numeric(value) -> bool:
        if isinstance(value, tuple):
            return all(numeric(v) for v in value)
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for group, saved in zip(groups, saved_groups):
        for key, value in saved.items():
            current = group.get(key)
            if key in ("params", "step") or not numeric(value) or not numeric(current):
                continue
            if isinstance(value, tuple) and len(value) != len(current):
                continue
            group[key] = value
    return True


def _as_template(key: str, template, loaded, leaf):

    if isinstance(loaded, dict):                        # model-space boxes
        return from_loaded(key, template, loaded)
    if isinstance(template, FlatRangeShard):            # a flat bucket range
        return FlatRangeShard(template.shape, loaded.reshape(-1).to(template.dtype), template.flat_start)
    return loaded.reshape(template.shape).to(template.dtype)


def bucket_mismatch(leaf, metadata: dict) -> Optional[str]:
    """Why this rank's buckets (``leaf._fsdp_v2_buckets``) do not match the ``dp_reshardable``
    checkpoint's tensor ``metadata`` ({key: its DCP metadata}), or ``None``."""
    _, numels = leaf._fsdp_v2_buckets
    saved = {}
    for key, md in metadata.items():
        found = _BUCKET_KEY.match(key)
        if found and int(found.group(1)) == leaf._fsdp_v2_mp_rank and found.group(5) == "exp_avg":
            saved[(int(found.group(2)), int(found.group(4)))] = tuple(md.size)
    want = {(0, b): (n,) for b, n in enumerate(numels)}
    if saved == want:
        return None
    groups = sorted({int(m.group(1)) for m in map(_BUCKET_KEY.match, metadata) if m})
    return (f"it holds model-parallel groups {groups} with buckets {sorted(saved.items())} for group "
            f"{leaf._fsdp_v2_mp_rank}, while this tensor/pipeline-parallel layout and DDP bucketing (--ddp-bucket-size, "
            f"--overlap-grad-reduce) give buckets {sorted(want.items())}; bucket-space state loads at any dp size, but "
            "only at the tensor- and pipeline-parallel sizes and bucketing it was saved with")


# ---------------------------------------------------------------- writing Megatron's layouts
def inner_state(optimizer) -> dict:
    """What Megatron's ``DistributedOptimizer.state_dict()`` keeps of the inner torch optimizer:
    its state dict without ``state``, each param group without ``params`` and with Adam's
    ``step`` (torch's Adam; Megatron reads it back from the groups)."""
    packed = optimizer.state_dict()
    steps = {float(s["step"]) for s in packed["state"].values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"optimizer: parameters are at different Adam steps {sorted(steps)}; Megatron's "
                         "DistributedOptimizer checkpoints keep one step count.")
    step = steps.pop() if steps else 0.0
    out = {k: v for k, v in packed.items() if k != "state"}
    out["param_groups"] = [dict({k: v for k, v in g.items() if k != "params"}, step=step)
                           for g in packed["param_groups"]]
    return out


def saving_dict(leaf, values: dict, main_weights: dict, sharding_type: str, to_sharded) -> dict:
    """``sharded_state_dict()`` of ``leaf`` in Megatron DDP + DistributedOptimizer's layout of
    ``sharding_type`` (the module note), so Megatron's own ``load_checkpoint`` reads it: the
    moments from ``values`` (the core's optimizer state dict) and the fp32 main weights
    (``main_weights``: {parameter name: the core's value}) as ``param``."""
    if sharding_type not in MEGATRON_TYPES:
        raise ValueError(f"sharding_type must be one of {list(MEGATRON_TYPES)}, got {sharding_type!r}.")
    from ...checkpoint.state_dict import optimizer_param_names

    where = placed if sharding_type == FULLY_RESHARDABLE else (lambda leaf, name: leaf._fsdp_v2_slices.get(name))
    stepped = [n for n in optimizer_param_names(leaf._fsdp_v2_model, leaf.optimizer) if where(leaf, n) is not None]
    per_element = {}
    for key, value in values.items():
        if key.startswith("state."):
            name, sub = _split(key)
            found = where(leaf, name)
            if sub != "step" and found is not None and _per_element(value, found[1]):
                per_element[(name, sub)] = value
    # the fp32 main weights of the parameters this leaf steps (another leaf writes the others')
    per_element.update(((name, "param"), main_weights[name]) for name in stepped)
    inner = inner_state(leaf.optimizer)
    if sharding_type == FULLY_RESHARDABLE:
        tensors = {}
        for i, ((name, sub), value) in enumerate(sorted(per_element.items())):
            placement = placed(leaf, name)[0]
            target = placement._replace(key=f"optimizer.state.{sub}.{placement.key}")
            # replicated values: written by data-parallel rank 0, expert-data-parallel rank 0 for experts
            tensors[i] = to_sharded(target.key, value, leaf._replica_rank(f"state.{name}.{sub}"), target,
                                    leaf._fsdp_v2_tp_rank, leaf._fsdp_v2_shard_replica)
        out = {"optimizer": inner, "param_state": {k: v for k, v in tensors.items() if not (isinstance(v, dict) and not v)}}
    else:
        out = {"param_state": _bucket_pieces(leaf, per_element)}
        mp, dp_rank = leaf._fsdp_v2_mp_rank, leaf._fsdp_v2_dp_rank
        out["optimizer"] = bucket_object(mp, "optimizer", inner, dp_rank)
        dtypes, numels = _dtype_pair(leaf), list(leaf._fsdp_v2_buckets[1])
        padded = [lcm_padding(n, leaf._fsdp_v2_dp_size, False) for n in numels]
        out["param_state"]["per_bucket_numel"] = bucket_object(mp, "per_bucket_numel", [{dtypes: padded}], dp_rank)
        out["param_state"]["per_bucket_numel_unpadded"] = bucket_object(mp, "per_bucket_numel_unpadded",
                                                                        [{dtypes: numels}], dp_rank)
    if getattr(leaf, "grad_scaler", None) is not None:
        scaler = leaf.grad_scaler.state_dict()
        out["grad_scaler"] = (scaler if sharding_type == FULLY_RESHARDABLE
                              else bucket_object(leaf._fsdp_v2_mp_rank, "grad_scaler", scaler, leaf._fsdp_v2_dp_rank))
    out["param_state_sharding_type"] = sharding_type
    return out


def _dtype_pair(leaf) -> tuple:
    names = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}
    inside = leaf._fsdp_v2_bucket_dtype.strip("()").split(", ")
    return tuple(names[n] for n in inside)


def _bucket_pieces(leaf, per_element: dict) -> dict:
    """This rank's pieces of the flat bucket tensors, and (on the rank writing replicated values)
    zeros for the 64-element alignment gaps, which Megatron's load reads too."""
    slots, numels = leaf._fsdp_v2_buckets
    mp, dp_rank, replica = leaf._fsdp_v2_mp_rank, leaf._fsdp_v2_dp_rank, leaf._fsdp_v2_shard_replica
    pieces = {}
    for (name, sub), value in per_element.items():
        slot = slots[name]
        if isinstance(value, FlatRangeShard):
            flat, writer = value, replica
        else:
            flat, writer = FlatRangeShard(value.shape, value.detach().reshape(-1), 0), dp_rank
        if flat.local_flat.numel():
            piece = bucket_tensor(bucket_key(mp, slot.bucket, sub, leaf._fsdp_v2_bucket_dtype), flat, slot,
                                  numels[slot.bucket])
            piece.replica_id = (0, 0, writer)
            pieces[f"{name}.{sub}"] = piece
    if dp_rank == 0 and replica == 0:
        subs = sorted({sub for _, sub in per_element})
        for bucket, start, end in _gaps(slots, numels):
            for sub in subs:
                gap = FlatRangeShard((end - start,), torch.zeros(end - start), 0)
                pieces[f"gap{bucket}.{start}.{sub}"] = bucket_tensor(
                    bucket_key(mp, bucket, sub, leaf._fsdp_v2_bucket_dtype), gap, BucketSlot(bucket, start, end - start),
                    numels[bucket])
    return pieces


def _gaps(slots: dict, numels: list) -> list:
    """(bucket, start, end) of every stretch of a bucket no parameter covers."""
    out = []
    for bucket, numel in enumerate(numels):
        spans = sorted((s.start, s.start + s.numel) for s in slots.values() if s.bucket == bucket)
        at = 0
        for start, end in spans:
            if start > at:
                out.append((bucket, at, start))
            at = max(at, end)
        if at < numel:
            out.append((bucket, at, numel))
    return out
