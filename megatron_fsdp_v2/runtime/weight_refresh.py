"""Compute weights after the main weights changed (an optimizer step, a load): which groups rebuild
them, when, and ZeRO-3's offloaded uploads. Fused optimizer kernels update in place without bumping
version counters, so a group an optimizer steps is marked as well as version-checked.
"""

from __future__ import annotations

from typing import Optional

from ..group.param_group import ParamGroup
from ..strategy import ShardingStrategy

__all__ = ["WeightRefresh"]


class WeightRefresh:
    """The engine's part that refreshes compute weights from main weights (its ``weights``)."""

    groups: list[ParamGroup]
    strategy: ShardingStrategy
    _synced_version: dict                 # id(group) -> main.version() its compute weights were built from
    _dirty: set                           # ids of groups whose main weights an optimizer is stepping
    _gathers_at_use: bool                 # flat ZeRO-3: no group keeps compute weights between steps

    def __init__(self, groups: list[ParamGroup], strategy: ShardingStrategy) -> None:
        self.groups = groups
        self.strategy = strategy
        self._synced_version = {id(g): g.main.version() for g in groups}
        self._dirty = set()
        self._gathers_at_use = strategy.weights_sharded and not any(g.keeps_compute_weights for g in groups)

    def mark_changed(self, param_ids: Optional[set] = None) -> None:
        """The main weights (those in ``param_ids``, default all) are about to change (optimizer
        step, load): refresh their groups at the next ``refresh``.

        Version counters alone are not enough: fused optimizer kernels (``AdamW(fused=True)``)
        update parameters in place without bumping them. A ZeRO-3 group still gathered since a
        forward no backward followed (``reshard_after_forward`` kept it) holds the old weights: it
        gives them back, so its next use gathers the new ones."""
        for group in self.groups:
            if param_ids is None or any(id(m) in param_ids for m in group.main_params):
                self._dirty.add(id(group))
                group.reshard()                  # (a no-op unless ZeRO-3 and gathered)

    def reload(self) -> None:
        """The main weights were written outside an optimizer step (a load, a broadcast, a
        write-back): every group's compute weights follow now."""
        self.mark_changed()
        self.refresh(wait=True)

    def refresh(self, wait: bool = False, before_forward: bool = False) -> None:
        """Rebuild replicated compute weights from main weights that changed (ZeRO-1/2: one async
        all-gather per group; DDP with mixed precision: a local cast). ZeRO-3 gathers at use.
        Groups whose parameters gather themselves refresh only ``before_forward`` (or when told to
        ``wait``), as FSDP2 gathers them: a scale stored on them after ``optimizer.step()`` is then
        the one used.

        A group stepped by two optimizers before the next forward is refreshed after each; the
        second refresh waits for the first (``ParamGroup.rebuild_compute_weights``), so the forward never
        sees a stale all-gather land last."""
        if self._gathers_at_use:
            self._start_uploads()
            return                               # ZeRO-3 gathers at use (HFSDP: its inner shards refresh here)
        dirty, self._dirty = self._dirty, set()
        for group in self.groups:
            if group.extension is not None and not (before_forward or wait):
                dirty.discard(id(group))
                self._dirty.add(id(group))
                continue
            version = group.main.version()
            if id(group) in dirty or version != self._synced_version[id(group)]:
                group.rebuild_compute_weights(async_op=True)
                self._synced_version[id(group)] = version
        if wait:
            for group in self.groups:
                group.wait_refresh()

    def _start_uploads(self) -> None:
        """ZeRO-3 with offload: start copying the stepped host main shards to the device now, so the
        next forward's gathers find them there (offload/host_link.py, [Note: offload by fraction])."""
        dirty, self._dirty = self._dirty, set()
        for group in self.groups:
            offloaded = group.offloaded
            if offloaded is not None and (id(group) in dirty or offloaded.uploaded_version != group.main.version()):
                group.offloading.start_upload()
