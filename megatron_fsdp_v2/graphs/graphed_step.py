"""``make_graphed_step``: a whole training step (k micro-batches, the reduces, clipping, the optimizer
step, zeroing) captured once as a CUDA graph and replayed every step.

[Note: a step as one CUDA graph]
When the GPU's work per step is small (strong scaling, fine-tuning, RL, small experts) the CPU sets
the step time: hooks, Python and kernel launches. A replayed graph launches the whole step at once.
``GraphedStep`` does what a hand capture with ``torch.cuda.graph`` needs, and what it forgets:
1. warm-up: the first ``warmup_steps`` calls run the step eagerly (real steps, on the side stream
   the capture will use, so autograd's lazily made state and the optimizer's state exist and
   belong to that stream), each followed by the checks of requirements.py;
2. capture: once every rank is idle, the cached free blocks of the warm-up are given back (the
   graph's private pool would otherwise sit beside them: a graph reserves no more than the eager
   step), the step is recorded, and what it counted in ``comm_stats()`` is kept; tensors the step
   binds to Python attributes for the next step to read (torchao's float8 scales) are carried
   back, inside the capture, to the tensors the graph reads (rebound.py);
3. replay: inputs are copied into the static tensors the step was captured with, the watch of
   watch.py checks that nothing Python-side changed ([Note: changes a graph cannot see]), the
   graph replays and ``comm_stats()`` is advanced by the captured step's counts.
Each of the engines runs ``capture_safe`` (requirements.py, [Note: what a captured step needs])
from the first warm-up step on, so the steps that are captured and those that ran eagerly issue
the same kernels and the graph's results equal the eager step's bit for bit.

Under replay no Python runs: the rank-divergence ledger and its watchdog see no new collectives
(every rank replays the same recorded ones), the user's hooks on parameters are not called (what
they launched on the GPU during capture is replayed), and ``comm_stats()`` is advanced by the counts
the capture recorded.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..runtime.engine import Engine
from .rebound import carry_rebound, tensor_attributes
from .requirements import communicators, refuse_device, refuse_uncapturable, refuse_unreplayable_grads
from .watch import CaptureWatch

__all__ = ["GraphedStep", "make_graphed_step"]


def _engines_of(models: Sequence[nn.Module], where: str) -> list[Engine]:
    engines = []
    for index, model in enumerate(models):
        engine = getattr(model, "_fsdp_engine", None)
        if not isinstance(engine, Engine):
            raise TypeError(f"{where}: model[{index}] ({type(model).__name__}) is not wrapped by "
                            "megatron_fsdp_v2.fully_shard (or the Megatron adapter's module).")
        engines.append(engine)
    return engines


def make_capture_safe(models: Sequence[nn.Module], optimizers: Sequence, where: str = "make_graphed_step") -> list[Engine]:
    """Refuse what a captured step cannot contain (requirements.py) and run the wrapped ``models``
    capture-safe from now on: every collective a step issues is waited within it. ``where`` names
    the caller in the error (the Megatron adapter, for Megatron's own full-iteration graph)."""
    engines = _engines_of(models, where)
    refuse_uncapturable(engines, optimizers, where=where)
    for engine in engines:
        engine.capture_safe = True
    return engines


class GraphedStep:
    """A training step that runs eagerly ``warmup_steps`` times, then is captured and replayed."""

    step_fn: Callable[..., Any]
    models: list[nn.Module]
    engines: list[Engine]
    optimizers: list
    warmup_steps: int
    eager_steps_left: int                  # eager calls before the next capture
    graph: Optional["torch.cuda.CUDAGraph"]
    captures: int                          # how many times the step was captured
    static_inputs: Optional[tuple]         # the tensors the step reads; each call copies into them
    static_output: Any                     # what the step returned at capture (replays rewrite its tensors)
    watch: CaptureWatch
    _stream: Optional["torch.cuda.Stream"]  # the side stream of warm-up and capture
    _comm_counts: list                     # per Communicator: (its CommStats, what one replay adds)

    def __init__(self, step_fn: Callable[..., Any], models: Union[nn.Module, Sequence[nn.Module]],
                 optimizers: Union[Any, Sequence[Any]], warmup_steps: int = 3) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"make_graphed_step: warmup_steps must be an int >= 1 (eager steps before the "
                             f"capture), got {warmup_steps!r}.")
        self.models = [models] if isinstance(models, nn.Module) else list(models)
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.engines = make_capture_safe(self.models, self.optimizers)
        self.step_fn, self.warmup_steps = step_fn, warmup_steps
        self.eager_steps_left, self.graph, self.captures = warmup_steps, None, 0
        self.static_inputs, self.static_output, self._comm_counts = None, None, []
        self.watch = CaptureWatch(self.models, self.optimizers)
        on_cuda = torch.cuda.is_available() and all(
            g.device.type == "cuda" for e in self.engines for g in e.groups[:1])
        self._stream = torch.cuda.Stream() if on_cuda else None

    # ------------------------------------------------------------------ the call
    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Run one training step on ``inputs`` (tensors of the shapes of the first call's)."""
        self._copy_inputs(inputs)
        if self.graph is not None:
            change = self.watch.changed()
            if change is None:
                return self._replay()
            self._drop_graph(change)
        if self.eager_steps_left > 0:
            self.eager_steps_left -= 1
            return self._eager_step()
        return self._capture_and_replay()

    def _copy_inputs(self, inputs: tuple) -> None:
        if self.static_inputs is None:
            for index, value in enumerate(inputs):
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"make_graphed_step: input {index} must be a tensor (a graph reads its inputs "
                                    f"from fixed addresses), got {type(value).__name__}.")
            self.static_inputs = tuple(value.detach().clone() for value in inputs)
            return
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"make_graphed_step: the step was called with {len(self.static_inputs)} inputs "
                             f"before, got {len(inputs)}.")
        for index, (value, static) in enumerate(zip(inputs, self.static_inputs)):
            if not isinstance(value, torch.Tensor) or value.shape != static.shape or value.dtype != static.dtype:
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"make_graphed_step: input {index} must keep shape {tuple(static.shape)} and dtype "
                                 f"{static.dtype} (the captured step's), got {got}.")
            static.copy_(value)

    # ------------------------------------------------------------------ eager steps
    def _eager_step(self) -> Any:
        if self._stream is None:
            output = self.step_fn(*self.static_inputs)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                output = self.step_fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(self._stream)
        refuse_unreplayable_grads(self.engines)
        return output

    # ------------------------------------------------------------------ capture and replay
    def _capture_and_replay(self) -> Any:
        refuse_device(self.engines)
        self._check_idle()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()      # the warm-up's cached free blocks back: the graph's pool replaces them
        before = self._comm_snapshot()
        attributes = tensor_attributes(self.models, self.engines)
        self.watch.record()
        graph = torch.cuda.CUDAGraph()
        stale_stream_override = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
        if stale_stream_override is not None:
            stale_stream_override(True)
        try:
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                self.static_output = self.step_fn(*self.static_inputs)
                carry_rebound(attributes)      # [Note: attributes a step rebinds]
        finally:
            if stale_stream_override is not None:
                stale_stream_override(False)
        self._comm_counts = self._comm_delta(before)
        self.watch.record()           # (the capture attached the .grad objects the replays write)
        self.graph, self.captures = graph, self.captures + 1
        return self._replay()

    def _replay(self) -> Any:
        self.graph.replay()
        for stats, delta in self._comm_counts:
            stats.add(delta)
        return self.static_output

    def _drop_graph(self, change: str) -> None:
        """A change the graph cannot see: this call runs eagerly and the next one captures again."""
        warnings.warn(f"make_graphed_step: {change}; the step runs eagerly once and is captured again "
                      "(hold such values as tensors changed in place to keep the graph).", stacklevel=3)
        self.graph.reset()
        self.graph, self.static_output, self._comm_counts = None, None, []
        self.eager_steps_left = 1

    def _check_idle(self) -> None:
        for engine in self.engines:
            if not engine.between_steps:
                raise RuntimeError(f"make_graphed_step: the model is in phase {engine.phase.phase.value!r} "
                                   "after the step (or a gradient reduce is in flight); a captured step must "
                                   "end with its backward and its gradient reduction done.")

    def _comm_snapshot(self) -> list:
        return [(comm.stats, comm.stats.snapshot()) for engine in self.engines for comm in communicators(engine)]

    def _comm_delta(self, before: list) -> list:
        """Per Communicator what the capture counted (calls, bytes, bytes by dtype, float8 scales)."""
        return [(stats, stats.since(snapshot)) for stats, snapshot in before]

    def close(self) -> None:
        """Free the graph and give the engines back their default schedule."""
        if self.graph is not None:
            self.graph.reset()
            self.graph = None
        self.watch.close()
        for engine in self.engines:
            engine.capture_safe = False


def make_graphed_step(step_fn: Callable[..., Any], models: Union[nn.Module, Sequence[nn.Module]],
                      optimizers: Union[Any, Sequence[Any]], warmup_steps: int = 3) -> GraphedStep:
    """Capture ``step_fn`` (one whole training step of ``models`` and ``optimizers``) as a CUDA
    graph after ``warmup_steps`` eager calls, and replay it at every later call.

    ``step_fn(*inputs)`` runs forward and backward of its micro-batches (``no_sync()`` on all but
    the last), clipping, ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=False)``, and
    returns what it wants back (e.g. the loss, detached). The returned callable takes the inputs,
    tensors of fixed shapes, copies them into static tensors and runs the step; the tensors it
    returns are rewritten by the next call (clone what you keep). Every call is one real training
    step. Requirements and refusals: graphs/requirements.py; changes that lead to a new capture:
    graphs/watch.py; docs/cuda_graphs.md."""
    return GraphedStep(step_fn, models, optimizers, warmup_steps)
