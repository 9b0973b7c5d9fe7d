"""The schedule: which group unshards, reshards and reduces when, driven by module and autograd hooks.

[Note: the life of one training step]
  root pre-forward   weights refreshed from updated main weights if the optimizer stepped
                     (ZeRO-1/2: one async all-gather per group, waited per unit at its forward;
                     DDP with mixed precision: a local cast); ZeRO-3: root unit all-gathered.
  unit pre-forward   ZeRO-3: all-gather this unit (prefetched when possible) and wait for it (with
                     per-parameter shards: its copy-out), then prefetch the next (not over a
                     one-rank gather: Unit.worth_prefetching).
  unit post-forward  ZeRO-3: reshard (not a unit its ``reshard_after_forward`` keeps: FSDP2's
                     root, gathered until its backward ends); hook the outputs so the unit's
                     backward unshards it again.
  unit pre-backward  ZeRO-3: all-gather this unit and wait for it, prefetch the one before it in
                     forward order.
  param grad ready   DDP/ZeRO-1: add it to the group's full-size grad buffer; ZeRO-2/3: hold it
                     (group/unreduced_grads.py). When the whole group is ready and this micro-batch
                     reduces, ZeRO-3 reshards it (its unit once all are done; a root group at
                     once, as FSDP2), then reduces it (async); a root group only if that frees memory.
  end of backward    reduce groups still holding gradients (unused parameters; deferred root
                     groups), wait for every reduce, point the optimizer-facing ``.grad`` at the
                     reduced shard, reshard.

[Note: bounds on temporary buffers]
  When a group's first gradient of a backward arrives, and before a reduce is issued, the engine
  waits for the reduce in flight. So at most one full-size reduce input is live (ZeRO-2: <= 2
  units of it; ZeRO-3 backward: this unit's weights, the prefetched unit's weights (with
  per-parameter shards its rank-major gather buffer until it lands, the same size) and one reduce
  input).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
from torch.autograd import Variable

from .buffer_broadcast import broadcast_buffers
from .grad_norm import clip_main_grads
from .grad_hooks import GradHooks, refuse_tensor_hooks
from .optimizer_hook import watch_optimizer_steps
from ..comm import PendingCollective
from ..group.param_group import ParamGroup
from .param_swap import ParamSlots
from .phase import Phase, PhaseMachine
from .pre_backward import ForwardRecord, SavedWeightHooks, tensors_needing_grad
from ..row_sharded import local_piece
from .requires_grad_sync import accumulation_ended, sync_requires_grad
from ..strategy import ShardingStrategy
from .unit_state import ForwardOrder, Unit  # noqa: F401  (Unit: also engine.Unit)
from .weight_refresh import WeightRefresh


class MainRows(NamedTuple):
    """Where a main parameter's rows live (``Engine.main_rows``): what a matrix optimizer needs to
    gather a parameter whole (optim/muon.py)."""

    comm: object                      # the Communicator its group is sharded (or replicated) over
    shape: torch.Size                 # the parameter's original shape
    row_splits: Optional[tuple]       # rank r holds rows [splits[r], splits[r + 1]); None: every rank all
    on_host: bool                     # an offloaded group's (offload/host_link.py): its main weights are host tensors


class BackwardPass(NamedTuple):
    """One backward pass: does it reduce gradients (outside no_sync, or ZeRO-2/3 always)?"""

    reduces: bool


class Engine:
    """Holds the units and runs the schedule above through hooks."""

    # -- what was wrapped
    root: nn.Module
    units: list[Unit]
    groups: list[ParamGroup]                 # every unit's groups, in unit order
    strategy: ShardingStrategy
    allocator: object                        # temporaries (allocators/)
    comm: object                             # the data-parallel Communicator (HFSDP: the inner group)
    replicas: Optional[object]               # hybrid sharding: the outer group (comm/replicas.py)
    experts: Optional[object]                # expert parameters' group (wrap/experts.py)
    world: Optional[object]                  # HFSDP: the whole world the main weights are sharded over
    _main_param_ids: set                     # ids of every group's optimizer-facing parameters

    # -- settings (fully_shard and the model's methods set them)
    requires_gradient_sync: bool             # False inside no_sync(): DDP / ZeRO-1 accumulate locally
    check_for_nan_in_grad: bool
    broadcast_buffers: bool                  # DDP's default True: rank 0's buffers before forwards
    unused_grads_are_none: bool              # torch DDP / FSDP2: a parameter no rank used keeps .grad None
    capture_safe: bool                       # every collective a step issues is waited within it (graphs/)
    _divide_factor: Optional[float]          # set_gradient_divide_factor (None: the data-parallel size)

    # -- where the step is
    phase: PhaseMachine
    forward_order: ForwardOrder
    backward_pass: Optional[BackwardPass]    # the backward now running
    _backward_count: int
    main_grads_attached: bool                # optimizer-facing .grad point at reduced gradients
    grads_since_zero: bool                   # a backward ran since the gradients were last zeroed
    _buffers_due: bool                       # torch DDP's require_forward_param_sync ([Note: buffers as DDP])
    # the one owner of every issued gradient reduce not yet waited for (the schedule keeps at most
    # one in flight; start_gradient_reduction may issue several)
    _reduces_in_flight: list[tuple[ParamGroup, PendingCollective]]

    # -- parts
    weights: WeightRefresh                   # compute weights after main weights change (weight_refresh.py)
    grad_hooks: GradHooks                    # the user's hooks on main parameters (grad_hooks.py)
    backward_steps: Optional[object]         # offloaded groups stepped during backward (offload/backward_steps.py)
    param_slots: ParamSlots                  # what the module's parameter attributes hold (param_swap.py)
    _handles: list                           # the module and autograd hooks this engine registered

    def __init__(self, root: nn.Module, units: list[Unit], strategy: ShardingStrategy, allocator, comm,
                 replicas=None, experts=None, world=None) -> None:
        self.root, self.units, self.strategy, self.allocator, self.comm = root, units, strategy, allocator, comm
        self.replicas, self.experts, self.world = replicas, experts, world
        self.groups = [g for u in units for g in u.groups]
        self._main_param_ids = {id(m) for g in self.groups for m in g.main_params}
        self.requires_gradient_sync, self.check_for_nan_in_grad = True, False
        self.broadcast_buffers, self.unused_grads_are_none, self._divide_factor = True, True, None
        self.capture_safe = False
        self.phase, self.forward_order = PhaseMachine(), ForwardOrder()
        self.backward_pass, self._backward_count = None, 0
        self.main_grads_attached = self.grads_since_zero = False
        self._buffers_due = True                 # the first forward broadcasts the buffers
        self._reduces_in_flight = []
        self.weights, self.grad_hooks, self.backward_steps = WeightRefresh(self.groups, strategy), GradHooks(), None
        # fully_shard installs the swapping one for DTensor parameters ([Note: one parameter, one tensor])
        self.param_slots = ParamSlots(root, {}, swaps=False)
        self._handles = []
        self._register_hooks()
        watch_optimizer_steps(self)

    def owns_any(self, param_ids: set) -> bool:
        return not self._main_param_ids.isdisjoint(param_ids)

    def main_rows(self, main) -> Optional[MainRows]:
        """Which rows of its parameter the main parameter ``main`` holds on each rank, over which
        group (None: not one of this engine's main parameters)."""
        for group in self.groups:
            for index, candidate in enumerate(group.main_params):
                if candidate is main:
                    splits = group.layout.row_splits(index) if group.strategy.optim_sharded else None
                    return MainRows(group.comm, torch.Size(group.shapes[index]), splits,
                                    group.offloaded is not None)
        return None

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self) -> None:
        """Hooks reach the engine through a weak reference and find units and groups by index.

        A hook stored on a parameter lives in C++ autograd state that Python's cycle collector
        cannot see through; a strong reference from it back to the engine (or to a unit, which
        holds the root module) would keep the whole wrapped model alive forever."""
        ref = weakref.ref(self)
        # Post-forward hooks are always called, also when the forward raises: they pop the unit's
        # saved-tensor hooks, which must not outlive its forward.
        self._handles.append(self.root.register_forward_pre_hook(
            lambda m, a: ref()._root_pre_forward(m, a), prepend=True))
        self._handles.append(self.root.register_forward_hook(
            lambda m, a, out: ref()._root_post_forward(m, a, out), always_call=True))
        for u, unit in enumerate(self.units):
            if not unit.is_root:
                self._handles.append(unit.module.register_forward_pre_hook(
                    lambda m, a, u=u: ref()._unit_pre_forward(ref().units[u])))
                self._handles.append(unit.module.register_forward_hook(
                    lambda m, a, out, u=u: ref()._unit_post_forward(ref().units[u], out), always_call=True))
            for g, group in enumerate(unit.groups):
                if not group.requires_grad:
                    continue
                for index, param in enumerate(group.params):
                    self._handles.append(param.register_post_accumulate_grad_hook(
                        lambda p, u=u, g=g, index=index: ref()._on_grad_at(u, g, index, p)))

    def _on_grad_at(self, u: int, g: int, index: int, param: nn.Parameter) -> None:
        unit = self.units[u]
        self._on_grad(unit, unit.groups[g], index, param)

    def remove_hooks(self) -> None:
        """Detach the engine from the module (used when tearing a wrapped model down)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def hook_count(self) -> int:
        return len(self._handles)

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable
    def _root_pre_forward(self, module, args) -> None:
        if self.backward_died():
            self.reset_iteration()
        self._check_steps_idle("a forward")
        refuse_tensor_hooks(self.groups)          # before any collective of this forward
        self.param_slots.hold_compute()
        training = torch.is_grad_enabled()
        if self.phase.is_(Phase.BACKWARD):
            pass                                  # a forward recomputed inside backward
        elif training or not self.phase.is_(Phase.AWAITING_BACKWARD, Phase.AWAITING_BACKWARD_NO_SYNC):
            # (an evaluation forward between a training forward and its backward leaves the phase)
            self.phase.enter(Phase.FORWARD, gradient_sync=self.requires_gradient_sync)
            self.sync_requires_grad()
        if self.broadcast_buffers and self._buffers_due:
            broadcast_buffers(self.root, (self.comm, self.replicas))
        self.weights.refresh(before_forward=True)
        root = self.units[0]
        self.forward_order.record(root)
        if self.strategy.weights_sharded:
            root.unshard(async_op=False)
        root.wait_unshard()
        self._enter_forward(root)

    @torch.compiler.disable
    def _root_post_forward(self, module, args, output):
        root = self.units[0]
        record = self._exit_forward(root)
        self._buffers_due = torch.is_grad_enabled() and self.requires_gradient_sync
        self.forward_order.freeze()
        in_backward = self.phase.is_(Phase.BACKWARD)
        awaits_backward = self._register_pre_backward(root, output, record)
        if self.strategy.weights_sharded and not in_backward and root.reshards_after_forward:
            root.reshard()                        # (else FSDP2's root: gathered until its backward ends)
        for unit in self.units:       # a unit the forward skipped must not keep a refresh pending
            unit.wait_unshard()
        if self.phase.is_(Phase.FORWARD):
            if awaits_backward:
                self.phase.enter(Phase.AWAITING_BACKWARD if self.requires_gradient_sync
                                 else Phase.AWAITING_BACKWARD_NO_SYNC)
            else:
                self.phase.enter(Phase.IDLE)
                self.param_slots.hold_main()       # no backward follows (evaluation)
                if self.strategy.weights_sharded:  # units kept gathered for a backward give their weights back
                    for unit in self.units:
                        unit.reshard()
        return output

    @torch.compiler.disable
    def _unit_pre_forward(self, unit: Unit) -> None:
        self.param_slots.hold_compute()           # a unit called on its own, outside the root
        self.forward_order.record(unit)
        if self.strategy.weights_sharded:
            unit.unshard(async_op=False)
            unit.wait_unshard()             # before the prefetch: one gather's temporaries in flight
            if not self.phase.is_(Phase.BACKWARD):
                nxt = self.forward_order.neighbour(unit, +1)
                if nxt is not None and not nxt.is_root and nxt.worth_prefetching:
                    nxt.unshard(async_op=True)
        unit.wait_unshard()
        self._enter_forward(unit)

    @torch.compiler.disable
    def _unit_post_forward(self, unit: Unit, output):
        record = self._exit_forward(unit)
        if not self.strategy.weights_sharded:
            return output
        if not self.phase.is_(Phase.BACKWARD):   # recomputation inside backward keeps weights
            if unit.reshards_after_forward or not torch.is_grad_enabled():
                unit.reshard()
            if torch.is_grad_enabled() and self.forward_order.is_last(unit):
                unit.prefetch_uploads()           # (offload) the first unit of backward, its shard again
        self._register_pre_backward(unit, output, record)
        return output

    def _enter_forward(self, unit: Unit) -> None:
        """Start a record of this forward; ZeRO-3 also watches what autograd saves of the weights."""
        record, hooks = ForwardRecord(), None
        if self.strategy.weights_sharded and torch.is_grad_enabled() and not self.phase.is_(Phase.BACKWARD):
            ref, u = weakref.ref(self), unit.index
            hooks = SavedWeightHooks(lambda rec, group, u=u: ref()._pre_backward(ref().units[u], rec, group),
                                     unit.groups, record)
            hooks.enter()
        unit.forwards_in_flight.append((record, hooks))

    def _exit_forward(self, unit: Unit) -> ForwardRecord:
        if not unit.forwards_in_flight:
            return ForwardRecord()
        record, hooks = unit.forwards_in_flight.pop()
        if hooks is not None:
            hooks.exit()
        return record

    # ------------------------------------------------------------------ backward
    def _register_pre_backward(self, unit: Unit, output, record: ForwardRecord) -> bool:
        """Hook the output's tensors so the unit is gathered (and its predecessor prefetched) as
        soon as its backward begins; ``pre_backward.py`` covers outputs of any other type."""
        tensors = tensors_needing_grad(output)
        if not tensors:
            return False
        ref, u = weakref.ref(self), unit.index
        torch.autograd.graph.register_multi_grad_hook(
            tensors, lambda grads, u=u: ref()._pre_backward(ref().units[u], record), mode="any")
        return True

    def _pre_backward(self, unit: Unit, record: ForwardRecord, group: Optional[ParamGroup] = None) -> None:
        """Called by every trigger of ``pre_backward.py``; the first in a backward gathers the unit
        and prefetches. A later one from a saved weight (``group``) gathers that group only: the
        unit's other groups resharded in this backward were done with."""
        self._on_backward_start()
        first_trigger = record.backward_index != self._backward_count
        if first_trigger and record.backward_index is not None and self.strategy.weights_sharded:
            raise RuntimeError(
                f"backward ran twice through one forward of unit {unit.fqn or '<root>'!r}: with "
                "optim_grads_params (ZeRO-3) each forward's gradients are reduce-scattered and its weights "
                "resharded after the first backward. Run the forward again before another backward.")
        record.backward_index = self._backward_count
        if not self.strategy.weights_sharded:
            return
        if first_trigger or group is None:
            unit.unshard(async_op=False)
            if unit.is_root:
                for root_group in unit.groups:
                    root_group.offloading.after_backward_gather()
        else:
            group.unshard(async_op=False)
        unit.wait_unshard()                 # before the prefetch: one gather's temporaries in flight
        if first_trigger:
            prev = self.forward_order.neighbour(unit, -1)
            if prev is not None and not prev.is_root and prev.worth_prefetching:
                prev.unshard(async_op=True)
            elif prev is not None:
                prev.prefetch_uploads()           # (offload: a released compute shard, copied ahead)

    def _on_backward_start(self) -> None:
        if self.backward_pass is not None:
            return
        self._check_steps_idle("a second backward")
        self.phase.enter(Phase.BACKWARD)
        self._backward_count += 1
        self.backward_pass = BackwardPass(
            reduces=self.requires_gradient_sync or self.strategy.reduce_every_microbatch)
        Variable._execution_engine.queue_callback(self._post_backward_final)
        for group in self.groups:
            group.begin_backward()
        if self.main_grads_attached and self._optimizer_cleared_grads():
            if self.capture_safe and not all(g.grads.persistent for g in self.groups):
                raise RuntimeError(
                    "optimizer.zero_grad(set_to_none=True) in a step captured as a CUDA graph: each step would "
                    "allocate new gradient buffers a replay cannot see; call zero_grad(set_to_none=False).")
            self.zero_grads(release=True)
        self.grads_since_zero = True

    def _optimizer_cleared_grads(self) -> bool:
        """``optimizer.zero_grad(set_to_none=True)`` left ``.grad`` None: start a fresh accumulation.

        Parameters whose ``.grad`` is None because nobody used them, or because they were frozen
        since wrapping (attach_main_grads leaves theirs None), do not count."""
        return any(main.grad is None and group.got_grad[index] and group.trainable[index]
                   for group in self.groups if group.requires_grad
                   for index, main in enumerate(group.main_params))

    def _on_grad(self, unit: Unit, group: ParamGroup, index: int, param: nn.Parameter) -> None:
        self._on_backward_start()
        if param.grad is None:
            return
        if group.strategy.grads_sharded and not group.holds_unreduced_grads:
            self.wait_gradient_reduces()          # bound: one full-size reduce input in flight
        group.accumulate_grad(index, param.grad)
        param.grad = None
        if self.backward_pass.reduces and group.all_grads_ready():
            # Reshard first: the unit's weights are done, and their memory is then free for the
            # reduce's dtype cast (keeps ZeRO-3 backward within 2 weight buffers + 1 grad buffer).
            others_done = all(g is group or not any(g.trainable) or g.reduced_this_backward for g in unit.groups)
            if self.strategy.weights_sharded and not unit.is_root and others_done:
                unit.reshard()
            elif self.strategy.weights_sharded and unit.is_root:
                # A root group with all its gradients is done (autograd calls a leaf's hook once,
                # after all its uses): freed before its reduce input is made, as in FSDP2. Frozen
                # root groups stay gathered to the end of backward (pre_backward.py: a saved weight
                # unpacked later gathers again).
                group.reshard()
            if unit.is_root and not group.reduce_frees_memory:
                return          # the end of backward reduces it, once the activations are gone
            self._reduce(group)

    def _reduce(self, group: ParamGroup) -> None:
        self.wait_gradient_reduces()
        pending = group.reducer.reduce_grad(self._shard_group_divide_factor)
        if pending is not None:
            self._reduces_in_flight.append((group, pending))

    @property
    def gradient_divide_factor(self) -> float:
        """What reduced gradients are divided by: the data-parallel size (a mean; with hybrid
        sharding inner x outer ranks) unless set."""
        if self._divide_factor is not None:
            return self._divide_factor
        return float(self.comm.size * (self.replicas.size if self.replicas is not None else 1))

    @property
    def _shard_group_divide_factor(self) -> float:
        """The inner reduce's share of the divisor; the outer all-reduce divides by the outer size."""
        return self.gradient_divide_factor / (self.replicas.size if self.replicas is not None else 1)

    def _reduce_across_replicas(self) -> None:
        """Hybrid sharding: average every group's freshly reduced gradients across the replicas
        (once the inner reduces are waited for; comm/replicas.py, [Note: hybrid sharding])."""
        if self.replicas is None:
            return
        for group in self.groups:
            group.reducer.reduce_across_replicas(self.replicas)

    def set_gradient_divide_factor(self, factor: Optional[float]) -> None:
        if factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
            raise ValueError(f"factor must be a positive number or None (the data-parallel size), got {factor!r}.")
        self._divide_factor = None if factor is None else float(factor)

    def wait_gradient_reduces(self) -> None:
        """Wait for the reduces in flight (at most one from the schedule) without scanning all groups."""
        in_flight, self._reduces_in_flight = self._reduces_in_flight, []
        for group, pending in in_flight:
            group.reducer.finish_grad_reduce(pending)
            self.grad_hooks.reduce_landed(group)
            steps = self.backward_steps
            if steps is not None and self.phase.is_(Phase.BACKWARD) and self.requires_gradient_sync \
                    and not self.check_for_nan_in_grad:
                steps.hand_over(group, self.unused_grads_are_none)   # its last gradients of this step landed

    def _post_backward_final(self) -> None:
        backward, self.backward_pass = self.backward_pass, None
        if backward.reduces:
            for group in self.groups:
                if group.has_unreduced_grads:
                    self._reduce(group)
            self.wait_gradient_reduces()
            if self.requires_gradient_sync:       # under no_sync() the outer all-reduce waits for the last
                self._reduce_across_replicas()
            self._attach_main_grads()
        if self.strategy.weights_sharded:
            for unit in self.units:
                unit.reshard()
        self.phase.enter(Phase.IDLE)
        self.param_slots.hold_main()
        if backward.reduces:
            self.allocator.step()
        if backward.reduces and self.requires_gradient_sync:
            self._run_grad_hooks()                # (an optimizer may step in them: the phase is IDLE)

    def _run_grad_hooks(self) -> None:
        """The user's post-accumulate-grad hooks on main parameters whose reduced gradient landed
        (grad_hooks.py, [Note: hooks on sharded parameters]); one weight refresh after them if an
        optimizer stepped inside them."""
        if self.grad_hooks.run(self.groups):
            self.weights.refresh(wait=self.capture_safe)

    def _attach_main_grads(self) -> None:
        for group in self.groups:
            if self.backward_steps is None:
                group.attach_main_grads(none_if_unused=self.unused_grads_are_none)
            else:                                 # (a group stepping on its thread: the thread does)
                self.backward_steps.attach(group, self.unused_grads_are_none)
            group.grads.hand_to_views()
        self.main_grads_attached = True
        if self.check_for_nan_in_grad:
            self._check_grads_finite()

    def _check_grads_finite(self) -> None:
        for group in self.groups:
            for name, main in zip(group.param_names, group.main_params):
                grad = local_piece(main.grad)
                if grad is not None and grad.numel() and not bool(torch.isfinite(grad).all()):
                    bad = "NaN" if bool(torch.isnan(grad).any()) else "Inf"
                    raise RuntimeError(
                        f"{bad} in the reduced gradient of parameter {name!r} on data-parallel rank "
                        f"{self.comm.rank} (strategy {self.strategy.name}); check the loss and learning rate.")

    # ------------------------------------------------------------------ between backward and step
    def before_optimizer_step(self, optimizer, stepped: set, args, kwargs) -> None:
        """``optimizer`` (holding the main parameters ``stepped``) begins its step (optimizer_hook.py)."""
        uploaded: set = set()
        if self.backward_steps is not None:
            # (groups the thread stepped and uploaded already: this step leaves them as they are)
            uploaded = self.backward_steps.before_step(optimizer, stepped, args, kwargs)
        self.check_ready_for_optimizer_step()
        self.weights.mark_changed(stepped - uploaded)

    def after_optimizer_step(self) -> None:
        self.grads_since_zero = False              # the step consumed the accumulation
        accumulation_ended(self.groups)
        if self.grad_hooks.running:                # stepped inside a user's grad hook: refresh once after them
            self.grad_hooks.refresh_due = True
        else:                                      # (capture_safe: landed within the step, [Note: a step as one CUDA graph])
            self.weights.refresh(wait=self.capture_safe)
        if self.backward_steps is not None:
            self.backward_steps.after_step()

    @property
    def between_steps(self) -> bool:
        """No forward or backward running and no gradient reduce in flight."""
        return self.phase.is_(Phase.IDLE) and not self._reduces_in_flight

    def _check_steps_idle(self, what: str) -> None:
        if self.backward_steps is not None:
            self.backward_steps.check_idle(what)

    def check_ready_for_optimizer_step(self) -> None:
        """Called before an optimizer steps our main weights: its gradients must be final."""
        if self.phase.is_(Phase.BACKWARD) or self._reduces_in_flight:
            raise RuntimeError(
                "optimizer.step() called while a gradient reduce is still pending; call "
                "model.wait_gradient_reduction() (or let backward finish) before stepping.")
        unreduced = [g.name for g in self.groups
                     if g.has_unreduced_grads or (self.replicas is not None and g.awaiting_replica_reduce)]
        if unreduced:
            raise RuntimeError(
                f"optimizer.step() called with gradients accumulated inside no_sync() but never reduced "
                f"(groups {unreduced}); run the last micro-batch's backward outside no_sync() or call "
                "model.reduce_gradients() first.")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip main grads by the global norm over all ranks' shards (grad_norm.py)."""
        self._check_steps_idle("clip_grad_norm_")
        return clip_main_grads(self.groups, self.strategy, self.comm, self.experts, max_norm, norm_type)

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient this rank holds (reduced and accumulating) by ``factor``."""
        self._check_steps_idle("scale_gradients")
        self.wait_gradient_reduces()
        for group in self.groups:
            group.scale_grads(factor)

    # ------------------------------------------------------------------ explicit gradient sync
    def start_gradient_reduction(self) -> None:
        """Issue the reduce of every group holding gradients accumulated under ``no_sync()``."""
        for group in self.groups:        # a group whose reduce is in flight has nothing unreduced
            pending = group.reducer.reduce_grad(self._shard_group_divide_factor)
            if pending is not None:
                self._reduces_in_flight.append((group, pending))

    def finish_gradient_reduction(self) -> None:
        """Make every gradient final: reduce what is still local, wait, attach. Idempotent."""
        if self.phase.is_(Phase.BACKWARD):
            raise RuntimeError("wait_gradient_reduction() called during backward; call it after backward returns.")
        self.start_gradient_reduction()
        self.wait_gradient_reduces()
        self._reduce_across_replicas()
        self._attach_main_grads()
        self._run_grad_hooks()

    def zero_grads(self, release: bool = False) -> None:
        """Zero every gradient buffer and forget which parameters got gradients (``release``: the
        ``.grad`` views were set to None; let the buffers go instead, see ParamGroup.zero_grads)."""
        if self.backward_died():
            self.reset_iteration()
            return
        self._check_steps_idle("zero_grad")
        self.wait_gradient_reduces()
        self.grad_hooks.forget()
        for group in self.groups:
            group.zero_grads(release)
        self.main_grads_attached = False
        self.grads_since_zero = False

    # ------------------------------------------------------------------ recovery
    def backward_died(self) -> bool:
        """A backward began (hooks fired) but autograd is no longer running it: it raised."""
        return self.phase.is_(Phase.BACKWARD) and torch._C._current_graph_task_id() == -1

    def reset_iteration(self) -> None:
        """Return to a clean state after an exception in forward or backward: the batch is skipped.

        Waits for the collectives already issued (every rank issued the same ones before the
        exception, when every rank raised), frees every temporary, reshards ZeRO-3 units and
        discards the gradients accumulated since the last optimizer step (a partly reduced
        micro-batch cannot be told apart from the rest), so training goes on exactly as if this
        step's batches had never been seen. Called by itself at the next forward or
        ``zero_grad()`` after a backward that raised."""
        self._check_steps_idle("a backward that raised")
        self.wait_gradient_reduces()
        for group in self.groups:
            group.wait_unshard()
            group.wait_refresh()
            group.discard_backward_state()
        for unit in self.units:
            while unit.forwards_in_flight:
                self._exit_forward(unit)
            unit.reshard()
        self.phase.reset()
        self.backward_pass = None
        self.zero_grads()
        for group in self.groups:
            for main in group.main_params:
                main.grad = None
        self.param_slots.hold_main()
        self.allocator.step()

    # ------------------------------------------------------------------ per-forward checks
    def sync_requires_grad(self) -> None:
        """Honour ``requires_grad_()`` called after wrapping (requires_grad_sync.py)."""
        sync_requires_grad(self.groups, accumulating=self.grads_since_zero)
