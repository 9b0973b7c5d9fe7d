"""Check before, and start the weight refresh after, an optimizer step on our main weights.

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

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()
_HANDLE = None


def _engines_of(optimizer) -> list:
    if not _ENGINES:
        return []
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [engine for engine in list(_ENGINES) if engine.owns_any(stepped)]


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    for engine in _engines_of(optimizer):
        engine.check_ready_for_optimizer_step()
        engine.mark_main_weights_changed()


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for engine in _engines_of(optimizer):
        engine.start_param_sync()


def watch_optimizer_steps(engine) -> None:
    """Issue ``engine.start_param_sync()`` after every optimizer step touching its main weights."""
    global _HANDLE
    if _HANDLE is None:
        _HANDLE = (register_optimizer_step_pre_hook(_before_optimizer_step),
                   register_optimizer_step_post_hook(_after_optimizer_step))
    _ENGINES.add(engine)
