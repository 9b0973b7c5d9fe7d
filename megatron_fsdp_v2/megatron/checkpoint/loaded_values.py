"""What ``dist_checkpointing.load`` returns for the values we hand it (a ``FlatRangeShard`` becomes
a dict of its boxes), turned back into values of the template's kind; shared by our own layout
(dist_checkpoint.py) and Megatron DistributedOptimizer's (distopt_format.py)."""

from __future__ import annotations

import torch

from ...checkpoint.dcp_format import FlatRangeShard

__all__ = ["from_loaded"]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))[:8]}"
    return type(value).__name__


def from_loaded(key: str, template: torch.Tensor, loaded) -> torch.Tensor:
    """What ``dist_checkpointing.load`` returned for ``to_sharded(key, template)`` -> a value of the
    template's kind (this rank's ``FlatRangeShard``, or a tensor of the template's shape)."""
    if isinstance(template, FlatRangeShard):
        count = len(template.boxes)
        if count == 0:
            local = template.local_flat.new_empty(0)
        elif isinstance(loaded, dict) and all(f"box{i}" in loaded for i in range(count)):
            boxes = [loaded[f"box{i}"] for i in range(count)]
            if all(box.data_ptr() == piece.data_ptr() and box.numel() == piece.numel()
                   for box, (_, _, piece) in zip(boxes, template.pieces())):
                return template     # dist_checkpointing.load filled the template's own views in place
            local = torch.cat([box.reshape(-1) for box in boxes])
        else:
            raise ValueError(f"{key}: expected this rank's {count} boxes {{'box0': tensor, ...}}, as "
                             f"dist_checkpointing.load returns them for sharded_state_dict(), got {_describe(loaded)}.")
        if local.numel() != template.local_flat.numel():
            raise ValueError(f"{key}: the loaded boxes hold {local.numel()} elements, this rank owns "
                             f"{template.local_flat.numel()}; load with this model's own sharded_state_dict().")
        return FlatRangeShard(template.shape, local.to(template.dtype), template.flat_start)
    if isinstance(loaded, torch.Tensor) and loaded.numel() == template.numel():
        return loaded.reshape(template.shape)
    raise ValueError(f"{key}: expected a tensor of shape {tuple(template.shape)}, got {_describe(loaded)}.")
