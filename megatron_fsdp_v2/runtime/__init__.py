"""The runtime: what runs every training step, driven by module and autograd hooks. The engine
(``engine.py``) calls the parameter groups' verbs from its hooks; a unit at run time and the forward
order that picks prefetch targets (``unit_state.py``); where a model is in its step, with checked
moves (``phase.py``); how a ZeRO-3 unit learns its backward begins (``pre_backward.py``); which
optimizer steps touch the main weights (``optimizer_hook.py``) and the compute weights' refresh
after them (``weight_refresh.py``); ``clip_grad_norm_`` (``grad_norm.py``); which tensor a module's parameter
attribute holds (``param_swap.py``); the user's hooks on main parameters (``grad_hooks.py``); and
``requires_grad_()`` after wrapping (``requires_grad_sync.py``).
"""
