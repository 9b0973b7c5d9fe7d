"""How one rank's piece of a flat-sharded tensor looks to torch.distributed.checkpoint (DCP). Pure
torch: no engine here. (Reading DCP files safely: safe_reader.py; checksums: integrity.py.)

[Note: flat ranges as DCP chunks]
A rank's main-weight shard of a parameter is a contiguous range of the parameter's row-major
flattening that need not start or end on a row (group/layout.py never pads rows), so neither
``DTensor(Shard(0))`` (torch.chunk-sized pieces) nor one rectangle per rank describes it.
``FlatRangeShard`` does: it cuts the range into at most ``2 * ndim - 1`` boxes and declares each
box to DCP as one chunk of the full tensor (DCP's ``_Checkpointable`` protocol)::

    param (3, 5), this rank owns flat [3, 12):   row 0: . . . # #   box offsets (0, 3) sizes (1, 2)
                                                 row 1: # # # # #   box offsets (1, 0) sizes (1, 5)
                                                 row 2: # # . . .   box offsets (2, 0) sizes (1, 2)

Each rank writes only its boxes; nobody gathers. A load at another dp size or strategy declares
other boxes and DCP reads the overlapping parts of the saved ones (resharding).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["FlatRangeShard", "flat_range_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offsets, sizes) inside the full tensor


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The boxes, in order, that tile elements ``[start, end)`` of a row-major tensor of ``shape``:
    a partial first row, whole rows, a partial last row, each partial row split the same way."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])

    def within_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    boxes: list[Box] = []
    if start % inner:
        row = start // inner
        stop = min(end, (row + 1) * inner)
        boxes += within_row(row, start - row * inner, stop - row * inner)
        start = stop
    if end - start >= inner:
        first, last = start // inner, end // inner
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
        start = last * inner
    if start < end:
        boxes += within_row(start // inner, 0, end - start)
    return boxes


class FlatRangeShard(torch.Tensor):
    """A tensor of the full ``shape`` of which this rank holds flattened elements
    ``[flat_start, flat_start + local_flat.numel())`` as the 1-D ``local_flat`` (usually a view of
    the main weights or of optimizer state, so ``dcp.load`` fills them in place). It exists to be
    checkpointed: detach/clone/to act on ``local_flat``; any other op raises."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, local_flat: torch.Tensor, flat_start: int):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=local_flat.dtype,
                                                   device=local_flat.device, requires_grad=False)

    def __init__(self, shape, local_flat: torch.Tensor, flat_start: int) -> None:
        if local_flat.dim() != 1:
            raise ValueError(f"local_flat must be 1-D, got shape {tuple(local_flat.shape)}.")
        self.local_flat = local_flat
        self.flat_start = flat_start
        self.flat_end = flat_start + local_flat.numel()
        self.boxes = flat_range_boxes(tuple(shape), flat_start, self.flat_end)

    def pieces(self):
        """(offsets, sizes, view of local_flat) for each box, in flat order."""
        position = 0
        for offsets, sizes in self.boxes:
            numel = math.prod(sizes)
            yield torch.Size(offsets), torch.Size(sizes), self.local_flat[position:position + numel].view(sizes)
            position += numel

    # DCP's _Checkpointable protocol: what this rank writes, which chunks it reads, where they live.
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), properties, self.shape))
                for offsets, sizes, _ in self.pieces()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, sizes) for offsets, sizes, _ in self.pieces()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, _, piece in self.pieces():
            if offsets == index.offset:
                return piece
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {index.offset}; its boxes are {self.boxes}.")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _LOCAL_OPS:
            self = args[0]
            return FlatRangeShard(self.shape, func(self.local_flat, *args[1:], **(kwargs or {})), self.flat_start)
        raise TypeError(f"FlatRangeShard (one rank's range of a sharded tensor, for checkpoints) does not support "
                        f"{func}; use .local_flat, or model.full_state_dict() for full tensors.")

    def __reduce_ex__(self, proto):
        """``torch.save``: the shape, this rank's elements and where they start (a wrapper has no
        storage of its own to pickle)."""
        return (FlatRangeShard, (tuple(self.shape), self.local_flat, self.flat_start))

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"FlatRangeShard(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"flat range [{self.flat_start}, {self.flat_end}))")


_LOCAL_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default,
              torch.ops.aten._to_copy.default}

# ``torch.load`` with its default ``weights_only=True`` rebuilds a ``torch.save``d per-rank state dict
# (``FlatRangeShard.__reduce_ex__``): the class only wraps a tensor and two numbers, nothing runs.
torch.serialization.add_safe_globals([FlatRangeShard])
