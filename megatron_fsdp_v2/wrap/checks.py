"""What ``fully_shard`` checks and settles before it shards anything: the process groups it is
given (and for hybrid sharding how they fit together), the module's parameters, that every rank
builds the same model, and every rank's start values (rank 0's, as torch DDP's constructor).
Each check raises on every rank, naming the argument, so no rank waits alone in a collective.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..extensions.protocol import check_param_types
from ..comm import Communicator, all_gather_single
from .experts import check_expert_arguments, check_expert_group_inside
from ..comm.replicas import HFSDP_STRATEGIES, split_process_group
from ..row_sharded import dispatch_reaches_subclasses, mesh_of_group
from ..strategy import get_strategy

__all__ = ["check_hybrid_groups", "check_outer_sharding", "check_params", "check_process_group",
           "check_same_model_on_all_ranks", "group_device", "sync_module_states"]


def check_process_group(process_group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed initialised (init_process_group) first.")
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"process_group: this process (global rank {dist.get_rank()}) is not a member of the "
                         "given group; pass a group containing every data-parallel rank that calls fully_shard.")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {type(process_group).__name__}.")
    size = dist.get_world_size(process_group)
    if size < 1:
        raise ValueError(f"process_group must have at least one rank, got size {size}.")
    rank = dist.get_rank(process_group)
    if not 0 <= rank < size:
        raise ValueError(
            f"process_group: this process (global rank {dist.get_rank()}) is not a member of the group "
            f"(group rank {rank}, allowed 0..{size - 1}).")


def check_hybrid_groups(shards: Communicator, replicas: Communicator) -> None:
    """Hybrid sharding: every outer (replicate) group must link ranks holding the same shard, i.e.
    the same inner rank. A rank that finds otherwise in its outer group tells the others through
    its inner group and then its outer group, so every rank of the data-parallel world raises."""
    if dist.get_backend(shards.group) == "fake":
        return
    device = group_device(shards)
    inner_ranks = torch.empty(replicas.size, dtype=torch.int64, device=device)
    all_gather_single(inner_ranks, torch.tensor([shards.rank], dtype=torch.int64, device=device),
                      group=replicas.group)
    bad = torch.tensor([int(len(set(inner_ranks.tolist())) > 1)], dtype=torch.int64, device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=shards.group)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=replicas.group)
    if int(bad):
        raise ValueError(
            f"process_group: in an (outer, inner) pair every outer group must link the ranks with the same rank in "
            f"their inner groups (the same shard); this rank's outer group links inner ranks {inner_ranks.tolist()} "
            "(or another rank's does). Build the inner groups from consecutive ranks and the outer groups from "
            "ranks with the same position, e.g. init_device_mesh(device, (replicas, shard_size)).")


def check_outer_sharding(outer_sharding_strategy: str, strategy, inner: Communicator,
                          outer: Optional[Communicator], dtensor_params: bool = True) -> Optional[Communicator]:
    """HFSDP's preconditions; returns the Communicator of the whole world (None without HFSDP).
    The layout's shard index is the global rank, so it must be ``outer rank * inner size + inner
    rank`` (inner groups of consecutive ranks); a rank that finds otherwise makes every rank raise."""
    if outer_sharding_strategy not in ("no_shard", "optim"):
        raise ValueError(f"outer_sharding_strategy must be 'no_shard' or 'optim', got {outer_sharding_strategy!r}.")
    if outer_sharding_strategy == "no_shard":
        return None
    if outer is None:
        raise ValueError("outer_sharding_strategy='optim' shards across replicas: pass process_group=(outer, inner) "
                         "or a 2-D DeviceMesh (hybrid sharding).")
    if strategy.name not in HFSDP_STRATEGIES:
        raise ValueError(f"outer_sharding_strategy='optim' shards the optimizer state of an inner strategy that "
                         f"shards it, one of {list(HFSDP_STRATEGIES)}; got sharding_strategy={strategy.name!r}.")
    if inner.size * outer.size != dist.get_world_size():
        raise ValueError(f"outer_sharding_strategy='optim': the (outer, inner) groups must cover the whole world "
                         f"({dist.get_world_size()} ranks), got {outer.size} x {inner.size}.")
    device = group_device(inner)
    if dtensor_params:
        check_row_snapped_dtensors(device)
    bad = torch.tensor([int(dist.get_rank() != outer.rank * inner.size + inner.rank)], dtype=torch.int64,
                       device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if int(bad):
        raise ValueError("outer_sharding_strategy='optim': every rank's global rank must be outer rank x inner size "
                         "+ inner rank (inner groups of consecutive ranks, e.g. init_device_mesh(..., (nodes, "
                         "gpus_per_node))); this layout differs on some rank.")
    return Communicator(None)


def check_row_snapped_dtensors(device: torch.device) -> None:
    """HFSDP's parameters are row-snapped pieces over the whole world (comm/replicas.py), which only the
    DTensor subclass RowShardedTensor can express; a torch build whose DTensor dispatch skips
    subclasses (torch 2.11: pytorch/pytorch#167051, fixed by #177878) would compute ops on them by
    torch.chunk's rows, silently wrong. Refused there; the same torch on every rank, so every rank
    raises here, before any collective."""
    mesh = mesh_of_group(dist.group.WORLD, device)
    if not dispatch_reaches_subclasses(mesh):
        raise RuntimeError(
            f"outer_sharding_strategy='optim' (HFSDP) needs a torch whose DTensor dispatch reaches DTensor "
            f"subclasses; torch {torch.__version__} skips them (pytorch/pytorch#167051), so ops on the "
            f"parameters would be silently wrong. Use torch >= 2.13, or pass dtensor_params=False "
            f"(plain local tensors), or outer_sharding_strategy='no_shard' (HSDP: plain DTensors).")


def check_params(module: nn.Module) -> torch.device:
    params = list(module.parameters())
    if not params:
        raise ValueError(f"module: {type(module).__name__} has no parameters to shard.")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"module: all parameters must be on one device, got parameters on {devices}.")
    for name, param in module.named_parameters():
        if not param.is_floating_point():
            raise TypeError(f"module: parameter {name!r} has dtype {param.dtype}; only floating-point "
                            f"parameters can be sharded (float16, bfloat16, float32, float64).")
    check_param_types(module)
    return params[0].device


def _described_params(module: nn.Module) -> list:
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]


def _what(entry: tuple) -> str:
    _, shape, dtype, requires_grad = entry
    return f"shape {shape} dtype {dtype}{'' if requires_grad else ' (frozen)'}"


def first_difference(mine: list, theirs: list, my_rank: int, their_rank: int) -> str:
    """The first parameter (in ``named_parameters`` order) that two ranks describe differently,
    with what each rank has: what a user needs to find the rank-dependent branch of model code."""
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a == b:
            continue
        if a[0] == b[0]:
            return (f"first difference: parameter {a[0]!r} is {_what(a)} on rank {my_rank} but {_what(b)} "
                    f"on rank {their_rank}")
        return (f"first difference: parameter #{index} is {a[0]!r} ({_what(a)}) on rank {my_rank} but "
                f"{b[0]!r} ({_what(b)}) on rank {their_rank}")
    common = min(len(mine), len(theirs))
    longer, rank, other = (mine, my_rank, their_rank) if len(mine) > common else (theirs, their_rank, my_rank)
    return (f"first difference: rank {rank} has {len(longer)} parameters, rank {other} {common}; the first "
            f"extra one is {longer[common][0]!r} ({_what(longer[common])})")


def check_same_model_on_all_ranks(module: nn.Module, comm: Communicator, device: torch.device) -> None:
    """Compare a digest of (name, shape, dtype) across ranks so a mismatch errors instead of hanging.
    On a mismatch (seen by every rank, so all of them enter) the ranks exchange their parameter
    lists to name the first parameter that differs."""
    if dist.get_backend(comm.group) == "fake":      # torch's fake group (memory studies): no real data moves
        return
    described = _described_params(module)
    text = ";".join(f"{n}:{shape}:{dtype}:{rg}" for n, shape, dtype, rg in described)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(comm.size, dtype=torch.int64, device=device)
    comm.all_gather(everyone, mine, label="model digest (wrap-time check)")
    differing = [r for r, d in enumerate(everyone.tolist()) if d != digest]
    if differing:
        lists = comm.all_gather_object(described)
        detail = first_difference(described, lists[differing[0]], comm.rank, differing[0])
        raise ValueError(
            f"module: parameter names/shapes/dtypes differ between data-parallel ranks: rank {comm.rank} "
            f"disagrees with ranks {differing}; {detail}. Every rank must build the same model before fully_shard.")


def sync_module_states(module: nn.Module, comm: Communicator, skip: frozenset = frozenset(),
                        only: Optional[set] = None) -> None:
    """Every rank starts from rank 0's parameters and buffers, as torch DDP's constructor does:
    replicas that began apart would otherwise drift apart (``no_shard``) or be stitched together
    from pieces of different ranks' models (the sharded strategies). ``only``: just these
    parameters (by id; no buffers); ``skip``: all but these."""
    if comm.size == 1 or dist.get_backend(comm.group) == "fake":
        return
    params = [p.detach() for p in module.parameters() if id(p) not in skip and (only is None or id(p) in only)]
    tensors = params + ([b for b in module.buffers() if b.numel()] if only is None else [])
    comm.broadcast(tensors, src_group_rank=0, label="rank 0's parameters and buffers at wrap time")


def group_device(comm: Communicator) -> torch.device:
    """Where a process group's tensors live: the current CUDA device for NCCL; for torch's fake
    group (one process playing one rank of N, to measure memory) the current accelerator where
    there is one, as the real job would; else the CPU."""
    backend = dist.get_backend(comm.group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "fake" and torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


# ---------------------------------------------------------------- fully_shard's first stages
class WrapGroups(NamedTuple):
    """The communicators of one wrap: the shard group, the replicas across it (HSDP) and the
    expert parameters' group, each None where not used."""

    comm: Communicator
    replicas: Optional[Communicator]
    experts: Optional[Communicator]

    def all(self) -> list:
        return [c for c in (self.comm, self.replicas, self.experts) if c is not None]


def wrap_communicators(process_group, expert_process_group, expert_params) -> WrapGroups:
    """Check the groups (and their nesting) and make one Communicator for each."""
    shard_group, replicate_group = split_process_group(process_group)
    check_expert_arguments(expert_process_group, expert_params, replicate_group is not None)
    check_process_group(shard_group)
    comm = Communicator(shard_group)
    experts = None
    if expert_process_group is not None:
        check_process_group(expert_process_group)
        experts = Communicator(expert_process_group)
        check_expert_group_inside(experts, comm)
    replicas = None
    if replicate_group is not None:
        check_process_group(replicate_group)
        replicas = Communicator(replicate_group)
        check_hybrid_groups(comm, replicas)
    return WrapGroups(comm, replicas, experts)


def sync_start_values(module: nn.Module, groups: WrapGroups, experts: frozenset) -> None:
    """Every rank starts from rank 0's parameters and buffers (torch DDP's rule): inner groups
    first, each from its rank 0, then every replica from replica 0 (so global rank 0's); expert
    parallel peers keep their own experts and agree on them within the expert group."""
    sync_module_states(module, groups.comm, skip=experts)
    if groups.replicas is not None:
        sync_module_states(module, groups.replicas)
    if groups.experts is not None:
        sync_module_states(module, groups.experts, only=experts)
