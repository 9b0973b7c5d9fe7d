"""Rank 0's module buffers on every rank before a forward, as torch DDP's ``broadcast_buffers=True``.

[Note: buffers as DDP]
DDP (``_pre_forward`` / ``_post_forward``, ``will_sync_module_buffers``) broadcasts before a
forward when the forward *before* it ran with grad enabled outside ``no_sync()`` (its
``require_forward_param_sync``, True at the start), whatever the new forward is: so the first
micro-batch under ``no_sync()`` after a synced step broadcasts and the synced one after it does
not; an evaluation forward broadcasts when due and turns the next forward's broadcast off. The
engine keeps that flag (``Engine._buffers_due``). The source is rank 0 (DDP agrees on another rank
only under ``Join``). Like DDP, the overwrite keeps the buffers' version counters, so a buffer saved
for a pending backward (BatchNorm in eval mode) does not fail autograd's in-place check.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

__all__ = ["broadcast_buffers"]


def broadcast_buffers(root: nn.Module, comms: Iterable[Optional[object]]) -> None:
    """Overwrite ``root``'s non-empty buffers with rank 0's over each Communicator of ``comms`` in
    order (the shard group first, then across replicas: the global rank 0's values)."""
    buffers = [b for b in root.buffers() if b.numel()]
    if not buffers:
        return
    with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
        for comm in comms:
            if comm is not None and comm.size > 1:
                comm.broadcast(buffers, src_group_rank=0, label="buffers (broadcast_buffers)")
