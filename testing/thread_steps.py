"""What a model's offloaded-step thread did (``OffloadPolicy(step_in_backward=True)``), seen through the
thread's profiler hook (``BackwardSteps.add_observer``): the step path itself counts nothing."""

from __future__ import annotations


def observe_thread_steps(model) -> list:
    """The ``GroupStepRecord`` of every group ``model``'s stepping thread steps from now on, in order
    (stays empty for a model without the thread). ``len`` is the group steps; ``sum(r.uploaded ...)``
    the uploads the thread started."""
    records: list = []
    steps = model._fsdp_engine.backward_steps
    if steps is not None:
        steps.add_observer(records.append)
    return records
