"""A ParamGroup's gradient reduce: the collective over the data-parallel group, where its result
lands (per strategy), the packed reduce of a group some of whose parameters were frozen after
wrapping (trainable_pack.py, [Note: reducing what requires grad]) and the average across replicas.
Apart from param_group.py, which holds the buffers and the other verbs on them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..comm import PendingCollective, wait_pending
from .trainable_pack import TrainablePack, trainable_pack
from .part import GroupPart

if TYPE_CHECKING:
    from .param_group import ParamGroup

__all__ = ["GroupReduce"]


class GroupReduce(GroupPart):
    """A part of ParamGroup (its ``reducer``); reads and writes the group's gradient buffers, layout,
    strategy and communicator."""

    def reduce_grad(self, divide_factor: float) -> Optional[PendingCollective]:
        """Issue the reduce of this micro-batch's (or accumulated) local gradients over the
        data-parallel group, asynchronously; the caller owns the returned handle and passes it to
        ``finish_grad_reduce``. None when there is nothing to reduce.

        Result: the sum over ranks divided by ``divide_factor`` (the data-parallel size: a mean)
        lands in ``grad_shard`` (added to it: ZeRO-2/3 accumulate over micro-batches), or in
        ``full_grad``'s shard range (ZeRO-1) or all of ``full_grad`` (DDP). Only the parameters
        still trainable are reduced (``trainable_pack``); a frozen one's range is left alone
        (DDP / ZeRO-1: zeroed).
        """
        group = self.group
        if not group.requires_grad or not group.has_unreduced_grads:
            return None
        if not any(self._holding_local_grads):   # frozen since these local sums were made: nothing to reduce
            self._drop_unreduced()
            return None
        pack = self.trainable_pack(self._holding_local_grads)   # some frozen since wrapping: the rest only
        full, release_input = self._grad_comm_input(pack)
        work, on_complete = group.levels.issue_reduce(full, release_input, pack, divide_factor)
        group.reduced_this_backward = True
        group.has_unreduced_grads = False
        group.awaiting_replica_reduce = True      # hybrid sharding: the outer average is still to come
        group.grads_ready = [False] * len(group.params)
        return PendingCollective(work, on_complete)

    def _drop_unreduced(self) -> None:
        """Forget local gradients no parameter of the group needs any more (every parameter frozen
        since the accumulation began, runtime/requires_grad_sync.py). Their ``.grad`` stays None; ZeRO-1
        puts back the mean an earlier backward of the step left in its region."""
        group = self.group
        group.unreduced_grads.clear()
        if group.stashed_mean is not None:
            start, end = group.layout.shard_range(group.comm.rank)
            with torch.no_grad():
                group.full_grad[start:end].copy_(group.stashed_mean)
            group.release_stashed_mean()
            group.own_region_holds_mean = True
        group.has_unreduced_grads = False
        group.grads_ready = [False] * len(group.params)

    def all_reduce_grads(self, full: torch.Tensor, release_input, pack: Optional[TrainablePack],
                          divide_factor: float):
        """DDP: every rank gets the whole mean in ``full_grad``."""
        group = self.group
        work = group.comm.all_reduce(full, async_op=True, label=f"grads of {group.name}")

        def on_complete():
            with torch.no_grad():
                if pack is not None:                # frozen ranges: zeros, as nobody reads them
                    group.full_grad.zero_()
                    pack.scatter_own(full, group.full_grad)
                elif full is not group.full_grad:
                    group.full_grad.copy_(full)
                release_input()
                if divide_factor != 1:
                    group.full_grad.div_(divide_factor)
                if group.offloaded is not None:
                    group.offloaded.land_grads(group.full_grad, 1.0, overwrite=True)
        return work, on_complete

    def reduce_scatter_grads(self, full: torch.Tensor, release_input, pack: Optional[TrainablePack],
                              divide_factor: float):
        """ZeRO-1/2/3: this rank's shard of the mean (``pack``: its trainable rows, packed)."""
        group = self.group
        # ZeRO-2/3 with no reduced gradients yet (the first backward after zero_grad freed
        # them): reduce straight into a new grad shard instead of a temporary beside it.
        into_shard = (group.strategy.grads_sharded and group.grads.live() is None and pack is None
                      and group.dtypes.grad == full.dtype and group.offloaded is None)
        # ZeRO-1 reducing its own buffer (_grad_comm_input gave full_grad itself): in place, into this
        # rank's region of it (NCCL's in-place reduce-scatter: the output is the input's slice at rank * shard)
        in_place = full is group.full_grad and group.stashed_mean is None and group.offloaded is None
        if in_place:
            start, end = group.layout.shard_range(group.comm.rank)
            shard_out = full[start:end]
        else:    # (a new buffer is left uninitialized: the reduce-scatter writes every element of it)
            shard_out = (group.ensure_grads(zeroed=False) if into_shard else torch.empty(
                group.layout.shard_numel if pack is None else pack.chunk, dtype=full.dtype, device=group.device))
        work = group.comm.reduce_scatter(shard_out, full, async_op=True, label=f"grads of {group.name}",
                                        splits=None if pack is None else pack.splits)

        def on_complete():
            with torch.no_grad():
                release_input()
                if pack is not None and group.strategy.grads_sharded and group.offloaded is None:
                    # added straight into this rank's rows (0 + x * (1 / f): as into_shard gives it)
                    pack.scatter_own(shard_out, group.ensure_grads(), add=True, alpha=1.0 / divide_factor)
                elif into_shard:                    # as the add in _land_shard would give it: x * (1 / f)
                    if divide_factor != 1:          # one rank (or a sum asked for): x * 1 is x, no pass over it
                        shard_out.mul_(1.0 / divide_factor)
                elif in_place:
                    self._settle_own_region(divide_factor)
                else:
                    self._land_shard(shard_out if pack is None else self._unpacked(pack, shard_out), divide_factor)
        return work, on_complete

    def _land_shard(self, shard_out: torch.Tensor, divide_factor: float) -> None:
        """Store a reduce-scatter's shard-size result (ZeRO-2/3: added; ZeRO-1: its region of
        ``full_grad``; offloaded groups: on the host)."""
        group = self.group
        if group.offloaded is not None and group.strategy.grads_sharded:
            group.offloaded.land_grads(shard_out, 1.0 / divide_factor, overwrite=False)
        elif group.strategy.grads_sharded:
            shard = group.ensure_grads()
            shard.add_(shard_out.to(shard.dtype), alpha=1.0 / divide_factor)
        else:
            own = self._zero_other_regions()
            if group.stashed_mean is None:
                own.copy_(shard_out)
                if divide_factor != 1:
                    own.div_(divide_factor)
            else:
                own.copy_(group.stashed_mean).add_(shard_out, alpha=1.0 / divide_factor)
                group.release_stashed_mean()
            group.own_region_holds_mean = True
            if group.offloaded is not None:
                group.offloaded.land_grads(own, 1.0, overwrite=True)

    def _settle_own_region(self, divide_factor: float) -> None:
        """ZeRO-1 after an in-place reduce-scatter: this rank's region holds the sum; make it the mean."""
        own = self._zero_other_regions()
        if divide_factor != 1:
            own.div_(divide_factor)
        self.group.own_region_holds_mean = True

    def _zero_other_regions(self) -> torch.Tensor:
        """ZeRO-1: zero the other ranks' regions of ``full_grad`` and return this rank's.

        They hold this rank's unreduced sums, which nobody reads; zeroed, an optimizer that zeroes
        only its own .grad views (zero_grad(set_to_none=False)) starts the next step from a clean
        buffer."""
        group = self.group
        start, end = group.layout.shard_range(group.comm.rank)
        group.full_grad[:start].zero_()
        group.full_grad[end:].zero_()
        return group.full_grad[start:end]

    def reduce_across_replicas(self, replicas) -> None:
        """Hybrid sharding: average the reduced gradients across the replicas of this rank's shard,
        if a reduce landed since the last average (levels.py, comm/replicas.py)."""
        group = self.group
        if not group.awaiting_replica_reduce:
            return
        group.awaiting_replica_reduce = False
        group.levels.average_across_replicas(replicas)

    def finish_grad_reduce(self, pending: PendingCollective) -> None:
        """Wait for a reduce ``reduce_grad`` issued and store its result."""
        wait_pending(pending)

    @property
    def _holding_local_grads(self) -> list:
        """Per parameter, whether it may hold local gradients this reduce must take: DDP / ZeRO-1
        accumulate over the step (``reduced``: trainable at any forward since the accumulation
        began, runtime/requires_grad_sync.py); ZeRO-2/3 reduce every micro-batch, so only what this
        backward trained holds any (an earlier micro-batch's gradients are in the shard already)."""
        group = self.group
        return group.trainable if group.strategy.reduce_every_microbatch else group.reduced

    def trainable_pack(self, mask: Sequence[bool]) -> Optional[TrainablePack]:
        """Where the parameters ``mask`` selects go in a packed reduce, or None: reduce the whole
        buffer (every parameter selected, or HFSDP) ([Note: reducing what requires grad])."""
        group = self.group
        if not group.levels.packs_trainable or all(mask):
            return None
        return trainable_pack(group.layout, tuple(mask), group.strategy.grad_reduce_op == "reduce_scatter",
                              group.comm.rank)

    def _unpacked(self, pack: TrainablePack, received: torch.Tensor) -> torch.Tensor:
        """A shard-size tensor holding a packed reduce-scatter's result at this rank's rows."""
        group = self.group
        shard = torch.zeros(group.layout.shard_numel, dtype=received.dtype, device=group.device)
        pack.scatter_own(received, shard)
        return shard

    def _grad_comm_input(self, pack: Optional[TrainablePack] = None):
        """The buffer to reduce, in ``grad_comm`` dtype, and how to release it afterwards: the whole
        group, or (``pack``) its trainable part packed.

        ZeRO-2/3's held gradients, DDP/ZeRO-1's buffer when it needs a dtype cast or a pack, are
        copied into a buffer from the allocator (key ``comm_grad``), so it is counted and bounded."""
        group = self.group
        comm_dtype = group.dtypes.grad_comm
        if not group.strategy.grads_sharded and group.full_grad.dtype == comm_dtype and pack is None:
            return group.full_grad, lambda: None
        numel = group.layout.total_numel if pack is None else pack.numel
        flat = group.allocator.allocate(group.comm_key, numel, comm_dtype, group.device)
        if pack is not None and group.strategy.grads_sharded:
            group.unreduced_grads.write_packed(flat, pack.moves)
        elif pack is not None:
            pack.pack_flat(flat, group.full_grad, group.layout)
        elif group.strategy.grads_sharded:
            group.unreduced_grads.write_into(flat, group.layout)
        else:
            with torch.no_grad():
                flat.copy_(group.full_grad)
        return flat, lambda: group.allocator.free(group.comm_key)
