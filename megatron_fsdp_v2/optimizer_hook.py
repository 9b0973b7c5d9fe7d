"""Start the weight refresh as soon as an optimizer has stepped on our main weights.

ZeRO-1/2 keep replicated compute weights that must be rebuilt (one all-gather per group) after
every optimizer step. Users call an unmodified ``torch.optim`` optimizer, so we learn about the
step through torch's global optimizer step post-hook: when the stepping optimizer holds main
weights of a wrapped model, that model's ``start_param_sync()`` is issued right there (async).
The collective then belongs to the step, not to the first micro-batch of the next step, and it
overlaps whatever the user does before the next forward (which waits for it).

Engines register weakly: a model that is garbage collected drops out by itself.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()
_HANDLE = None


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    if not _ENGINES:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in list(_ENGINES):
        if engine.owns_any(stepped):
            engine.start_param_sync()


def watch_optimizer_steps(engine) -> None:
    """Issue ``engine.start_param_sync()`` after every optimizer step touching its main weights."""
    global _HANDLE
    if _HANDLE is None:
        _HANDLE = register_optimizer_step_post_hook(_after_optimizer_step)
    _ENGINES.add(engine)
