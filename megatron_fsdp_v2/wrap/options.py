"""``WrapOptions``: every setting of one ``fully_shard`` call, in one checked object.

``fully_shard``'s keyword arguments are gathered here once, checked once (``check``, local: no
collective), and the object travels as it is to the rank agreement, the unit builders, the
``"auto"`` resolution and the planner, instead of each of them taking its own list of loose
arguments (torchtitan builds its FSDP config once the same way). Adding a setting touches this
dataclass, its check and the code that uses it. The process groups are not options: they become
communicators (``checks.wrap_communicators``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch.distributed as dist
import torch.nn as nn

from ..mixed_precision import MixedPrecisionPolicy
from ..offload.policy import OffloadPolicy
from ..strategy import ShardingStrategy, get_strategy

__all__ = ["WrapOptions"]


@dataclass(frozen=True)
class WrapOptions:
    """The settings of one ``fully_shard`` call (see its docstring for each); ``check`` validates them.

    ``sharding_strategy`` may be ``"auto"`` (then ``auto_strategy`` says what to plan for); ``plan``
    builds one with ``"auto"`` too, since it compares every strategy."""

    sharding_strategy: Union[str, ShardingStrategy]
    unit_modules: Optional[Sequence[type]] = None
    mixed_precision: Optional[MixedPrecisionPolicy] = None
    allocator: Any = "storage_freeing"
    check_for_nan_in_grad: bool = False
    broadcast_buffers: bool = True
    unused_param_grads: str = "none"
    dtensor_params: bool = True
    init_fn: Optional[Callable[[nn.Module], None]] = None
    expert_params: Optional[Callable[[str, nn.Parameter], bool]] = None
    persistent_grads: bool = False
    outer_sharding_strategy: str = "no_shard"
    reduce_root_per_child: bool = False
    auto_strategy: Any = None          # plan.resolve.AutoStrategy or None (its type checked there)
    offload: Optional[OffloadPolicy] = None
    reshard_after_forward: Optional[bool] = True

    @property
    def is_auto(self) -> bool:
        return isinstance(self.sharding_strategy, str) and self.sharding_strategy == "auto"

    @property
    def unused_grads_are_none(self) -> bool:
        return self.unused_param_grads == "none"

    @property
    def uploads_in_backward(self) -> bool:
        """``OffloadPolicy(step_in_backward=True)``: offloaded groups step and upload during backward."""
        return self.offload is not None and self.offload.step_in_backward

    def check(self, module, wrapped_class: type, process_group) -> Optional[ShardingStrategy]:
        """The strategy (None for ``"auto"``) after checking every option's type and value, on every
        rank alike (local checks only: no collective yet)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
        if isinstance(module, wrapped_class):
            raise ValueError(f"module: {type(module).__name__} is already wrapped by fully_shard; wrap a module once.")
        strategy = None if self.is_auto else get_strategy(self.sharding_strategy, also_allowed=("auto",))
        if self.auto_strategy is not None and not self.is_auto:
            raise ValueError(f"auto_strategy is used with sharding_strategy='auto' only, got sharding_strategy="
                             f"{self.sharding_strategy!r}; drop one of them.")
        self._check_types()
        if self.offload is not None and self.offload.fraction > 0 and process_group is not None and not isinstance(
                process_group, dist.ProcessGroup):
            raise ValueError("offload: CPU offload with hybrid sharding (a pair of groups or a 2-D mesh as "
                             "process_group) is not supported; shard over one group, or pass offload=None.")
        return strategy

    def _check_types(self) -> None:
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecisionPolicy):
            raise TypeError(f"mixed_precision must be a MixedPrecisionPolicy or None, got "
                            f"{type(self.mixed_precision).__name__}.")
        if self.unused_param_grads not in ("none", "zeros"):
            raise ValueError(f"unused_param_grads must be 'none' or 'zeros', got {self.unused_param_grads!r}.")
        for name in ("dtensor_params", "reduce_root_per_child", "persistent_grads"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if not (self.reshard_after_forward is None or isinstance(self.reshard_after_forward, bool)):
            raise TypeError(f"reshard_after_forward must be True, False or None (FSDP2's default: every unit "
                            f"but the root), got {self.reshard_after_forward!r}.")
        if self.offload is not None and not isinstance(self.offload, OffloadPolicy):
            raise TypeError(f"offload must be an OffloadPolicy or None, got {type(self.offload).__name__}.")
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError(f"init_fn must be a callable taking a module, or None, got {type(self.init_fn).__name__}.")

    def agreed_settings(self, strategy: ShardingStrategy, allocator) -> dict:
        """What every rank must set alike, as text (wrap/rank_agreement.py compares it)."""
        return {
            "sharding_strategy": strategy.name,
            "mixed_precision": repr(self.mixed_precision),
            "allocator": type(allocator).__name__,
            "broadcast_buffers": str(bool(self.broadcast_buffers)),
            "unused_param_grads": self.unused_param_grads,
            "check_for_nan_in_grad": str(bool(self.check_for_nan_in_grad)),
            "dtensor_params": str(self.dtensor_params),
            "persistent_grads": str(self.persistent_grads),
            "outer_sharding_strategy": self.outer_sharding_strategy,
            "reduce_root_per_child": str(self.reduce_root_per_child),
            "offload": repr(self.offload),
            "reshard_after_forward": repr(self.reshard_after_forward),
        }
