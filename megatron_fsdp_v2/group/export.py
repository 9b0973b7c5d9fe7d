"""What a ParamGroup reports and exports between steps: its persistent bytes and its whole main
weights and gradients gathered on every rank (checkpoints, summon_full_params, tests). Apart from
param_group.py, which is the group's buffers and the schedule's verbs on them."""

from __future__ import annotations

from typing import Optional

import torch

from .shard_order import natural_from_gathered

__all__ = ["GroupExport"]


class GroupExport:
    """Mixed into ParamGroup; reads its buffers, layout, strategy and communicator."""

    def persistent_bytes(self) -> dict:
        """Bytes this rank keeps between steps, by role (temporaries excluded)."""
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        model = 0 if (self.strategy.weights_sharded or self.compute_weights_are_main_weights) else nbytes(self.model_weights)
        model += nbytes(self.inner_weights)
        offloaded = self.offloaded is not None            # its main shard is host memory (offload/host_link.py)
        if offloaded:
            model += nbytes(self.offloaded.compute_shard)
        return {"main_weights": 0 if offloaded else nbytes(self.main_shard), "model_weights": model,
                "grads": nbytes(self.full_grad) + nbytes(self.grad_shard), **self.host_bytes()}

    def gather_full_main(self) -> torch.Tensor:
        """The whole main-weight buffer on every rank (one all-gather when sharded)."""
        main = self.main_shard.detach()
        if not self.strategy.optim_sharded:
            return main.to(self.device, copy=True)
        full = torch.empty(self.layout.total_numel, dtype=self.main_shard.dtype, device=self.device)
        self.comm.all_gather(full, main.to(self.device), label=f"main weights of {self.name}")
        return self._natural(full)

    def gather_full_grad(self) -> Optional[torch.Tensor]:
        """The whole reduced-gradient buffer on every rank (None for a frozen group)."""
        if not self.requires_grad:
            return None
        if self.offloaded is not None:      # the host copy, this rank's rows already (offload/host_link.py)
            buffer = self.main_grad_buffer().to(self.device)
        else:
            buffer = self._ensure_grads()   # every rank joins the gather, also one whose buffer was freed
            if self.strategy.optim_sharded and not self.strategy.grads_sharded:
                buffer = buffer[self.shard_start:self.shard_end]
        if not self.strategy.optim_sharded:
            return buffer.detach().clone()
        full = torch.empty(self.layout.total_numel, dtype=buffer.dtype, device=self.device)
        self.comm.all_gather(full, buffer.detach().contiguous(), label=f"main grads of {self.name}")
        return self._natural(full)

    def _natural(self, gathered: torch.Tensor) -> torch.Tensor:
        """A gathered buffer in natural order (per-parameter shards gather rank-major: shard_order.py)."""
        if not self.layout.per_parameter:
            return gathered
        natural = torch.empty_like(gathered)
        natural_from_gathered(gathered, self.layout, natural)
        return natural

    def full_param(self, full_main: torch.Tensor, index: int) -> torch.Tensor:
        start, end = self.layout.param_range(index)
        return full_main[start:end].view(self.shapes[index])
