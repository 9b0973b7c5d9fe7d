"""What a ParamGroup reports and exports between steps: its persistent bytes and its whole main
weights and gradients gathered on every rank (checkpoints, summon_full_params, tests). Apart from
param_group.py, which is the group's buffers and the schedule's verbs on them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .shard_order import natural_from_gathered
from .part import GroupPart

if TYPE_CHECKING:
    from .param_group import ParamGroup

__all__ = ["GroupExport"]


class GroupExport(GroupPart):
    """A part of ParamGroup (its ``exporter``); reads the group's buffers, layout, strategy and communicator."""

    def persistent_bytes(self) -> dict:
        """Bytes this rank keeps between steps, by role (temporaries excluded)."""
        group = self.group
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        replicated_apart = not (group.strategy.weights_sharded or group.compute_weights_are_main_weights)
        model = nbytes(group.model_weights) if replicated_apart else 0
        model += nbytes(group.levels.inner_weights)
        offloaded = group.offloaded is not None            # its main shard is host memory (offload/host_link.py)
        if offloaded:
            model += nbytes(group.offloaded.compute_shard)
        return {"main_weights": 0 if offloaded else nbytes(group.main_shard), "model_weights": model,
                "grads": nbytes(group.full_grad) + nbytes(group.grad_shard), **group.offloading.host_bytes()}

    def gather_full_main(self) -> torch.Tensor:
        """The whole main-weight buffer on every rank (one all-gather when sharded)."""
        group = self.group
        main = group.main_shard.detach()
        if not group.strategy.optim_sharded:
            return main.to(group.device, copy=True)
        full = torch.empty(group.layout.total_numel, dtype=group.main_shard.dtype, device=group.device)
        group.comm.all_gather(full, main.to(group.device), label=f"main weights of {group.name}")
        return self._natural(full)

    def gather_full_grad(self) -> Optional[torch.Tensor]:
        """The whole reduced-gradient buffer on every rank (None for a frozen group)."""
        group = self.group
        if not group.requires_grad:
            return None
        if group.offloaded is not None:      # the host copy, this rank's rows already (offload/host_link.py)
            buffer = group.main_grad_buffer().to(group.device)
        else:
            buffer = group.ensure_grads()   # every rank joins the gather, also one whose buffer was freed
            if group.strategy.optim_sharded and not group.strategy.grads_sharded:
                buffer = buffer[group.shard_start:group.shard_end]
        if not group.strategy.optim_sharded:
            return buffer.detach().clone()
        full = torch.empty(group.layout.total_numel, dtype=buffer.dtype, device=group.device)
        group.comm.all_gather(full, buffer.detach().contiguous(), label=f"main grads of {group.name}")
        return self._natural(full)

    def _natural(self, gathered: torch.Tensor) -> torch.Tensor:
        """A gathered buffer in natural order (per-parameter shards gather rank-major: shard_order.py)."""
        group = self.group
        if not group.layout.per_parameter:
            return gathered
        natural = torch.empty_like(gathered)
        natural_from_gathered(gathered, group.layout, natural)
        return natural

    def full_param(self, full_main: torch.Tensor, index: int) -> torch.Tensor:
        group = self.group
        start, end = group.layout.param_range(index)
        return full_main[start:end].view(group.shapes[index])
