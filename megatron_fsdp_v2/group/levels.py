"""A ParamGroup's levels of data-parallel ranks: one object per kind, with its own weight gather,
gradient reduce and average across replicas, so the group never branches on which it has.

* ``OneLevel``: the main weights are sharded over the group's ``comm`` (flat ZeRO); replicas of
  the shard, if any (HSDP), average their reduced gradients once they are final.
* ``TwoLevels``: HFSDP ([Note: sharding across replicas (HFSDP)], comm/replicas.py): main weights
  are sharded over the world (``comm``) while compute weights move only inside the inner group;
  gathers and reduces run block by block, the outer group refreshes the inner shard after a step and
  reduces the inner gradient shard once per step.

A part of ParamGroup (its ``levels``), as FSDP2's ``FSDPParamGroup`` holds its mesh info.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..comm import PendingCollective, wait_pending
from ..comm.replicas import HybridLevels, gather_blocks, reduce_blocks
from .part import GroupPart

if TYPE_CHECKING:
    from .param_group import ParamGroup
    from .trainable_pack import TrainablePack

__all__ = ["OneLevel", "TwoLevels", "group_levels"]


class OneLevel(GroupPart):
    """Flat sharding over the group's ``comm`` (or no sharding)."""

    allows_per_parameter_shards = True           # the layout may shard each parameter by rows (strategy.py)
    keeps_inner_shard = False                    # no persistent inner shard of compute weights
    packs_trainable = True                       # a partly frozen group reduces its trainable part only
    inner_weights: Optional[torch.Tensor] = None  # (TwoLevels only)
    inner_grad: Optional[torch.Tensor] = None     # (TwoLevels only)

    @property
    def gather_size(self) -> int:
        """Ranks a ZeRO-3 weight gather reads from."""
        return self.group.comm.size

    def make_inner_shard(self) -> None:
        """ZeRO-3 at wrapping: nothing is kept between uses."""

    def refresh_inner_shard(self, async_op: bool) -> None:
        """ZeRO-3 after a step: nothing to refresh; the next gather reads the main shard."""

    def before_unshard(self) -> None:
        """Nothing to wait for: the gather reads the main shard the optimizer wrote."""

    def gather_into(self, full: torch.Tensor, async_op: bool) -> PendingCollective:
        """All-gather every rank's main shard into ``full`` (one collective over ``comm``)."""
        group = self.group
        return group.gather_own_slot(group.comm, full, async_op, f"weights of {group.name}")

    def issue_reduce(self, full: torch.Tensor, release_input: Callable[[], None], pack: Optional["TrainablePack"],
                     divide_factor: float):
        """``(work, on_complete)`` of this micro-batch's reduce over ``comm``, by the strategy's op."""
        reducer = self.group.reducer
        if self.group.strategy.grad_reduce_op == "all_reduce":
            return reducer.all_reduce_grads(full, release_input, pack, divide_factor)
        return reducer.reduce_scatter_grads(full, release_input, pack, divide_factor)

    def average_across_replicas(self, replicas) -> None:
        """HSDP: all-reduce the reduced gradients this rank holds (its shard; DDP: all; a partly
        frozen group: its trainable part) over the replicas of its shard, then divide."""
        group = self.group
        buffer, pack = group.main_grad_buffer(), group.reducer.trainable_pack(group.reduced)  # every gradient held
        if buffer is None or replicas.size == 1:
            return
        moved = buffer if pack is None else pack.gather_own(buffer, buffer.new_empty(pack.chunk))
        replicas.all_reduce(moved, label=f"grads of {group.name} across replicas")
        with torch.no_grad():
            moved.div_(replicas.size)
        if pack is not None:
            pack.scatter_own(moved, buffer)


class TwoLevels(OneLevel):
    """HFSDP: (inner, outer) Communicators; the group's ``comm`` is the whole data-parallel world."""

    communicators: HybridLevels                  # (inner, outer)
    allows_per_parameter_shards = False          # blocks of row-snapped world shards (comm/replicas.py)
    keeps_inner_shard = True                     # ZeRO-3: the inner shard of compute weights, refreshed after a step
    packs_trainable = False                      # the reduce runs block by block over the whole buffer

    def __init__(self, group: "ParamGroup", communicators: HybridLevels) -> None:
        super().__init__(group)
        self.communicators = communicators
        self.inner_weights = None                # ZeRO-3: this rank's inner shard of the compute weights
        self.inner_grad = None                   # inner-reduced grads awaiting the outer reduce

    @property
    def gather_size(self) -> int:
        return self.communicators.inner.size

    def make_inner_shard(self) -> None:
        """ZeRO-3 at wrapping: the persistent inner shard, filled from the main weights."""
        group = self.group
        self.inner_weights = torch.empty(group.layout.shard_numel * self.communicators.outer.size,
                                         dtype=group.dtypes.compute, device=group.device)
        group.rebuild_compute_weights(async_op=False)

    def refresh_inner_shard(self, async_op: bool) -> None:
        """ZeRO-3 after a step: the inner shard from the replicas' updated world shards (one outer
        all-gather), owned by the group as its refresh in flight."""
        group = self.group
        group.wait_refresh()
        group.pending_refresh = self._gather_across_replicas(self.inner_weights, async_op)

    def before_unshard(self) -> None:
        """The inner shard must hold the last step's weights before a unit gathers from it."""
        self.group.wait_refresh()

    def _gather_across_replicas(self, inner_shard: torch.Tensor, async_op: bool) -> PendingCollective:
        group = self.group
        return group.gather_own_slot(self.communicators.outer, inner_shard, async_op,
                                     f"weights of {group.name} across replicas")

    def gather_into(self, full: torch.Tensor, async_op: bool) -> PendingCollective:
        """``full`` from the inner shards, block by block over the inner group (ZeRO-3: the
        persistent inner shard; ZeRO-2: a temporary one gathered across replicas first)."""
        group = self.group
        inner, outer = self.communicators
        source, release = self.inner_weights, (lambda: None)
        if source is None:
            key = (group.name, "inner_weights")
            source = group.allocator.allocate(key, group.layout.shard_numel * outer.size, group.dtypes.compute,
                                              group.device)
            wait_pending(self._gather_across_replicas(source, async_op=False))
            release = lambda: group.allocator.free(key)          # noqa: E731
        works = gather_blocks(inner, full, source, group.layout.shard_numel, outer.size, async_op,
                              f"weights of {group.name}")
        if not async_op:
            release()
            return PendingCollective(None, lambda: None)
        return PendingCollective(works, release)

    def issue_reduce(self, full: torch.Tensor, release_input: Callable[[], None], pack, divide_factor: float):
        """N_out inner reduce-scatters, added (divided) into the inner gradient shard."""
        group = self.group
        inner, outer = self.communicators
        inner_out = torch.empty(group.layout.shard_numel * outer.size, dtype=full.dtype, device=group.device)
        works = reduce_blocks(inner, inner_out, full, group.layout.shard_numel, outer.size, f"grads of {group.name}")

        def on_complete():
            with torch.no_grad():
                release_input()
                if not group.strategy.grads_sharded:
                    group.full_grad.zero_()          # ZeRO-1: its local sums moved into the inner shard
                if self.inner_grad is None:
                    self.inner_grad = torch.zeros(inner_out.numel(), dtype=group.dtypes.grad, device=group.device)
                self.inner_grad.add_(inner_out.to(self.inner_grad.dtype), alpha=1.0 / divide_factor)
        return works, on_complete

    def average_across_replicas(self, replicas) -> None:
        """One outer reduce-scatter of the inner gradient shard leaves this rank its world shard."""
        group = self.group
        inner_grad, self.inner_grad = self.inner_grad, None
        if inner_grad is None:
            return
        out = torch.empty(group.layout.shard_numel, dtype=inner_grad.dtype, device=group.device)
        replicas.reduce_scatter(out, inner_grad, label=f"grads of {group.name} across replicas")
        with torch.no_grad():
            target = group.ensure_grads()
            if not group.strategy.grads_sharded:      # ZeRO-1: this rank's world shard of full_grad
                target = target[group.shard_start:group.shard_end]
            target.add_(out, alpha=1.0 / replicas.size)
            if group.stashed_mean is not None:        # the mean of an earlier backward of this step
                target.add_(group.stashed_mean)
                group.release_stashed_mean()
            group.own_region_holds_mean = not group.strategy.grads_sharded


def group_levels(group: "ParamGroup", communicators: Optional[HybridLevels]) -> OneLevel:
    """The group's levels part: HFSDP's two when given (inner, outer), else one."""
    return OneLevel(group) if communicators is None else TwoLevels(group, communicators)
