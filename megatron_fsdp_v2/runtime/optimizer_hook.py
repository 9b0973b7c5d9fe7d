"""Check before, and start the weight refresh after, an optimizer step on our main weights.

ZeRO-1/2 keep replicated compute weights that must be rebuilt (one all-gather per group) after
every optimizer step. Users call an unmodified ``torch.optim`` optimizer, so we learn about the
step through torch's global optimizer step post-hook: when the stepping optimizer holds main
weights of a wrapped model, that model.s weight refresh is issued right there (async).
The collective then belongs to the step, not to the first micro-batch of the next step, and it
overlaps whatever the user does before the next forward (which waits for it).

Engines register weakly: a model that is garbage collected drops out by itself. They are kept
in registration order: one optimizer may step several wrapped models over one process group
(Megatron's virtual pipeline chunks), and each issues its async all-gathers there, so every rank
must visit them in the same order (a WeakSet's order follows object addresses, which differ
between processes: mismatched collectives).

The same pre-step hook catches an optimizer built *before* ``fully_shard``: it holds the module's
original parameters, whose storage the wrapper took over, so it would silently train nothing.
``fully_shard`` marks those parameters (``REPLACED_ATTR``) and the first step of such an optimizer
raises, naming a parameter and the fix.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

if TYPE_CHECKING:
    from .engine import Engine

_ENGINES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()   # registration number -> engine
_NUMBERS = itertools.count()
_HANDLE = None
REPLACED_ATTR = "_fsdp_replaced_by_wrapper"     # on a parameter whose storage a wrapper took over
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # optimizer -> params checked


def mark_replaced(param, name: str) -> None:
    """``param`` (called ``name`` in its module) no longer trains by itself: its wrapper does."""
    setattr(param, REPLACED_ATTR, name)


def _check_not_replaced(optimizer) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _CHECKED.get(optimizer) == len(params):
        return
    for param in params:
        name = getattr(param, REPLACED_ATTR, None)
        if name is not None:
            raise RuntimeError(
                f"optimizer: {type(optimizer).__name__} holds parameter {name!r} as it was before fully_shard "
                "wrapped its module; the wrapper now owns that parameter's storage and trains its own "
                "main weights, so this optimizer would train nothing. Build the optimizer after "
                "fully_shard, from model.parameters().")
    _CHECKED[optimizer] = len(params)


def _engines_of(optimizer) -> list:
    if not _ENGINES:
        return []
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [engine for engine in list(_ENGINES.values()) if engine.owns_any(stepped)]


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    _check_not_replaced(optimizer)
    engines = _engines_of(optimizer)
    if not engines:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in engines:
        engine.before_optimizer_step(optimizer, stepped, args[1:], kwargs)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for engine in _engines_of(optimizer):
        engine.after_optimizer_step()


def engine_holding(param):
    """The registered engine whose main parameters include ``param`` (None: no wrapped model's)."""
    for engine in list(_ENGINES.values()):
        if engine.owns_any({id(param)}):
            return engine
    return None


def watch_optimizer_steps(engine: "Engine") -> None:
    """Issue ``engine.weights.refresh()`` after every optimizer step touching its main weights."""
    global _HANDLE
    if _HANDLE is None:
        _HANDLE = (register_optimizer_step_pre_hook(_before_optimizer_step),
                   register_optimizer_step_post_hook(_after_optimizer_step))
    if engine not in list(_ENGINES.values()):
        _ENGINES[next(_NUMBERS)] = engine


def unwatch_optimizer_steps(engine: "Engine") -> None:
    """Forget ``engine`` (its module was unwrapped, e.g. absorbed by an outer ``fully_shard``)."""
    for number, watched in list(_ENGINES.items()):
        if watched is engine:
            del _ENGINES[number]
