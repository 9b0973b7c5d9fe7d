"""A ParamGroup's gradient reduce: the collective over the data-parallel group, where its result
lands (per strategy), the packed reduce of a group some of whose parameters were frozen after
wrapping (trainable_pack.py, [Note: reducing what requires grad]) and the average across replicas.
Apart from param_group.py, which holds the buffers and the other verbs on them."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..comm import PendingCollective, wait_pending
from ..comm.replicas import reduce_blocks
from .trainable_pack import TrainablePack, trainable_pack

__all__ = ["GroupReduce"]


class GroupReduce:
    """Mixed into ParamGroup; reads and writes its gradient buffers, layout, strategy and communicator."""

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
        if not self.requires_grad or not self.has_unreduced_grads:
            return None
        if not any(self._holding_local_grads):   # frozen since these local sums were made: nothing to reduce
            self._drop_unreduced()
            return None
        pack = self.trainable_pack(self._holding_local_grads)   # some frozen since wrapping: the rest only
        full, release_input = self._grad_comm_input(pack)
        if self.levels is not None:
            work, on_complete = self._reduce_blocks(full, release_input, divide_factor)
        elif self.strategy.grad_reduce_op == "all_reduce":
            work, on_complete = self._all_reduce_grads(full, release_input, pack, divide_factor)
        else:
            work, on_complete = self._reduce_scatter_grads(full, release_input, pack, divide_factor)
        self.reduced_this_backward = True
        self.has_unreduced_grads = False
        self.awaiting_replica_reduce = True      # hybrid sharding: the outer average is still to come
        self.grads_ready = [False] * len(self.params)
        return PendingCollective(work, on_complete)

    def _drop_unreduced(self) -> None:
        """Forget local gradients no parameter of the group needs any more (every parameter frozen
        since the accumulation began, runtime/requires_grad_sync.py). Their ``.grad`` stays None; ZeRO-1
        puts back the mean an earlier backward of the step left in its region."""
        self._unreduced.clear()
        if self._stash is not None:
            start, end = self.layout.shard_range(self.comm.rank)
            with torch.no_grad():
                self.full_grad[start:end].copy_(self._stash)
            self._release_stash()
            self._own_region_holds_mean = True
        self.has_unreduced_grads = False
        self.grads_ready = [False] * len(self.params)

    def _reduce_blocks(self, full: torch.Tensor, release_input, divide_factor: float):
        """HFSDP: N_out inner reduce-scatters into the inner gradient shard (comm/replicas.py)."""
        inner, outer = self.levels
        inner_out = torch.empty(self.layout.shard_numel * outer.size, dtype=full.dtype, device=self.device)
        works = reduce_blocks(inner, inner_out, full, self.layout.shard_numel, outer.size, f"grads of {self.name}")

        def on_complete():
            with torch.no_grad():
                release_input()
                if not self.strategy.grads_sharded:
                    self.full_grad.zero_()          # ZeRO-1: its local sums moved into the inner shard
                if self._inner_grad is None:
                    self._inner_grad = torch.zeros(inner_out.numel(), dtype=self.dtypes.grad, device=self.device)
                self._inner_grad.add_(inner_out.to(self._inner_grad.dtype), alpha=1.0 / divide_factor)
        return works, on_complete

    def _all_reduce_grads(self, full: torch.Tensor, release_input, pack: Optional[TrainablePack],
                          divide_factor: float):
        """DDP: every rank gets the whole mean in ``full_grad``."""
        work = self.comm.all_reduce(full, async_op=True, label=f"grads of {self.name}")

        def on_complete():
            with torch.no_grad():
                if pack is not None:                # frozen ranges: zeros, as nobody reads them
                    self.full_grad.zero_()
                    pack.scatter_own(full, self.full_grad)
                elif full is not self.full_grad:
                    self.full_grad.copy_(full)
                release_input()
                self.full_grad.div_(divide_factor)
                if self.offloaded is not None:
                    self.offloaded.land_grads(self.full_grad, 1.0, overwrite=True)
        return work, on_complete

    def _reduce_scatter_grads(self, full: torch.Tensor, release_input, pack: Optional[TrainablePack],
                              divide_factor: float):
        """ZeRO-1/2/3: this rank's shard of the mean (``pack``: its trainable rows, packed)."""
        # ZeRO-2/3 with no reduced gradients yet (the first backward after zero_grad freed
        # them): reduce straight into a new grad shard instead of a temporary beside it.
        into_shard = (self.strategy.grads_sharded and self.grads.live() is None and pack is None
                      and self.dtypes.grad == full.dtype and self.offloaded is None)
        shard_out = (self._ensure_grads() if into_shard else torch.empty(
            self.layout.shard_numel if pack is None else pack.chunk, dtype=full.dtype, device=self.device))
        work = self.comm.reduce_scatter(shard_out, full, async_op=True, label=f"grads of {self.name}",
                                        splits=None if pack is None else pack.splits)

        def on_complete():
            with torch.no_grad():
                release_input()
                if pack is not None and self.strategy.grads_sharded and self.offloaded is None:
                    # added straight into this rank's rows (0 + x * (1 / f): as into_shard gives it)
                    pack.scatter_own(shard_out, self._ensure_grads(), add=True, alpha=1.0 / divide_factor)
                elif into_shard:                    # as the add in _land_shard would give it: x * (1 / f)
                    shard_out.mul_(1.0 / divide_factor)
                else:
                    self._land_shard(shard_out if pack is None else self._unpacked(pack, shard_out), divide_factor)
        return work, on_complete

    def _land_shard(self, shard_out: torch.Tensor, divide_factor: float) -> None:
        """Store a reduce-scatter's shard-size result (ZeRO-2/3: added; ZeRO-1: its region of
        ``full_grad``; offloaded groups: on the host)."""
        if self.offloaded is not None and self.strategy.grads_sharded:
            self.offloaded.land_grads(shard_out, 1.0 / divide_factor, overwrite=False)
        elif self.strategy.grads_sharded:
            shard = self._ensure_grads()
            shard.add_(shard_out.to(shard.dtype), alpha=1.0 / divide_factor)
        else:
            # Other ranks' regions hold this rank's unreduced sums, which nobody reads;
            # zero them so an optimizer that zeroes only its own .grad views
            # (zero_grad(set_to_none=False)) starts the next step from a clean buffer.
            start, end = self.layout.shard_range(self.comm.rank)
            self.full_grad[:start].zero_()
            self.full_grad[end:].zero_()
            own = self.full_grad[start:end]
            if self._stash is None:
                own.copy_(shard_out).div_(divide_factor)
            else:
                own.copy_(self._stash).add_(shard_out, alpha=1.0 / divide_factor)
                self._release_stash()
            self._own_region_holds_mean = True
            if self.offloaded is not None:
                self.offloaded.land_grads(own, 1.0, overwrite=True)

    def reduce_across_replicas(self, replicas) -> None:
        """Hybrid sharding: average the reduced gradients this rank holds (its shard; DDP: all;
        only the trainable part of a partly frozen group) across the replicas of its shard, if a
        reduce landed since the last average (comm/replicas.py)."""
        if not self.awaiting_replica_reduce:
            return
        self.awaiting_replica_reduce = False
        if self.levels is not None:
            self._reduce_world_shard(replicas)
            return
        buffer, pack = self.main_grad_buffer(), self.trainable_pack(self.reduced)   # every gradient held
        if buffer is None or replicas.size == 1:
            return
        moved = buffer if pack is None else pack.gather_own(buffer, buffer.new_empty(pack.chunk))
        replicas.all_reduce(moved, label=f"grads of {self.name} across replicas")
        with torch.no_grad():
            moved.div_(replicas.size)
        if pack is not None:
            pack.scatter_own(moved, buffer)

    def _reduce_world_shard(self, replicas) -> None:
        """HFSDP: one outer reduce-scatter to this rank's world shard."""
        inner_grad, self._inner_grad = self._inner_grad, None
        if inner_grad is None:
            return
        out = torch.empty(self.layout.shard_numel, dtype=inner_grad.dtype, device=self.device)
        replicas.reduce_scatter(out, inner_grad, label=f"grads of {self.name} across replicas")
        with torch.no_grad():
            target = self._ensure_grads()
            if not self.strategy.grads_sharded:      # ZeRO-1: this rank's world shard of full_grad
                target = target[self.shard_start:self.shard_end]
            target.add_(out, alpha=1.0 / replicas.size)
            if self._stash is not None:              # the mean of an earlier backward of this step
                target.add_(self._stash)
                self._release_stash()
            self._own_region_holds_mean = not self.strategy.grads_sharded

    def finish_grad_reduce(self, pending: PendingCollective) -> None:
        """Wait for a reduce ``reduce_grad`` issued and store its result."""
        wait_pending(pending)

    @property
    def _holding_local_grads(self) -> list:
        """Per parameter, whether it may hold local gradients this reduce must take: DDP / ZeRO-1
        accumulate over the step (``reduced``: trainable at any forward since the accumulation
        began, runtime/requires_grad_sync.py); ZeRO-2/3 reduce every micro-batch, so only what this
        backward trained holds any (an earlier micro-batch's gradients are in the shard already)."""
        return self.trainable if self.strategy.reduce_every_microbatch else self.reduced

    def trainable_pack(self, mask: Sequence[bool]) -> Optional[TrainablePack]:
        """Where the parameters ``mask`` selects go in a packed reduce, or None: reduce the whole
        buffer (every parameter selected, or HFSDP) ([Note: reducing what requires grad])."""
        if self.levels is not None or all(mask):
            return None
        return trainable_pack(self.layout, tuple(mask), self.strategy.grad_reduce_op == "reduce_scatter",
                              self.comm.rank)

    def _unpacked(self, pack: TrainablePack, received: torch.Tensor) -> torch.Tensor:
        """A shard-size tensor holding a packed reduce-scatter's result at this rank's rows."""
        shard = torch.zeros(self.layout.shard_numel, dtype=received.dtype, device=self.device)
        pack.scatter_own(received, shard)
        return shard

    def _grad_comm_input(self, pack: Optional[TrainablePack] = None):
        """The buffer to reduce, in ``grad_comm`` dtype, and how to release it afterwards: the whole
        group, or (``pack``) its trainable part packed.

        ZeRO-2/3's held gradients, DDP/ZeRO-1's buffer when it needs a dtype cast or a pack, are
        copied into a buffer from the allocator (key ``comm_grad``), so it is counted and bounded."""
        comm_dtype = self.dtypes.grad_comm
        if not self.strategy.grads_sharded and self.full_grad.dtype == comm_dtype and pack is None:
            return self.full_grad, lambda: None
        numel = self.layout.total_numel if pack is None else pack.numel
        flat = self.allocator.allocate(self._comm_key, numel, comm_dtype, self.device)
        if pack is not None and self.strategy.grads_sharded:
            self._unreduced.write_packed(flat, pack.moves)
        elif pack is not None:
            pack.pack_flat(flat, self.full_grad, self.layout)
        elif self.strategy.grads_sharded:
            self._unreduced.write_into(flat, self.layout)
        else:
            with torch.no_grad():
                flat.copy_(self.full_grad)
        return flat, lambda: self.allocator.free(self._comm_key)
