"""What ``optimizer.step()`` itself allocates on the device, beside the bytes the plan keeps.

[Note: the optimizer step's temporaries]
``phases["step"]`` (plan/phases.py) is the kept bytes at the step: right for a kernel that
updates in place, torch's ``fused=True`` Adam / AdamW. ``torch.optim.AdamW(params)`` with no
kernel named runs ``foreach`` on CUDA (``_default_to_fused_or_foreach``, for plain tensors and
DTensors), whose step (torch/optim/adam.py, ``_multi_tensor_adam``) makes, per param group and per
(device, dtype) of its parameters, ``torch._foreach_sqrt(exp_avg_sqs)``: one new tensor per
parameter, the size of its piece in the main dtype, alive until the step returns or the next
(device, dtype)'s list replaces it. Adam's coupled ``weight_decay`` (not AdamW's) first makes
``torch._foreach_add(grads, params)``, as large, and frees it before the square root. So the step
holds, on top of what it finds, at most one main-dtype copy of the rank's device pieces
(``foreach_step_bytes``): exactly that when one param group holds every parameter and they have
at most two dtypes (each param group's freed before the next: with several, the largest one's).
Offloaded groups step on the host (their copy is host memory). Measured on CPU, every strategy
at dp 1 and 2: ``tests/unit/test_plan_optimizer_step.py``.

Not planned: torch's SGD ``foreach`` step updates in place with its defaults (0 here);
``weight_decay`` (or ``maximize``) adds a copy of the gradients. The single-tensor kernel
(``foreach=False``) makes ``exp_avg_sq.sqrt()`` and its quotient per parameter: twice the largest
piece. Like every number of the plan these are tensor bytes: the caching allocator rounds each
tensor up to 512 B and keeps the freed blocks reserved (docs/planning.md, "Allocated, not reserved").
"""

from __future__ import annotations

from ..strategy import ShardingStrategy
from .groups import PlannedGroup
from .memory import rank_piece_numels

__all__ = ["FOREACH_STEP_COPIES", "foreach_step_bytes"]

#: Main-dtype copies of the rank's pieces that torch's foreach step makes at its peak.
FOREACH_STEP_COPIES = {"adam": 1, "adamw": 1, "sgd": 0, "sgd_momentum": 0}


def foreach_step_bytes(groups: list[PlannedGroup], strategy: ShardingStrategy, rank: int, optimizer: str,
                       offloaded: frozenset = frozenset()) -> int:
    """Device bytes torch's foreach ``optimizer.step()`` allocates beyond the kept bytes on shard
    rank ``rank`` ([Note: the optimizer step's temporaries]); ``offloaded``: positions of the
    groups whose main weights (and step) are on the host."""
    copies = FOREACH_STEP_COPIES[optimizer]
    return sum(copies * rank_piece_numels(group, strategy, rank) * group.dtypes.main.itemsize
               for index, group in enumerate(groups) if group.requires_grad and index not in offloaded)
