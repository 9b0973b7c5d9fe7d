"""Where Megatron's own ``sharded_state_dict`` puts a parameter (``Placement``): what the model's
checkpoint (dist_checkpoint.py) and the optimizer's Megatron layouts (distopt_format.py) both place
values at, in a module of its own so that neither imports the other for it."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Placement"]


class Placement(NamedTuple):
    """Where Megatron's own ``sharded_state_dict`` puts a parameter: its checkpoint key, the
    leading axes it prepends (transformer layers are stacked under one key, the layer number is the
    offset on a prepended axis), and for a tensor-parallel slice where this rank's slice sits in
    the whole tensor (``tensor_offsets`` into ``tensor_shape``). ``replica_id`` is Megatron's
    (``(0, tp_rank, dp_rank)`` for a tensor-parallel replica such as a layer norm); its last
    element, the data-parallel one, is ours to set. ``Placement(name)``: a tensor without one."""

    key: str
    prepend_offsets: tuple = ()
    prepend_shape: tuple = ()
    tensor_offsets: tuple = ()
    tensor_shape: tuple = ()
    replica_id: object = 0
