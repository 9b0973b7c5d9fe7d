"""A user's hooks on the optimizer-facing parameters: post-accumulate-grad hooks run once the
reduced gradient is attached; tensor hooks (``register_hook``) are refused.

[Note: hooks on sharded parameters]
What ``model.parameters()`` yields between steps (the main parameters) never enters autograd: forward
and backward compute with the compute weights (param_swap.py, [Note: one parameter, one tensor]),
so autograd never calls a hook a user registers on a main parameter. FSDP2 has the same split and
calls the post-accumulate-grad hooks of its sharded parameters itself, once the reduce's output
is their ``.grad`` (``foreach_reduce``); optimizer-in-backward recipes step the optimizer there.
So do we (``GradHooks.run``):

* When: at the end of a backward outside ``no_sync()`` (its reduces waited for, every main
  parameter's ``.grad`` attached, the phase back to IDLE so that an optimizer may step), and at
  ``wait_gradient_reduction()`` / ``reduce_gradients()``: for each group whose reduce landed
  since its hooks last ran, in group order, each parameter whose ``.grad`` is set, once. Inside
  ``no_sync()`` none runs, whatever the strategy: FSDP2 reduces nothing there, and although our
  ZeRO-2/3 do reduce into ``.grad``'s buffer, the step's gradient is not complete before the last
  micro-batch (an optimizer stepped in the hook would step once per micro-batch). A repeated
  ``wait_gradient_reduction()`` runs nothing again. FSDP2 runs a group's hooks as its reduce lands,
  during backward; here they run after the last reduce (ZeRO-1/2 and DDP attach ``.grad`` then).
* What the hook gets: the main parameter, its ``.grad`` this rank's rows of the reduced mean (the
  ``unused_param_grads`` rule decides None); for offloaded groups the host gradient.
* A parameter no rank used keeps ``.grad`` None and its hooks do not run. A parameter used on some
  ranks only may then run its hooks on some ranks only (a rank holding none of its rows sees an
  empty piece as unused), as FSDP2 decides from each rank's own gradients; a hook that issues
  collectives must not rely on it.
* An optimizer stepped in a hook: its step post-hook would start ZeRO-1/2's weight refresh (one
  all-gather of the group) at every parameter's step. While hooks run the refresh waits, and
  starts once after the last hook (``Engine.after_optimizer_step``). With
  ``OffloadPolicy(step_in_backward=True)`` the host thread steps offloaded groups with the one
  optimizer of the model (offload/backward_steps.py); per-parameter optimizers stepped in hooks besides are
  refused at the second one's step, naming that rule.

``register_hook`` (a tensor hook: called with the gradient autograd computes for the tensor before
it is accumulated, and able to replace it) is refused: a main parameter gets no such gradient, and
the compute weight's local gradient is not what a hook on the sharded parameter means. FSDP2 never
calls it, silently. ``refuse_tensor_hooks`` raises at the next forward, before its first collective,
naming the parameter and ``register_post_accumulate_grad_hook`` (which reads and may change the
reduced ``.grad``). Each rank checks its own parameters: register hooks on every rank (as the
model's own code runs on every rank), or the ranks that did not would wait in the forward's
collectives.
"""

from __future__ import annotations

__all__ = ["GradHooks", "refuse_tensor_hooks"]


class GradHooks:
    """Which groups' hooks are due, and whether hooks are running now (optimizer steps inside them
    defer the weight refresh)."""

    def __init__(self) -> None:
        self._due: set = set()         # ids of groups whose reduce landed since their hooks last ran
        self.running = False
        self.refresh_due = False       # an optimizer stepped inside a hook: refresh after the last

    def reduce_landed(self, group) -> None:
        self._due.add(id(group))

    def forget(self) -> None:
        """The gradients were discarded (zero_grad, a failed backward): nothing is due."""
        self._due.clear()

    def run(self, groups: list) -> bool:
        """Call the post-accumulate-grad hooks of the due groups' main parameters (in ``groups``'
        order); returns whether an optimizer stepped inside one (a weight refresh is due)."""
        due, self._due = self._due, set()
        self.running, self.refresh_due = True, False
        try:
            for group in groups:
                if id(group) in due:
                    for main in group.main_params:
                        _call_post_accumulate_grad_hooks(main)
        finally:
            self.running = False
        return self.refresh_due


def _call_post_accumulate_grad_hooks(param) -> None:
    if param.grad is None:
        return
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in list((hooks or {}).values()):
        hook(param)


def refuse_tensor_hooks(groups: list) -> None:
    """Raise if a main parameter holds a ``register_hook`` hook (see the Note above)."""
    for group in groups:
        for name, main in zip(group.param_names, group.main_params):
            if main._backward_hooks:
                raise RuntimeError(
                    f"register_hook: parameter {name!r} has a tensor hook (Tensor.register_hook), which "
                    f"would never run: model.parameters() are the sharded parameters the optimizer steps, "
                    f"and autograd computes no gradient for them. Use "
                    f"register_post_accumulate_grad_hook(hook) instead: hook(param) runs once param.grad "
                    f"holds the reduced gradient of the step, and may read or change it in place. "
                    f"Remove the hook (handle.remove()) to go on.")
