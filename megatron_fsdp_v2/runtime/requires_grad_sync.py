"""``requires_grad_()`` after wrapping: carrying it between a parameter's two copies, and which
parameters a group still reduces.

A group keeps two per-parameter lists (group/param_group.py): ``trainable``, the ``requires_grad`` of the
last training forward, and ``reduced``, trainable at *any* forward since the accumulation began.
The reduce and ``.grad`` follow ``reduced``, so a parameter frozen between the micro-batches of one
step keeps what it accumulated before, as torch does (DeepSpeed's TestZeroUnbalancedGradients
freezes half the parameters each micro-batch); an accumulation ends at ``zero_grad`` or when the
optimizer steps (with ``zero_grad(set_to_none=False)`` nothing else tells the engine). Every rank
sees the same ``requires_grad_`` calls and the same steps, so the lists, and the packed reduce
laid out from them (group/trainable_pack.py, [Note: reducing what requires grad]), agree across ranks.
"""

from __future__ import annotations

__all__ = ["sync_requires_grad", "accumulation_ended"]


def sync_requires_grad(groups, accumulating: bool) -> None:
    """Honour ``requires_grad_()`` called after wrapping, on either copy of a parameter: whichever
    changed since the last forward wins. ``accumulating``: a backward ran since the grads were
    last zeroed (what it left is still reduced for a parameter frozen now)."""
    for group in groups:
        for index, (param, main) in enumerate(zip(group.params, group.main_params)):
            was = group.trainable[index]
            if param.requires_grad == was and main.requires_grad == was:
                continue
            now = main.requires_grad if main.requires_grad != was else param.requires_grad
            if now and not group.requires_grad:
                raise ValueError(
                    f"requires_grad: parameter {group.param_names[index]!r} was frozen when fully_shard "
                    "wrapped it, so it has no gradient buffer and cannot be unfrozen now; set "
                    "requires_grad before fully_shard (freezing after wrapping is supported).")
            param.requires_grad_(now)
            main.requires_grad_(now)
            group.trainable[index] = now
            group.reduced[index] = now or (group.reduced[index] and accumulating)


def accumulation_ended(groups) -> None:
    """The optimizer consumed the accumulated gradients: from now on only what is trainable reduces."""
    for group in groups:
        group.reduced = list(group.trainable)
