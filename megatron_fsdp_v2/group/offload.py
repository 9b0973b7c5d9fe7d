"""A ParamGroup's offloaded part ([Note: offload by fraction], offload/host_link.py): moving its main
shard to the host, feeding the weight gathers from it and landing reduced gradients there. A part
the group holds (``group.offloading``), apart from param_group.py, which is the group's buffers on
the device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..comm import PendingCollective
from .grad_buffer import GradBuffer
from ..offload.host_link import HostLink, OffloadedGroup
from .part import GroupPart

if TYPE_CHECKING:
    from .param_group import ParamGroup

__all__ = ["GroupOffload"]


class GroupOffload(GroupPart):
    """A part of ParamGroup (its ``offloading``); reads the group's buffers, layout and strategy.
    ``group.offloaded`` (None: on the device) is declared and first set by ParamGroup, like
    everything a group holds."""

    def offload_main(self, link: HostLink) -> None:
        """Keep this group's main shard (and so the optimizer state made from its main parameters)
        in host memory. Callable before an optimizer holds the main parameters: those already
        made are re-pointed in place (``.data``), so references to them stay valid. Called from
        ParamGroup._init_buffers (``grads`` and ``compute_weights_are_main_weights`` already set)
        or later by ``set_offload``."""
        group = self.group
        if group.offloaded is not None:
            return
        device_main = group.main_shard
        group.main.point_at(link.host_copy(device_main))
        group.main_in_segment = False
        grad_numel = (group.layout.shard_numel if group.strategy.optim_sharded else group.layout.total_numel)
        group.offloaded = OffloadedGroup(link, grad_numel if group.requires_grad else 0, group.dtypes.grad,
                                        group.layout.shard_numel if group.strategy.weights_sharded else 0,
                                        group.dtypes.compute)
        if group.strategy.grads_sharded:
            # reduced gradients live on the host from now on: no device shard (one made at
            # construction, before a later set_offload, is dropped)
            persistent = group.grads.persistent
            group.grads = GradBuffer(group.grads.numel, group.grads.dtype, group.device)
            group.grads.persistent = persistent
        if group.compute_weights_are_main_weights:
            # DDP without a cast: the device buffer the module's parameters view stays, as the
            # compute weights; the main weights are the host copy from now on
            group.compute_weights_are_main_weights = False
            group.model_weights = device_main

    def write_own_slot(self, slot: torch.Tensor) -> None:
        """Put this rank's main shard, in the compute dtype, into ``slot`` (device) before a gather."""
        group = self.group
        offloaded = group.offloaded
        if offloaded is None:
            slot.copy_(group.main_shard)
            return
        if not group.strategy.weights_sharded:            # ZeRO-1/2: straight into the replicated weights
            offloaded.upload(group.main_shard, slot, self._version_now())
        elif offloaded.stepped_early:                    # host and device hold next step's weights already
            raise RuntimeError(
                f"offload: group {group.name} was gathered again in the backward that stepped it "
                "(OffloadPolicy(step_in_backward=True)): a weight of it is used after its gradients "
                "were complete; use step_in_backward=False for this model.")
        elif offloaded.uploaded_version is None or offloaded.uploaded_version != self._version_now():
            self.start_upload()                          # changed since the post-step upload (a load)
        offloaded.wait_upload()
        if group.strategy.weights_sharded:
            slot.copy_(offloaded.compute_shard)
            offloaded.after_gather()

    def _version_now(self) -> Optional[int]:
        """``main.version()``, or None while the main parameters are being made (construction)."""
        group = self.group
        return group.main.version() if group.main_params is not None else None

    def start_upload(self, after=None) -> None:
        """ZeRO-3: start the copy of the host main shard to the device compute-weight shard (right
        after an optimizer step); the next gather of this group waits for it on the device.
        ``after``: an event of the compute stream the copy waits for instead of all its work so
        far (an upload started on the host thread that stepped the group during backward)."""
        group = self.group
        if group.offloaded is not None and group.strategy.weights_sharded:
            shard = group.offloaded.device_compute_shard(for_thread_upload=after is not None)
            group.offloaded.upload(group.main_shard, shard, self._version_now(), after)

    @property
    def uploads_when_stepped_in_backward(self) -> bool:
        """ZeRO-3 (flat): a group stepped during backward is gathered no more before the next
        forward, so its new weights can go up at once, behind the rest of backward, instead of
        after ``optimizer.step()`` (backward_steps.py). With ``release_after_gather`` too: a non-root
        unit's shard then comes back as the backward frees activations, past the peak at its start;
        the root's (released at the start of backward, where the peak is) goes up after the step."""
        group = self.group
        offloaded = group.offloaded
        return (offloaded is not None and not group.keeps_compute_weights
                and not offloaded.release_after_backward_gather)

    def after_backward_gather(self) -> None:
        """The root's gather at the start of backward read its compute shards: with
        ``release_after_gather`` they go (host_link.py, ``release_shards_after_gathers``)."""
        group = self.group
        if group.offloaded is not None and group.strategy.weights_sharded:
            group.offloaded.after_gather(in_backward=True)

    def prefetch_upload(self) -> None:
        """ZeRO-3, ``release_after_gather``: copy a released compute shard back ahead of its gather."""
        offloaded = self.group.offloaded
        if offloaded is not None and offloaded.release_after_gather and offloaded.compute_shard is None:
            self.start_upload()

    def refresh_whole_weights(self) -> None:
        """DDP: the compute weights from the main weights (a cast, or from the host: an upload the
        unit's forward waits for)."""
        group = self.group
        if group.offloaded is None:
            with torch.no_grad():
                group.model_weights.copy_(group.main_shard)
            return
        group.offloaded.upload(group.main_shard, group.model_weights, self._version_now())
        group.pending_refresh = PendingCollective(None, group.offloaded.wait_upload)

    def host_bytes(self) -> dict:
        """Bytes this group keeps in host memory (offloaded groups only); ``host_grad_staging``: ZeRO-2/3's
        buffer for a later micro-batch's landing, made at the first such landing and kept."""
        group = self.group
        if group.offloaded is None:
            return {}
        def nbytes(t):
            return t.numel() * t.element_size()
        out = {"host_main_weights": nbytes(group.main_shard), "host_grads": nbytes(group.offloaded.grad)}
        staging = group.offloaded.grad_staging
        if staging is not None:               # gradient accumulation: a later landing's values
            out["host_grad_staging"] = nbytes(staging)
        return out
