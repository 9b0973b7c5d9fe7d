"""ParamGroup: the flat buffers of one unit's parameters of one dtype x requires_grad.

A group owns, per ``strategy.py``'s table:

* ``main_shard``: the main weights the optimizer updates: this rank's shard (``optim_sharded``)
  or the whole buffer. Optimizer-facing parameters (``main_params``) are views into it.
* ``model_weights``: the full-size compute-dtype buffer forward and backward read. Persistent,
  or (``weights_sharded``) a temporary from the allocator that lives only around a unit's use.
  When nothing is sharded and dtypes agree, it *is* ``main_shard`` (no second copy).
* grads: a full-size ``full_grad`` (``grads_sharded`` False) or a ``grad_shard``; ZeRO-2/3 keep
  a backward's gradients per parameter until the group reduces, then copy them into a reduce
  input from the allocator (unreduced_grads.py, [Note: unreduced gradients stay per parameter]).
  With ``persistent_grads`` (Megatron's ``main_grad``) the group keeps them; otherwise, once the
  reduced gradients are attached as the optimizer's ``.grad``, those views alone hold the buffer
  (grad_buffer.py, [Note: gradient buffers live as long as .grad]).

The engine (``runtime/engine.py``) decides *when* to call ``unshard`` / ``reshard`` / ``reduce_grad`` (reduce.py);
this file decides *how*, from the table's booleans.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..allocators.base import Allocator
from ..comm import Communicator, PendingCollective, wait_pending as _wait
from .grad_buffer import GradBuffer
from .export import GroupExport
from .offload import GroupOffload
from .reduce import GroupReduce
from .unreduced_grads import UnreducedGrads
from ..extensions.protocol import set_data
from ..extensions.weights import ExtensionWeights
from .layout import FlatLayout, build_layout
from .main_segment import build_device
from .main_weights import MainWeights
from .levels import OneLevel, group_levels
from ..offload.host_link import OffloadedGroup
from .shard_order import add_rank_major, natural_from_gathered
from ..mixed_precision import GroupDtypes
from ..comm.replicas import HybridLevels
from ..strategy import ShardingStrategy


class ParamGroup:
    """Flat main-weight, model-weight and grad buffers of a list of parameters.

    Everything a group holds is declared below, by concern, and set in ``__init__``. Five concerns
    live in parts of their own, each holding this group (``part.group``): the main weights as the
    optimizer sees them (``main``, main_weights.py), the levels of ranks it gathers and reduces over
    (``levels``, levels.py: flat or HFSDP's two, the one part that holds tensors of its own),
    reducing gradients (``reducer``, reduce.py), the host side of offload (``offloading``,
    group/offload.py) and what is reported and exported between steps (``exporter``, export.py).
    The others write some of the attributes below but add none."""

    # -- layout and strategy: what the group is made of and how it is sharded
    name: str                            # the group's tag (wrap/units.py); the allocator's keys start with it
    params: list[nn.Parameter]           # the module's parameters (extension groups: then their compute parameters)
    param_names: list[str]               # each parameter's first name in the module
    shapes: list[torch.Size]             # each parameter's shape as wrapped
    strategy: ShardingStrategy           # which of main weights, grads, compute weights are sharded
    comm: Communicator                   # the data-parallel group the main weights are sharded over
    dtypes: GroupDtypes                  # compute, main, grad and grad-comm dtypes
    allocator: Allocator                 # temporaries: ZeRO-3's gathered weights, reduce inputs, stashes
    device: torch.device
    requires_grad: bool                  # the parameters' requires_grad at wrapping
    layout: FlatLayout                   # offsets of the parameters in the flat buffers and the shards
    mesh: Optional[DeviceMesh]           # sharded main weights face the optimizer as DTensors on it (None: plain)
    shard_start: int                     # this rank's range of the flat buffer (the whole of it unsharded)
    shard_end: int

    # -- weights
    main_shard: Optional[torch.Tensor]   # main weights: this rank's shard or the whole buffer (None: meta, not yet)
    main_in_segment: bool                # the main shard moves into the rank's main segment (main_segment.py)
    main_locals: list[torch.Tensor]      # each parameter's piece of main_shard, as plain tensors
    main_params: Optional[list[nn.Parameter]]    # the optimizer's parameters, viewing main_shard (None: not made yet)
    model_weights: Optional[torch.Tensor]        # full compute weights (ZeRO-3: only while unsharded)
    compute_weights_are_main_weights: bool       # model_weights is main_shard (no cast, nothing sharded)
    is_unsharded: bool                   # the parameters view full compute weights
    _weights_key: tuple[str, str]        # allocator key of ZeRO-3's gathered compute weights
    _gathered_key: tuple[str, str]       # allocator key of the rank-major gather (per-parameter shards)
    _pending_unshard: Optional[PendingCollective]   # ZeRO-3's weight gather in flight
    pending_refresh: Optional[PendingCollective]    # ZeRO-1/2's (HFSDP: the inner shard's) refresh in flight

    # -- grads
    grads: GradBuffer                    # full_grad or grad_shard (grad_buffer.py)
    unreduced_grads: UnreducedGrads      # ZeRO-2/3: this backward's gradients, not yet reduced
    grads_ready: list[bool]              # per parameter: got this backward's gradient
    got_grad: list[bool]                 # per parameter: got a gradient on this rank since the last zeroing
    trainable: list[bool]                # per parameter: requires_grad at the last forward
    reduced: list[bool]                  # per parameter: trainable at any forward since the last zeroing
    own_region_holds_mean: bool          # ZeRO-1: this rank's region of full_grad holds a reduced mean
    _stash_key: tuple[str, str]          # allocator key of stashed_mean
    stashed_mean: Optional[torch.Tensor] # ZeRO-1: that mean, set aside while a further backward accumulates

    # -- the group's parts
    main: MainWeights                    # the main weights' pieces and the optimizer's parameters (main_weights.py)
    levels: OneLevel                     # flat or HFSDP's (inner, outer): gather, reduce, replica average (levels.py)
    reducer: GroupReduce                 # reduce-scatter / all-reduce of the gradients (reduce.py)
    offloading: GroupOffload             # the main shard on the host, gathers fed from it (group/offload.py)
    exporter: GroupExport                # persistent bytes, whole weights and grads on every rank (export.py)

    # -- reduce (reduce.py)
    comm_key: tuple[str, str]            # allocator key of the reduce input
    has_unreduced_grads: bool            # gradients accumulated since the last reduce
    reduced_this_backward: bool          # the group reduced during this backward
    awaiting_replica_reduce: bool        # hybrid sharding: reduced here, not yet averaged across replicas

    # -- offload (group/offload.py)
    offloaded: Optional[OffloadedGroup]  # the host main shard and gradients (None: on the device)


    # -- export (checkpoints, nested wraps)
    all_names: list                      # per parameter: every name it is reached by (tied parameters: several)
    param_dtype: torch.dtype             # the parameters' dtype before wrapping (wrap/nested.py gives it back)

    # -- FSDP2's extension protocol (e.g. float8)
    extension: Optional[ExtensionWeights]   # parameters whose class gathers them (extensions/weights.py)

    def __init__(
        self,
        name: str,
        params: Sequence[nn.Parameter],
        param_names: Sequence[str],
        strategy: ShardingStrategy,
        comm: Communicator,
        dtypes: GroupDtypes,
        allocator: Allocator,
        device: torch.device,
        alignment: int = 1,
        mesh=None,
        levels: Optional[HybridLevels] = None,
        offload=None,
        persistent_grads: bool = True,
        main_segment: bool = False,
        from_meta: bool = False,
        extension: Optional[ExtensionWeights] = None,
        *,
        all_names: Sequence[list[str]],
        param_dtype: torch.dtype,
    ) -> None:
        self.name = name
        self.main, self.reducer = MainWeights(self), GroupReduce(self)
        self.offloading, self.exporter = GroupOffload(self), GroupExport(self)
        self.params = list(params)
        self.param_names = list(param_names)
        self.all_names = list(all_names)
        self.param_dtype = param_dtype
        self.shapes = [p.shape for p in self.params]
        self.strategy = strategy
        self.comm = comm
        self.dtypes = dtypes
        self.allocator = allocator
        self.device = device
        self.requires_grad = self.params[0].requires_grad
        # parameters whose class gathers them (FSDP2's extension protocol): their compute weights are
        # that class's (e.g. float8), not a flat buffer of ours (extensions/weights.py)
        self.extension = extension
        # HFSDP (comm/replicas.py, [Note: sharding across replicas (HFSDP)]): ``levels`` are (inner, outer)
        # Communicators and ``comm`` is the whole data-parallel world the main weights are sharded over.
        self.levels = group_levels(self, levels)
        self.layout = build_layout([tuple(p.shape) for p in self.params], comm.size, alignment,
                                   per_parameter=strategy.shards_each_parameter
                                   and self.levels.allows_per_parameter_shards)
        # Sharded main weights face the optimizer as RowShardedTensors on this mesh (None: as plain
        # tensors holding this rank's rows, what Megatron's optimizer expects).
        self.mesh = mesh if strategy.optim_sharded else None
        rank = comm.rank
        self.shard_start, self.shard_end = (
            self.layout.shard_range(rank) if strategy.optim_sharded else (0, self.layout.total_numel)
        )
        self._weights_key = (name, "model_weights")
        self._gathered_key = (name, "gathered_weights")    # per-parameter shards: the rank-major gather
        self.comm_key = (name, "comm_grad")
        # The one owner of each kind of weight collective in flight: ZeRO-3's gather into a
        # temporary buffer, or ZeRO-1/2's refresh of the persistent replicated weights. (Gradient
        # reduces in flight are owned by the engine: ``reduce_grad`` returns them.)
        self._pending_unshard: Optional[PendingCollective] = None
        self.pending_refresh: Optional[PendingCollective] = None
        self.is_unsharded = False
        self.unreduced_grads = UnreducedGrads(len(self.params))   # ZeRO-2/3: this backward's, not yet reduced
        self.grads_ready = [False] * len(self.params)
        # got_grad: which parameters received a gradient on this rank since the grads were last
        # zeroed (a parameter none of the ranks used gets ``.grad = None``, as torch DDP gives).
        self.got_grad = [False] * len(self.params)
        # trainable: the requires_grad each parameter had at the last forward (freezing after
        # wrapping is honoured: see Engine.sync_requires_grad).
        self.trainable = [self.requires_grad] * len(self.params)
        # reduced: trainable at any forward since the grads were last zeroed, so the reduce (and
        # .grad) keeps what a parameter accumulated before it was frozen mid-step, as torch does
        # (DeepSpeed's TestZeroUnbalancedGradients freezes half the parameters per micro-batch)
        self.reduced = list(self.trainable)
        self.has_unreduced_grads = False
        self.awaiting_replica_reduce = False     # hybrid sharding: reduced here, not yet averaged across replicas
        self.reduced_this_backward = False
        # ZeRO-1 only: after a reduce this rank's region of ``full_grad`` holds the data-parallel
        # *mean* while the other regions are zero. A further backward before the grads are zeroed
        # must not reduce that mean again (it would be divided by dp once more): it moves to a
        # shard-sized temporary (``_stash_key``) and is added back to the next reduce's result,
        # which is how ZeRO-2 accumulates, so the two agree bitwise.
        self.own_region_holds_mean = False
        self._stash_key = (name, "reduced_grad_stash")
        self.stashed_mean: Optional[torch.Tensor] = None
        # The gradient buffer (full_grad or grad_shard; grad_buffer.py)
        grads_numel = self.layout.shard_numel if strategy.grads_sharded else self.layout.total_numel
        self.grads = GradBuffer(grads_numel, dtypes.grad, device)
        self.grads.persistent = persistent_grads
        self.main_locals: list[torch.Tensor] = []
        self.main_params = None
        self.offloaded = None            # _init_buffers may offload (group/offload.py)
        self._init_buffers(offload, main_segment, from_meta)

    # ------------------------------------------------------------------ construction
    def _init_buffers(self, offload=None, main_segment: bool = False, from_meta: bool = False) -> None:
        dt = self.dtypes
        # main_segment: the main shard moves into the rank's main segment once every group is built
        # (main_segment.py, built where ``build_device`` says); the main parameters are made after
        # that move (``main.make_params``). From meta the values come later (wrap/meta_init.py): no
        # buffer before the segment's, and a zeroed one (no values to read) outside it.
        self.main_in_segment = main_segment and offload is None
        if self.main_in_segment and from_meta:
            self.main_shard = None
        else:
            built_on = build_device(self.device, self.comm.size) if self.main_in_segment else self.device
            self.main_shard = self.main.own_values_buffer(built_on, from_values=not from_meta)
        self.compute_weights_are_main_weights = (not self.strategy.optim_sharded and dt.compute == dt.main
                                                 and self.extension is None)
        if offload is not None:          # main shard to the host (group/offload.py)
            self.offloading.offload_main(offload)
        if self.extension is not None:   # compute weights made by the parameters' class, after the wrap
            self.model_weights = None
            self.is_unsharded = not self.strategy.weights_sharded
            if not from_meta:            # made from the main weights: the originals are not read again
                for param in self.params:
                    set_data(param, torch.empty(0, dtype=param.dtype, device=self.device))
        elif self.strategy.weights_sharded:
            self.model_weights = None
            for param in self.params:
                param.data = torch.empty(0, dtype=dt.compute, device=self.device)
            self.levels.make_inner_shard()
        else:
            if self.compute_weights_are_main_weights:
                self.model_weights = self.main_shard
            else:
                self.model_weights = torch.empty(self.layout.total_numel, dtype=dt.compute, device=self.device)
            self._point_params_at(self.model_weights)
            self.is_unsharded = True
            if not self.compute_weights_are_main_weights:
                self.rebuild_compute_weights(async_op=False)

        if not self.main_in_segment:
            self.main.make_params()
        # ZeRO-2/3 without persistent grads: no buffer until the first reduce lands in a new one, as
        # after zero_grad(set_to_none=True) and as FSDP2 (a zeroed shard held from here would sit
        # through the first forward, and the first reduce would need a temporary beside it). An
        # offloaded ZeRO-2/3 group's reduced gradients live on the host.
        if self.requires_grad and (not self.strategy.grads_sharded
                                   or (self.grads.persistent and self.offloaded is None)):
            self.ensure_grads()

    @property
    def grads_allocated_later(self) -> bool:
        """Whether this group's device gradient buffer is made by a later backward (not yet
        allocated; not on the host)."""
        return self.requires_grad and self.offloaded is None and self.grads.live() is None

    # ------------------------------------------------------------------ the gradient buffer
    @property
    def full_grad(self) -> Optional[torch.Tensor]:
        """DDP / ZeRO-1: the full-size gradient buffer (None while released, or frozen)."""
        return None if self.strategy.grads_sharded else self.grads.live()

    @property
    def grad_shard(self) -> Optional[torch.Tensor]:
        """ZeRO-2/3: this rank's reduced-gradient shard (None while released, or frozen)."""
        return self.grads.live() if self.strategy.grads_sharded else None

    def ensure_grads(self, zeroed: bool = True) -> torch.Tensor:
        """The gradient buffer, held strongly again; a zeroed one if it was freed (``zeroed=False``:
        uninitialized, for a reduce that overwrites all of it)."""
        buffer, fresh = self.grads.ensure(zeroed)
        if fresh:
            self.own_region_holds_mean = False
        return buffer

    def repoint_param(self, index: int) -> None:
        """Point the module's parameter ``index`` back at what this group holds for it."""
        if self.extension is not None:
            return                       # replaced by the compute parameter its class makes
        if self.model_weights is None:
            self.params[index].data = torch.empty(0, dtype=self.dtypes.compute, device=self.device)
        else:
            start, end = self.layout.param_range(index)
            self.params[index].data = self.model_weights[start:end].view(self.shapes[index])

    def _point_params_at(self, full: torch.Tensor) -> None:
        for index, param in enumerate(self.params):
            start, end = self.layout.param_range(index)
            param.data = full[start:end].view(self.shapes[index])

    # ------------------------------------------------------------------ weights
    def rebuild_compute_weights(self, async_op: bool = True) -> None:
        """Rebuild the persistent replicated compute weights from the main weights."""
        if self.compute_weights_are_main_weights:
            return
        if self.extension is not None and not self.strategy.weights_sharded:
            self.wait_refresh()
            self.pending_refresh = self.extension.refresh(self, async_op)
            return
        if self.strategy.weights_sharded:
            self.levels.refresh_inner_shard(async_op)        # HFSDP: by one outer all-gather
            return
        if self.strategy.optim_sharded:
            # A refresh still in flight writes into the same buffer (two optimizers stepping before
            # the next forward each start one): finish it before this one overwrites it.
            self.wait_refresh()
            self.pending_refresh = self._refresh_replicated(async_op)
        else:
            self.offloading.refresh_whole_weights()

    def _refresh_replicated(self, async_op: bool) -> PendingCollective:
        """ZeRO-1/2: all-gather the main shards into the replicated compute weights in place. With
        per-parameter shards the gather lands rank-major; once it has landed the buffer is put in
        natural order through a temporary of the group's size, so only the group being reordered
        holds one, not every group whose refresh is in flight."""
        pending = self.levels.gather_into(self.model_weights, async_op)
        if not self.layout.per_parameter:
            return pending
        if not async_op:
            self._reorder_gathered_weights()
            return pending
        return PendingCollective(pending.work, self._reorder_gathered_weights)

    def _reorder_gathered_weights(self) -> None:
        gathered = torch.empty_like(self.model_weights)
        with torch.no_grad():
            gathered.copy_(self.model_weights)
        natural_from_gathered(gathered, self.layout, self.model_weights)

    def gather_own_slot(self, comm, output: torch.Tensor, async_op: bool, label: str) -> PendingCollective:
        """All-gather equal pieces over ``comm`` into ``output``, this rank's main shard cast straight
        into its own slot first (slot ``comm.rank`` of ``output``): the in-place form NCCL and gloo
        accept, so no separate cast copy of the shard lives while the collective is in flight."""
        size = self.layout.shard_numel
        slot = output[comm.rank * size:(comm.rank + 1) * size]
        with torch.no_grad():
            self.offloading.write_own_slot(slot)
        work = comm.all_gather(output, slot, async_op=async_op, label=label)
        return PendingCollective(work if async_op else None, lambda: None)

    def unshard(self, async_op: bool = True) -> None:
        """ZeRO-3: allocate the full compute buffer and all-gather the weights into it (per-parameter
        shards: into a rank-major temporary, copied out when it lands)."""
        if self.is_unsharded:
            return
        self.levels.before_unshard()
        self.is_unsharded = True
        if self.extension is not None:
            self._pending_unshard = self.extension.refresh(self, async_op)
            return
        if self.layout.per_parameter:
            self._pending_unshard = self._gather_rank_major(async_op)
            return
        full = self.allocator.allocate(self._weights_key, self.layout.total_numel, self.dtypes.compute, self.device)
        self.model_weights = full
        self._point_params_at(full)
        self._pending_unshard = self.levels.gather_into(full, async_op)

    def _gather_rank_major(self, async_op: bool) -> PendingCollective:
        """Per-parameter shards: all-gather into a rank-major temporary; once it has landed, copy it
        out into the natural buffer the parameters view (allocated only then, so a prefetch in
        flight holds one unit-size buffer, as FSDP2's) and free it (shard_order.py)."""
        gathered = self.allocator.allocate(self._gathered_key, self.layout.total_numel, self.dtypes.compute,
                                           self.device)
        pending = self.gather_own_slot(self.comm, gathered, async_op, f"weights of {self.name}")

        def copy_out():
            natural = self.allocator.allocate(self._weights_key, self.layout.total_numel, self.dtypes.compute,
                                              self.device)
            natural_from_gathered(gathered, self.layout, natural)
            self.allocator.free(self._gathered_key)
            self.model_weights = natural
            self._point_params_at(natural)
        if not async_op:
            copy_out()
            return pending
        # Until it lands the parameters view the rank-major buffer at their natural offsets: their
        # values are not theirs yet (as a row-snapped gather in flight), but their shapes are, which
        # autograd checks when a gradient reaches a unit no backward trigger gathered first (a unit
        # whose output pytree cannot see and whose weights its backward does not read).
        self._point_params_at(gathered)
        return PendingCollective(pending.work, copy_out)

    def wait_unshard(self) -> None:
        pending, self._pending_unshard = self._pending_unshard, None
        _wait(pending)

    def wait_refresh(self) -> None:
        pending, self.pending_refresh = self.pending_refresh, None
        _wait(pending)

    def reshard(self) -> None:
        """ZeRO-3: give the full compute buffer back; parameters become empty until the next unshard."""
        if not (self.strategy.weights_sharded and self.is_unsharded):
            return
        self.wait_unshard()
        self.is_unsharded = False
        if self.extension is not None:
            self.extension.free()
            return
        released = torch.empty(0, dtype=self.dtypes.compute, device=self.device)   # one for all: no allocation each
        for param in self.params:
            param.data = released
        self.model_weights = None
        self.allocator.free(self._weights_key)

    # ------------------------------------------------------------------ grads
    @property
    def keeps_compute_weights(self) -> bool:
        """Whether compute weights persist between steps and are refreshed from the main weights
        after one: replicated (DDP, ZeRO-1/2), or HFSDP ZeRO-3's inner shard; flat ZeRO-3 gathers at use."""
        return not self.strategy.weights_sharded or self.levels.keeps_inner_shard

    @property
    def gather_size(self) -> int:
        """Ranks ZeRO-3's weight gather reads from (HFSDP: the inner group)."""
        return self.levels.gather_size

    @property
    def reduce_frees_memory(self) -> bool:
        """ZeRO-2/3: whether reducing now takes less memory than keeping the gradients held until
        the end of backward (the reduced shard, in the grad dtype, is smaller than the gradients
        held in the compute dtype): a bf16 group reducing into fp32 at one or two ranks does not.
        An offloaded group's reduced gradients go to the host: reducing frees what it holds (and
        its CPU step can begin; a GPT's output layer then steps while the blocks' backward runs)."""
        if not self.strategy.grads_sharded or self.offloaded is not None:
            return True
        held = sum(self.layout.numels) * self.dtypes.compute.itemsize
        return self.layout.shard_numel * self.dtypes.grad.itemsize < held

    @property
    def holds_unreduced_grads(self) -> bool:
        """ZeRO-2/3: some of this backward's gradients wait for the group's reduce."""
        return self.strategy.grads_sharded and self.unreduced_grads.any()

    def accumulate_grad(self, index: int, grad: torch.Tensor) -> None:
        """Take one parameter's fresh gradient: ZeRO-2/3 keep it as is until the group reduces
        (unreduced_grads.py); DDP/ZeRO-1 add it into the persistent full-size buffer."""
        if self.strategy.grads_sharded:
            self.unreduced_grads.add(index, grad)
        else:
            full = self.ensure_grads()
            if self.own_region_holds_mean:
                start, end = self.layout.shard_range(self.comm.rank)
                stash = self.allocator.allocate(self._stash_key, end - start, full.dtype, self.device)
                with torch.no_grad():
                    stash.copy_(full[start:end])
                    full[start:end].zero_()
                self.stashed_mean = stash
                self.own_region_holds_mean = False
            self._add_to_full_grad(full, index, grad)
        self.grads_ready[index] = True
        self.got_grad[index] = True
        self.has_unreduced_grads = True

    def _add_to_full_grad(self, full: torch.Tensor, index: int, grad: torch.Tensor) -> None:
        """DDP / ZeRO-1: add a gradient into the full-size buffer, in the order its reduce reads
        (ZeRO-1's per-parameter shards: rank-major, so the reduce-scatter reads it in place and
        this rank's region is one range of it)."""
        if self.layout.per_parameter:
            add_rank_major(full, self.layout, index, grad.reshape(-1))
            return
        start, end = self.layout.param_range(index)
        full[start:end].add_(grad.reshape(-1))

    def begin_backward(self) -> None:
        """Readiness is per backward pass: a parameter counts once it got this pass's gradient."""
        self.grads_ready = [False] * len(self.params)
        self.reduced_this_backward = False

    def all_grads_ready(self) -> bool:
        """Every parameter that may get a gradient (not frozen since wrapping) got this pass's."""
        return all(ready or not trainable for ready, trainable in zip(self.grads_ready, self.trainable))

    def scale_grads(self, factor: float) -> None:
        """Multiply the gradients this group holds (reduced or accumulating) by ``factor``."""
        if self.offloaded is not None:
            self.offloaded.flush()
        with torch.no_grad():
            for buffer in (self.full_grad, self.grad_shard, self.stashed_mean, self.levels.inner_grad,
                           self.offloaded.grad if self.offloaded is not None else None):
                if buffer is not None:
                    buffer.mul_(factor)

    def release_stashed_mean(self) -> None:
        """ZeRO-1: free the set-aside mean once it is back in this rank's region (reduce.py, levels.py)."""
        self.allocator.free(self._stash_key)
        self.stashed_mean = None

    def discard_backward_state(self) -> None:
        """Forget a backward that raised: free its temporaries and its readiness bookkeeping
        (pending collectives must have been waited for)."""
        for key in (self.comm_key, self._stash_key):
            if self.allocator.is_live(key):
                self.allocator.free(key)
        self.stashed_mean = self.levels.inner_grad = None
        self.unreduced_grads.clear()
        self.grads_ready = [False] * len(self.params)
        self.has_unreduced_grads = False
        self.reduced_this_backward = False

    def main_grad_buffer(self) -> Optional[torch.Tensor]:
        """The buffer laid out like ``main_shard`` that holds the reduced gradients."""
        if not self.requires_grad:
            return None
        if self.offloaded is not None:           # the host copy (group/offload.py)
            self.offloaded.flush()
            return self.offloaded.grad
        if self.strategy.grads_sharded:
            return self.grad_shard
        if self.strategy.optim_sharded:
            return self.full_grad[self.shard_start:self.shard_end]
        return self.full_grad

    def attach_main_grads(self, none_if_unused: bool = True) -> None:
        """Point every optimizer-facing parameter's ``.grad`` at its reduced gradient.

        With ``none_if_unused``, a parameter that no rank used since the grads were last zeroed
        keeps ``.grad = None`` (torch DDP and FSDP2 do the same), so Adam's momentum and AdamW's
        decay leave it alone. "No rank used it" is read without a collective: it got no gradient
        here and its reduced piece is exactly zero (any rank's contribution would show there).
        """
        if not self.requires_grad:
            return
        # a buffer freed by zero_grad(set_to_none=True) that no reduce has re-created yet (HFSDP
        # under no_sync: the inner reduces wait for the outer one) comes back zeroed, so every
        # .grad is attached and a later zero_grad detection sees no stale None
        if self.offloaded is None:
            self.ensure_grads()
        buffer = self.main_grad_buffer()
        for index, main in enumerate(self.main_params):
            if not self.reduced[index]:         # frozen since wrapping, all step: no gradient, as torch gives
                main.grad = None
            elif none_if_unused and not self.got_grad[index] and not bool(self.main.view(buffer, index).any()):
                main.grad = None
            else:
                main.grad = self._grad_facing_optimizer(buffer, index)

    def _grad_facing_optimizer(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s ``.grad``: its piece of ``buffer`` as the optimizer sees it. An
        offloaded group's host gradient lives as long as the group, so those are made once and
        attached again every step (the same storage either way): making the DTensor took ~0.2 ms
        per parameter, on the critical path of the thread that steps offloaded groups during
        backward (offload/backward_steps.py)."""
        if self.offloaded is None:
            return self.main.facing_optimizer(self.main.view(buffer, index), index)
        made = self.offloaded.grads_facing_optimizer
        if index not in made:
            made[index] = self.main.facing_optimizer(self.main.view(buffer, index), index)
        return made[index]

    def zero_grads(self, release: bool = False) -> None:
        """Start a fresh accumulation. ``release`` (the optimizer set ``.grad`` to None): without
        ``persistent_grads`` the buffer is let go rather than zeroed, so a ``.grad`` tensor the user
        kept from before keeps its values, as torch's would; the next gradient gets a new buffer."""
        self.levels.inner_grad = None
        if self.stashed_mean is not None:
            self.release_stashed_mean()
        if release:
            self.grads.let_go()
        with torch.no_grad():
            for buffer in (self.full_grad, self.grad_shard):
                if buffer is not None:
                    buffer.zero_()
        if self.offloaded is not None:
            self.offloaded.zero()
        self.has_unreduced_grads = False
        self.awaiting_replica_reduce = False
        self.own_region_holds_mean = False
        self.grads_ready = [False] * len(self.params)
        self.got_grad = [False] * len(self.params)
        self.reduced = list(self.trainable)
