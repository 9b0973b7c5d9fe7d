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
(``step_temporary_bytes``): exactly that when one param group holds every parameter and they have
at most two dtypes (each param group's freed before the next: with several, the largest one's).
Offloaded groups step on the host (their copy is host memory). Measured on CPU, every strategy
at dp 1 and 2: ``tests/unit/test_plan_optimizer_step.py``.

The plan fits the kernel the run uses (``plan(..., optimizer_kernel=...)``,
``AutoStrategy.optimizer_kernel``): the step's peak, ``phases["step"]`` plus the kernel's
temporaries, must fit the budget as the other moments' do. ``"foreach"`` (the default: torch's
choice on CUDA when no kernel is named) as above; ``"fused"`` nothing; ``"single"``
(``foreach=False``, torch's choice on CPU), per parameter in turn (``_single_tensor_adam``):
``exp_avg_sq.sqrt()`` and its quotient by the bias correction, while the previous parameter's
denominator is still bound to the loop's variable, and for Adam's coupled weight decay also
``grad.add(param)``. Planned as a bound, the largest piece times 3 for AdamW and 4 for Adam
(its weight decay planned; with torch's default ``weight_decay=0``, 3): the previous parameter's
piece is at most the largest. SGD with momentum updates in place under every kernel;
its ``weight_decay`` (or ``maximize``) would add a copy of the gradients, not planned. Like every
number of the plan these are tensor bytes: the caching allocator rounds each tensor up to 512 B
and keeps the freed blocks reserved (docs/planning.md, "Allocated, not reserved").
"""

from __future__ import annotations

from ..strategy import ShardingStrategy
from .groups import PlannedGroup
from .memory import rank_piece_numels, rank_pieces

__all__ = ["FOREACH_STEP_COPIES", "SINGLE_STEP_COPIES", "STEP_KERNELS", "check_step_kernel", "step_temporary_bytes"]

#: The optimizer kernels a plan fits: torch's ``foreach`` (its CUDA default), ``fused``, ``single`` (``foreach=False``).
STEP_KERNELS = ("foreach", "fused", "single")

#: Main-dtype copies of the rank's pieces that torch's foreach step makes at its peak.
FOREACH_STEP_COPIES = {"adam": 1, "adamw": 1, "sgd": 0, "sgd_momentum": 0}

#: Main-dtype copies of the rank's largest piece that bound what the single-tensor step holds at once.
SINGLE_STEP_COPIES = {"adam": 4, "adamw": 3, "sgd": 0, "sgd_momentum": 0}


def check_step_kernel(value, argument: str = "optimizer_kernel") -> str:
    if value not in STEP_KERNELS:
        raise ValueError(f"{argument} must be one of {list(STEP_KERNELS)}, got {value!r}.")
    return value


def step_temporary_bytes(groups: list[PlannedGroup], strategy: ShardingStrategy, rank: int, optimizer: str,
                         kernel: str, offloaded: frozenset = frozenset()) -> int:
    """Device bytes ``optimizer.step()`` with ``kernel`` allocates beyond the kept bytes on shard
    rank ``rank`` ([Note: the optimizer step's temporaries]); ``offloaded``: positions of the
    groups whose main weights (and step) are on the host."""
    stepped = [g for index, g in enumerate(groups) if g.requires_grad and index not in offloaded]
    if kernel == "fused":
        return 0
    if kernel == "foreach":
        return sum(FOREACH_STEP_COPIES[optimizer] * rank_piece_numels(g, strategy, rank) * g.dtypes.main.itemsize
                   for g in stepped)
    largest = max((piece * g.dtypes.main.itemsize for g in stepped for piece in rank_pieces(g, strategy, rank)),
                  default=0)
    return SINGLE_STEP_COPIES[optimizer] * largest
