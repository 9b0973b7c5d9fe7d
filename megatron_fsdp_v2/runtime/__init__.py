"""The runtime: what runs every training step, driven by module and autograd hooks. The engine
(``engine.py``) calls the parameter groups' verbs from its hooks; a unit at run time and the forward
order that picks prefetch targets (``unit_state.py``); where a model is in its step, with checked
moves (``phase.py``); how a ZeRO-3 unit learns its backward begins (``pre_backward.py``); the
weight refresh after an optimizer step (``optimizer_hook.py``); which tensor a module's parameter
attribute holds (``param_swap.py``); the user's hooks on main parameters (``grad_hooks.py``); and
``requires_grad_()`` after wrapping (``requires_grad_sync.py``).
"""
