"""Offloaded groups stepped during backward, on a host thread (``OffloadPolicy(step_in_backward=True)``).

[Note: offloaded steps during backward]
The CPU optimizer step of offloaded groups is the longest piece of an offloaded step, and without
this it runs after backward, while the device idles. ZeRO-Offload's answer (DeepSpeed) is to step
a group's host parameters as soon as its gradients land there. Here, opted in with
``OffloadPolicy(step_in_backward=True)``, each offloaded group whose reduce
lands in a backward outside ``no_sync()`` is handed to one host thread, which waits for its
gradient copy, points the main parameters' ``.grad`` at it and steps exactly those parameters
with the user's own optimizer (its class's ``step`` below torch's step hooks, on a shallow view of
the optimizer whose param groups hold only them; the state dict is shared). ``optimizer.step()``
then waits for the thread and steps only the rest (the stepped parameters' ``.grad`` are None
during it and put back after it), so every parameter is stepped once per step, by the same code;
its post-step hook uploads every group's new weights as without this option.

It is exact, not approximate: the per-parameter update of ``torch.optim.Adam`` / ``AdamW`` / ``SGD``
does not depend on the other parameters stepped with it, provided the kernel is chosen by the user
(``fused=True`` or ``foreach`` True / False: with ``foreach=None`` torch chooses it from the
parameters stepped together, and a subset could get another kernel). What the user promises by
opting in, and what is checked at ``optimizer.step()`` (a clear error, never a silent difference):

* the backward outside ``no_sync()`` is the last before ``optimizer.step()``: a further backward,
  a forward, ``zero_grad`` or ``scale_gradients`` / ``clip_grad_norm_`` before the step raise;
  a gradient changed in place by other code (torch's ``clip_grad_norm_``, a grad scaler) is seen
  by its version counter and raises at the step (torch's foreach in-place ops on DTensor
  gradients bump no counter: with DTensor parameters ``model.clip_grad_norm_`` is the one seen);
* the optimizer's hyperparameters at the step are those the thread used (an LR scheduler steps
  after ``optimizer.step()``): compared at the step, a difference raises;
* one optimizer steps the model, a ``torch.optim`` Adam / AdamW / SGD (type checked), without a
  closure. The optimizer is learned at its first step, which runs unchanged; the thread takes over
  from the second step on.

* no weight of a stepped group is gathered again in the same backward (a weight used after its
  gradients are complete): such a gather raises rather than read the new weights (ZeRO-3).

The root unit's groups are handed over too, when their reduce lands: at the end of backward
(their gradients complete last: the thread, not the main thread, then steps and uploads them), or,
with ``reduce_root_per_child=True``, a GPT's output layer at the start of backward (its gradients
are complete first), so the thread has work from the start of backward. ZeRO-3 keeps a compute-weight shard
per group that only gathers read, and a stepped group is not gathered again before the next
forward (checked), so the thread starts its upload right after stepping it, behind the rest of
backward (waiting on the device for an event recorded when the group was handed over, after its
backward gather was queued); ``optimizer.step()`` then uploads only the rest. The other
strategies' weights go back after ``optimizer.step()`` (ZeRO-1/2's refresh is a collective,
issued in one order on every rank by the main thread; DDP's weights are the module's, read until
backward ends), as do ZeRO-3 shards released after gathers (``release_after_gather``, the root's
released after its backward gather too: an upload during backward would hold them through it).
``check_for_nan_in_grad`` models do not hand groups over (the check reads every gradient before
any step).

[Note: the stepping thread and the GIL]
The thread's CPU step is a handful of torch calls from Python (the optimizer's bookkeeping, the
step counters, the fused kernel), each giving up the GIL while it runs and taking it back after.
Meanwhile autograd's thread runs the backward's Python hooks. Python hands the GIL to a waiting
thread only every ``sys.getswitchinterval()`` (5 ms by default), so each time the stepping thread
comes back from a kernel it can wait up to 5 ms for the hooks' thread: measured on one H200 host
(docs/benchmarks_history.md, "Offload, 2026-12-03 afternoon"), a 50M-parameter fused AdamW step
took 12 ms alone, 27-36 ms beside a busy Python thread and 15 ms with a 0.2 ms interval. (In a GPT's backward on that host
the interval made no difference beyond run-to-run noise, the hooks' thread giving the GIL up
often; a loop with longer Python stretches beside backward gets the difference.) So while
groups are handed over (from the first hand-over to ``optimizer.step()``'s wait) the interpreter's
switch interval is lowered to ``STEP_SWITCH_INTERVAL_S`` and then put back as it was (only if
nothing else changed it meanwhile); with several models stepping at once it goes back when the
last one waits.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..comm.thread_shutdown import join_thread, shut_down_at_exit
from .host_link import HostLink
from .policy import OffloadPolicy

if TYPE_CHECKING:
    from ..group.param_group import ParamGroup
    from ..runtime.engine import Engine

__all__ = ["BackwardSteps", "GroupStepRecord", "check_steppable", "install_backward_steps"]

_STEPPABLE = ("Adam", "AdamW", "SGD")

# [Note: the stepping thread and the GIL]: the longest wait for the GIL while groups step on the thread
STEP_SWITCH_INTERVAL_S = 2e-4


class _SwitchInterval:
    """The interpreter's GIL switch interval, lowered while any model's groups step on a thread."""

    _lock = threading.Lock()
    _holders = 0
    _saved: Optional[float] = None

    @classmethod
    def lower(cls) -> None:
        with cls._lock:
            if cls._holders == 0:
                cls._saved = sys.getswitchinterval()
                if STEP_SWITCH_INTERVAL_S < cls._saved:
                    sys.setswitchinterval(STEP_SWITCH_INTERVAL_S)
            cls._holders += 1

    @classmethod
    def restore_if(cls, lowered: list) -> None:
        if lowered[0]:
            lowered[0] = False
            cls.restore()

    @classmethod
    def restore(cls) -> None:
        with cls._lock:
            cls._holders -= 1
            if cls._holders == 0 and cls._saved is not None:
                if abs(sys.getswitchinterval() - min(STEP_SWITCH_INTERVAL_S, cls._saved)) < 1e-6:
                    sys.setswitchinterval(cls._saved)     # (left alone if someone else set it meanwhile)
                cls._saved = None


@dataclass(frozen=True)
class GroupStepRecord:
    """One group the thread stepped, as an observer added with ``BackwardSteps.add_observer`` sees it
    (a profiler printed them as a timeline: docs/benchmarks_history.md, "Offload, 2026-12-03").
    Times are ``time.perf_counter()``.

    Attributes:
        group: the group's name.
        handed_over: when backward handed the group over (None: the observer came later).
        handed_event: the timing event recorded on the compute stream at the hand-over (when the
            device finished the group's backward); None without an observer then, or on CPU.
        began, copied, attached, stepped, upload_started: when the thread took the group, its
            gradient copy had landed on the host, its ``.grad`` were attached, its step ended and its
            upload was started.
        uploaded: whether the thread started the group's upload (ZeRO-3).
    """

    group: str
    handed_over: Optional[float]
    handed_event: Any
    began: float
    copied: float
    attached: float
    stepped: float
    upload_started: float
    uploaded: bool


def check_steppable(optimizer, args, kwargs) -> None:
    """Raise unless ``optimizer`` steps a subset of its parameters exactly as part of a full step."""
    name = type(optimizer).__name__
    if type(optimizer) not in tuple(getattr(torch.optim, n) for n in _STEPPABLE):
        raise ValueError(f"offload: OffloadPolicy(step_in_backward=True) steps groups with the optimizer's own "
                         f"per-parameter update, which it knows exact for torch.optim {', '.join(_STEPPABLE)}; "
                         f"got {type(optimizer).__module__}.{name}. Use one of them or step_in_backward=False.")
    if args or kwargs.get("closure") is not None:
        raise ValueError(f"offload: OffloadPolicy(step_in_backward=True) cannot step {name} with a closure.")
    for index, group in enumerate(optimizer.param_groups):
        if group.get("differentiable") or not (group.get("fused") or group.get("foreach") is not None):
            raise ValueError(
                f"offload: OffloadPolicy(step_in_backward=True) needs {name}'s kernel chosen explicitly in "
                f"every param group (fused=True, or foreach=True / False), got fused={group.get('fused')!r}, "
                f"foreach={group.get('foreach')!r}, differentiable={group.get('differentiable')!r} in group "
                f"{index}: with foreach=None torch picks the kernel from the parameters stepped together.")


def install_backward_steps(engine: "Engine", policy: Optional[OffloadPolicy]) -> None:
    """Give ``engine`` its thread if ``policy`` opts in and some group is offloaded."""
    link = next((g.offloaded.link for g in engine.groups if g.offloaded is not None), None)
    if policy is not None and policy.step_in_backward and link is not None:
        engine.backward_steps = BackwardSteps(link, policy.step_threads)


def _hyperparameters(optimizer) -> list:
    return [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a.cpu(), b.cpu())
    return a == b


def _step_subset(optimizer, params: list) -> None:
    """``optimizer``'s own step over ``params`` only: its class's step (below torch's hooks, which
    belong to the user's full step) on a shallow view whose param groups hold just these."""
    ids = {id(p) for p in params}
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)          # shares ``state``: the update lands there
    view.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in ids]) for g in optimizer.param_groups]
    type(optimizer).step.__wrapped__(view)


class _Attached:
    """A group's ``.grad`` as backward (or the thread) left them: what ``optimizer.step()`` checks,
    and for a group stepped on the thread (``hyper``: the hyperparameters it used) puts back."""

    def __init__(self, group: "ParamGroup") -> None:
        self.group = group
        self.hyper: Optional[list] = None      # set by the thread when it steps the group
        self.grads = [m.grad for m in group.main_params]
        self.versions = self._versions()

    def _versions(self) -> list:
        """The gradient buffer's version and each ``.grad``'s (a DTensor's in-place ops bump its own)."""
        buffer = self.group.offloaded.grad if self.group.offloaded is not None else self.group.grads.live()
        grads = [m.grad for m in self.group.main_params]
        return [None if buffer is None else buffer._version] + [None if g is None else g._version for g in grads]

    def changed(self) -> bool:
        return any(m.grad is not g for m, g in zip(self.group.main_params, self.grads)) or \
            self._versions() != self.versions


class BackwardSteps:
    """The host thread stepping offloaded groups during backward, and what the step checks."""

    def __init__(self, link: HostLink, threads: Optional[int] = None) -> None:
        self.link = link
        self.threads = threads
        self._optimizer: Optional[weakref.ref] = None
        self._optimizer_ids: set = set()
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._stepped: dict = {}               # id(group) -> _Attached, stepped since the last optimizer.step()
        self._others: list = []                # _Attached of the groups left to optimizer.step()
        self._handed: set = set()              # ids of groups handed to the thread in this backward
        self._attached: dict = {}              # id(group) -> _Attached: handed groups whose .grad are attached
        self._attach_lock = threading.Lock()   # the thread and the end of backward attach handed groups
        self._error: Optional[BaseException] = None
        self._last_upload = None               # OffloadedGroup of the thread's last upload
        # profilers' callbacks, each called with a GroupStepRecord per group the thread steps; with
        # none the thread takes no timestamps and records no events
        self._observers: list = []
        self._lowered = [False]                # the switch interval is lowered for this backward's hand-overs
        # ends the thread with this object (at exit thread_shutdown.py joins it first)
        weakref.finalize(self, self._queue.put, None).atexit = False
        weakref.finalize(self, _SwitchInterval.restore_if, self._lowered)   # a model dropped mid-step

    @property
    def optimizer(self):
        return self._optimizer() if self._optimizer is not None else None

    def add_observer(self, observer: Callable[[GroupStepRecord], None]) -> Callable[[], None]:
        """Call ``observer`` (on the stepping thread) with each group it steps from now on; returns
        the function that removes it. For profilers and benchmarks: the step path records nothing
        while no observer is added."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    # -- the backward's side (autograd's thread) -------------------------------------------------
    def hand_over(self, group: "ParamGroup", unused_grads_are_none: bool) -> bool:
        """Step ``group`` on the thread if it may (its gradients for this step just landed)."""
        optimizer = self.optimizer
        if optimizer is None or group.offloaded is None or id(group) in self._handed \
                or not all(id(m) in self._optimizer_ids for m in group.main_params):
            return False
        if not self._handed:
            _SwitchInterval.lower()
            self._lowered[0] = True
        self._handed.add(id(group))
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(self._queue, weakref.ref(self), self.link.device,
                                                                self.threads),
                                            name="megatron_fsdp_v2 offloaded steps", daemon=True)
            self._thread.start()
            shut_down_at_exit(self)      # [Note: threads at exit]
        # the group's last device reads of its compute shard (its backward gather) are queued by now
        observed = bool(self._observers)
        handed_at = self.link.compute_event(timing=observed)
        stamp = (time.perf_counter(), handed_at) if observed else None
        self._queue.put((group, optimizer, unused_grads_are_none, handed_at, stamp))
        return True

    def attach(self, group: "ParamGroup", unused_grads_are_none: bool) -> None:
        """End of backward: attach ``group``'s ``.grad``. A handed-over group's too, once its
        gradients landed on the host (unless the thread was first), so that between backward and
        ``optimizer.step()`` every ``.grad`` is there and final, whether the thread stepped its
        group yet or not, and a change to it is seen at the step; while some group steps on the
        thread, note the others' too."""
        if id(group) in self._handed:
            self._attach_handed(group, unused_grads_are_none)
            return
        group.attach_main_grads(none_if_unused=unused_grads_are_none)
        if self._handed:
            self._others.append(_Attached(group))

    def _attach_handed(self, group: "ParamGroup", unused_grads_are_none: bool) -> "_Attached":
        """Wait for a handed-over group's gradients to land and attach them, once per backward
        (whichever of the thread and the end of backward comes first)."""
        # wait outside the lock: the end of backward attaching one group must not hold the thread
        # back from another whose gradients landed already (before, the thread waited on the lock
        # while the end of backward waited for the last groups' copies: a 120 ms stall at 941M)
        group.offloaded.wait_landed()
        return self._attach_landed(group, unused_grads_are_none)

    def _attach_landed(self, group: "ParamGroup", unused_grads_are_none: bool) -> "_Attached":
        """``_attach_handed`` once the group's gradient copies have landed."""
        with self._attach_lock:
            record = self._attached.get(id(group))
            if record is None:
                group.offloaded.flush()
                group.attach_main_grads(none_if_unused=unused_grads_are_none)
                record = self._attached[id(group)] = _Attached(group)
            return record

    def _run(self, group: "ParamGroup", optimizer, unused_grads_are_none: bool, handed_at, stamp) -> None:
        if self._error is not None:
            return
        try:
            clock = _clock if self._observers else _no_clock
            began = clock()
            group.offloaded.wait_landed()
            copied = clock()
            record = self._attach_landed(group, unused_grads_are_none)
            attached = clock()
            record.hyper = _hyperparameters(optimizer)
            group.offloaded.stepped_early = True
            with torch.no_grad():
                _step_subset(optimizer, list(group.main_params))
            self._stepped[id(group)] = record
            stepped = clock()
            uploads = group.offloading.uploads_when_stepped_in_backward
            if uploads:
                # one upload in flight: its device copy in the main dtype is the only one backward holds
                if self._last_upload is not None:
                    self._last_upload.wait_upload_on_host()
                group.offloading.start_upload(after=handed_at)
                self._last_upload = group.offloaded
            if self._observers:
                handed, event = stamp or (None, None)      # (None, None): handed over before an observer came
                report = GroupStepRecord(group.name, handed, event, began, copied, attached, stepped, clock(), uploads)
                for observer in list(self._observers):
                    observer(report)
        except BaseException as exc:   # noqa: BLE001 -- raised in the main thread at the next wait
            self._error = exc

    # -- the main thread's side ------------------------------------------------------------------
    def shut_down(self) -> None:
        """End the thread once the groups handed to it are stepped, and wait until it has exited
        (destroy_process_group, interpreter exit: thread_shutdown.py, [Note: threads at exit]); the
        next hand-over starts a new one. What it held (its last upload) goes with it."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        join_thread(thread)
        self._last_upload = None

    def wait(self) -> None:
        """Wait for every handed-over group; raise what the thread raised."""
        if self._thread is not None:
            self._queue.join()
        if self._lowered[0]:
            self._lowered[0] = False
            _SwitchInterval.restore()
        self._handed.clear()
        self._attached.clear()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("offload: stepping an offloaded group during backward failed") from error

    def check_idle(self, what: str) -> None:
        """Raise if groups were stepped with this step's gradients and ``optimizer.step()`` did not run yet."""
        self.wait()
        if self._stepped:
            names = [s.group.name for s in self._stepped.values()]
            raise RuntimeError(
                f"offload: {what} after OffloadPolicy(step_in_backward=True) stepped groups {names[:3]}"
                f"{'...' if len(names) > 3 else ''} with the last backward's gradients and before "
                "optimizer.step(): that backward must be the last before the step, and the gradients "
                "must stay as it left them (no clipping or scaling; use step_in_backward=False for that).")

    def before_step(self, optimizer, stepped_ids: set, args, kwargs) -> set:
        """``optimizer.step()`` begins: wait, check, hide the stepped groups' ``.grad``; returns the
        ids of the main parameters whose new weights the thread uploaded already."""
        self.wait()
        if self.optimizer is not optimizer:
            if self.optimizer is not None:
                raise ValueError(f"offload: OffloadPolicy(step_in_backward=True) needs one optimizer over the "
                                 f"model's parameters; {type(optimizer).__name__} steps some of them besides the "
                                 f"{type(self.optimizer).__name__} that stepped them first.")
            check_steppable(optimizer, args, kwargs)
            self._optimizer = weakref.ref(optimizer)
        elif args or kwargs.get("closure") is not None:
            check_steppable(optimizer, args, kwargs)
        self._optimizer_ids = set(stepped_ids)
        others, self._others = self._others, []
        for record in others + list(self._stepped.values()):
            if record.changed():
                when = "after it stepped during backward" if record.hyper is not None else \
                    "after backward while other groups had stepped during it"
                raise RuntimeError(f"offload: the gradients of group {record.group.name} changed {when} "
                                   "(OffloadPolicy(step_in_backward=True)): clipping or scaling them needs "
                                   "step_in_backward=False.")
        now = _hyperparameters(optimizer) if self._stepped else None
        for record in self._stepped.values():
            if len(now) != len(record.hyper) or any(set(a) != set(b) or not all(_same(a[k], b[k]) for k in a)
                                                    for a, b in zip(now, record.hyper)):
                raise RuntimeError(
                    "offload: the optimizer's hyperparameters changed between the step of the offloaded groups "
                    "during backward and optimizer.step() (OffloadPolicy(step_in_backward=True)); change them "
                    "after optimizer.step() (as LR schedulers do).")
        uploaded = set()
        for record in self._stepped.values():
            for main in record.group.main_params:
                main.grad = None
            if record.group.offloading.uploads_when_stepped_in_backward:      # (the thread uploaded it)
                uploaded.update(id(main) for main in record.group.main_params)
        return uploaded

    def after_step(self) -> None:
        """Put the stepped groups' ``.grad`` back; the next backward's groups start afresh."""
        stepped, self._stepped = self._stepped, {}
        self._last_upload = None
        for record in stepped.values():
            record.group.offloaded.stepped_early = False
            for main, grad in zip(record.group.main_params, record.grads):
                main.grad = grad


_clock = time.perf_counter


def _no_clock() -> float:
    return 0.0


def _work(tasks: "queue.Queue", owner: "weakref.ref", device: torch.device, threads: Optional[int]) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    while True:
        task = tasks.get()
        try:
            if task is None:
                return
            steps = owner()
            if steps is not None:
                steps._run(*task)
            del steps, task
        finally:
            tasks.task_done()
