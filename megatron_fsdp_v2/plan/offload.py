"""CPU offload in the plan: which groups ``fully_shard(..., offload=OffloadPolicy(fraction=f))``
puts on the host, and what crosses the host link per step.

The choice is offload/policy.py's own (``choose_offloaded`` over ``offload_choice_bytes``: whole groups,
from the last back, by their parameters' main-weight bytes), so it cannot drift from the engine.
Per step and offloaded trainable group ([Note: offload by fraction]):

* ``d2h_grads``: each reduce that lands copies this rank's reduced gradients to the host, in the
  gradient dtype: ZeRO-2/3 every micro-batch (their shard), ZeRO-1 once (its shard), DDP once (all);
* ``h2d_weights``: after the step, the stepped main shard (main dtype) goes back to the device once;
  when the compute dtype differs the cast runs on the device, from a main-dtype copy that lives
  until the copy has run (``upload_transients``: every group's at once, an upper bound, since
  the uploads are issued together after the step). With ``step_in_backward`` ZeRO-3 uploads each
  group from the stepping thread during backward instead, one at a time (``backward_upload_transient``):
  the root's at the end of backward, once the activations are gone, or, with
  ``reduce_root_per_child``, the output layer's at its start (with ``release_after_gather`` the
  root's after the step).
"""

from __future__ import annotations

from typing import Optional

from ..offload.policy import OffloadPolicy, choose_offloaded, offload_choice_bytes
from ..strategy import ShardingStrategy
from .groups import PlannedGroup

__all__ = ["backward_upload_transient", "check_offload", "host_transfers", "offloaded_groups", "upload_transients"]


def check_offload(offload, offload_fractions) -> tuple:
    """The fractions to plan (``None``: no offload), from ``offload`` and ``offload_fractions``."""
    if offload is not None and not isinstance(offload, OffloadPolicy):
        raise TypeError(f"offload must be an OffloadPolicy or None (as fully_shard takes it), got "
                        f"{type(offload).__name__}.")
    if offload_fractions is None:
        return (None if offload is None else offload.fraction,)
    if offload is not None:
        raise ValueError("offload and offload_fractions: give one (offload plans one policy, offload_fractions "
                         "lets the choice try several).")
    fractions = tuple(offload_fractions) if isinstance(offload_fractions, (list, tuple)) else None
    if not fractions:
        raise ValueError(f"offload_fractions must be a non-empty list or tuple of fractions, got {offload_fractions!r}.")
    for f in fractions:
        OffloadPolicy(fraction=f)          # the same check (and message) fully_shard gives
    return tuple(None if f == 0 else float(f) for f in dict.fromkeys(fractions))


def offloaded_groups(groups: list[PlannedGroup], fraction: Optional[float]) -> frozenset:
    """Positions of the groups ``fully_shard`` would offload at ``fraction`` (None: none)."""
    if not fraction:
        return frozenset()
    sizes = [offload_choice_bytes(sum(g.layout.numels), g.dtypes.main) for g in groups]
    return choose_offloaded(sizes, fraction)


def _main_numel(group: PlannedGroup, strategy: ShardingStrategy) -> int:
    return group.layout.shard_numel if strategy.optim_sharded else group.layout.total_numel


def host_transfers(groups: list[PlannedGroup], offloaded: frozenset, strategy: ShardingStrategy,
                   micro_batches: int) -> dict:
    """``{"d2h_grads": {"count", "bytes"}, "h2d_weights": {...}}`` per step for this rank."""
    out = {"d2h_grads": {"count": 0, "bytes": 0}, "h2d_weights": {"count": 0, "bytes": 0}}
    landings = micro_batches if strategy.reduce_every_microbatch else 1
    for index in sorted(offloaded):
        group = groups[index]
        if not group.requires_grad:       # never stepped: its weights are uploaded once, at wrap time
            continue
        numel = _main_numel(group, strategy)
        out["d2h_grads"]["count"] += landings
        out["d2h_grads"]["bytes"] += landings * numel * group.dtypes.grad.itemsize
        out["h2d_weights"]["count"] += 1
        out["h2d_weights"]["bytes"] += numel * group.dtypes.main.itemsize
    return out


def _transient(group: PlannedGroup, strategy: ShardingStrategy) -> int:
    """Device bytes of the main-dtype copy one upload of ``group`` casts from (0 without a cast)."""
    if not group.requires_grad or group.dtypes.compute == group.dtypes.main:
        return 0
    return _main_numel(group, strategy) * group.dtypes.main.itemsize


def upload_transients(groups: list[PlannedGroup], offloaded: frozenset, strategy: ShardingStrategy) -> int:
    """Device bytes of the main-dtype copies the post-step uploads cast from (all at once)."""
    return sum(_transient(groups[i], strategy) for i in offloaded)


def backward_upload_transient(groups: list[PlannedGroup], offloaded: frozenset, strategy: ShardingStrategy,
                              root_groups: int, uploads_in_backward: bool) -> int:
    """ZeRO-3 with ``OffloadPolicy(step_in_backward=True)`` (shards kept): the host thread uploads
    each group it stepped during backward, one copy in flight at a time, so backward holds at most
    the largest such group's main-dtype copy. The first ``root_groups`` are left out: the root's,
    uploaded at the end of backward, when the activations are gone (0 with
    ``reduce_root_per_child``, whose output layer steps and uploads at the start of backward)."""
    if not (uploads_in_backward and strategy.weights_sharded):
        return 0
    return max((_transient(groups[i], strategy) for i in offloaded if i >= root_groups), default=0)
