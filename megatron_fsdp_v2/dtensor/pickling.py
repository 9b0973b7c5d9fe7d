"""``torch.save`` of a DTensor whose local piece is a view into a flat buffer.

[Note: pickling a DTensor view]
Every sharded parameter is a plain ``DTensor(Shard(0))`` whose local piece is a view of the group's
flat main-weight buffer (group/param_group.py), usually at a non-zero storage offset. DTensor's wrapper
copies that offset, so ``Tensor.__reduce_ex__`` sees a non-zero ``data_ptr()`` on a wrapper that
has no storage, takes the plain-tensor path and fails (``Attempted to access the data pointer on
an invalid python storage``). FSDP2 never meets this: its sharded parameters own their storage.
A ``copyreg`` reducer for DTensor pickles such a tensor through an equal wrapper at offset 0, so
the file holds exactly what torch writes for any DTensor (torch's own rebuild functions: it loads
with ``torch.load``'s default ``weights_only=True`` in a process that never imported this
package); a DTensor at offset 0 is pickled as torch pickles it.
"""

from __future__ import annotations

import copyreg

import torch
from torch.distributed.tensor import DTensor

__all__ = ["install_dtensor_view_pickling"]


def _reduce_dtensor(tensor: DTensor):
    if tensor.storage_offset() == 0:
        return tensor.__reduce_ex__(2)
    wrapper = torch.Tensor._make_wrapper_subclass(
        DTensor, tensor.shape, strides=tensor.stride(), dtype=tensor.dtype, device=tensor.device,
        layout=tensor.layout, requires_grad=tensor.requires_grad)
    wrapper._spec = tensor._spec
    wrapper._local_tensor = tensor._local_tensor
    return wrapper.__reduce_ex__(2)


def install_dtensor_view_pickling() -> None:
    """Register the reducer (idempotent; exactly the DTensor class, not its subclasses)."""
    copyreg.pickle(DTensor, _reduce_dtensor)
