"""What a training step replayed as one CUDA graph cannot contain, refused before capture by name.

[Note: what a captured step needs]
A CUDA graph replays the kernels one capture recorded, and no Python runs during a replay. So:
* no host synchronization may sit in the step: ``check_for_nan_in_grad`` reads every reduced
  gradient on the host, ``MEGATRON_FSDP_V2_CHECK_COLLECTIVES=1`` compares every collective on the
  host, CPU offload copies to the host and steps there, and an optimizer whose step count lives on
  the host (``capturable=False``) reads it there. Each is refused here, naming the option;
* every collective a step issues is waited within it (``Engine.capture_safe``): ZeRO-1/2's weight
  refresh, issued after ``optimizer.step()``, lands before the step returns instead of during the
  next forward, so no collective crosses the graph's boundary (which fails the capture:
  ``cudaErrorStreamCaptureInvalidated``);
* every address the kernels touch stays valid across replays: the optimizer's ``.grad`` tensors
  must outlive the step (``zero_grad(set_to_none=False)``), and every trainable parameter must get
  a gradient in every step (one that gets none would need a host read to decide that its
  ``.grad`` is None, as torch DDP gives).
CUDA graphs capture NCCL collectives (and torch's fake group's); gloo's run on host threads.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from ..comm.ledger import CHECK_ENV, LedgerMode
from ..optim.muon import Muon
from ..runtime.engine import Engine

__all__ = ["communicators", "refuse_uncapturable", "refuse_unreplayable_grads", "refuse_device"]


def communicators(engine: Engine) -> list:
    """Every Communicator ``engine`` issues collectives over (shard group, replicas, experts, world)."""
    found: list = []
    for comm in (engine.comm, engine.replicas, engine.experts, engine.world):
        if comm is not None and all(comm is not other for other in found):
            found.append(comm)
    return found


def _engine_problems(engine: Engine) -> list[str]:
    problems = []
    if engine.check_for_nan_in_grad:
        problems.append("check_for_nan_in_grad=True: the check reads every reduced gradient on the host, which "
                        "a CUDA graph cannot contain; pass check_for_nan_in_grad=False (Megatron: "
                        "--no-check-for-nan-in-loss-and-grad)")
    offloaded = [g.name for g in engine.groups if g.offloaded is not None]
    if offloaded or engine.backward_steps is not None:
        problems.append(f"offload: groups {offloaded} keep their main weights on the host (OffloadPolicy with "
                        "fraction > 0); host copies and a CPU optimizer step cannot be captured. Use "
                        "OffloadPolicy(fraction=0) or no offload")
    for comm in communicators(engine):
        if comm.ledger_mode is LedgerMode.CHECK and dist.get_backend(comm.group) != "gloo":
            problems.append(f"{CHECK_ENV}=1 compares every collective across ranks on the host; unset it "
                            "(or set it to 0) for a captured step")
            break
    return problems


def _optimizer_problems(optimizer) -> list[str]:
    problems = []
    if isinstance(optimizer, Muon):
        problems.append("optimizer: megatron_fsdp_v2.optim.Muon exchanges whole matrices between ranks and keeps "
                        "its AdamW step count on the host; it cannot be captured (use it with eager steps)")
    for index, group in enumerate(optimizer.param_groups):
        if group.get("capturable") is False:
            problems.append(f"optimizer: {type(optimizer).__name__} param_groups[{index}] has capturable=False: "
                            "its step count lives on the host; build it with capturable=True")
    return problems


def refuse_uncapturable(engines: Sequence[Engine], optimizers: Sequence, where: str = "make_graphed_step") -> None:
    """Raise ValueError listing every setting that keeps the step out of a CUDA graph (every rank
    raises alike: the settings agree across ranks, ``wrap/rank_agreement.py``); ``where`` names the
    caller (the Megatron adapter checks its engine for Megatron's full-iteration graph)."""
    problems = [p for engine in engines for p in _engine_problems(engine)]
    problems += [p for optimizer in optimizers for p in _optimizer_problems(optimizer)]
    if problems:
        raise ValueError(f"{where}: the step cannot be captured as a CUDA graph:\n  - " + "\n  - ".join(problems))


def refuse_device(engines: Sequence[Engine]) -> None:
    """At capture: CUDA parameters and process groups whose collectives a graph can hold."""
    for engine in engines:
        device = engine.groups[0].device if engine.groups else None
        if device is None or device.type != "cuda":
            raise RuntimeError(f"make_graphed_step: a CUDA graph needs the model on a CUDA device, got "
                               f"{device}; the warm-up steps ran eagerly, capture is not possible here.")
        for comm in communicators(engine):
            backend = dist.get_backend(comm.group)
            if backend not in ("nccl", "fake"):
                raise RuntimeError(f"make_graphed_step: process group backend {backend!r} cannot be captured "
                                   "in a CUDA graph; allowed: 'nccl' (or torch's 'fake' group).")


def refuse_unreplayable_grads(engines: Sequence[Engine]) -> None:
    """After an eager step: every trainable main parameter holds its ``.grad`` (the tensor a
    replay writes), or the step cannot be replayed."""
    for engine in engines:
        for group in engine.groups:
            if not group.requires_grad:
                continue
            for index, main in enumerate(group.main_params):
                if not group.trainable[index] or main.grad is not None:
                    continue
                name = group.param_names[index]
                if not group.got_grad[index]:
                    raise ValueError(
                        f"make_graphed_step: parameter {name!r} got no gradient in the step; a captured step "
                        "needs every trainable parameter used in every step. Freeze it "
                        "(requires_grad_(False)) before the step, or use it.")
                raise ValueError(
                    f"make_graphed_step: parameter {name!r} has .grad None after the step: the step set the "
                    "gradients to None (optimizer.zero_grad() defaults to set_to_none=True), so each step "
                    "would allocate new gradient buffers a replay cannot see. Call "
                    "optimizer.zero_grad(set_to_none=False) in the step.")
