"""Offloaded groups stepped during backward (offload/backward_steps.py, [Note: offloaded steps during backward]).

Bitwise the same training as without offload (fp32, dp 2, gradient accumulation under no_sync,
AdamW fused and SGD with momentum on foreach=False), the thread really stepping groups, and every
broken promise (clipping, a changed learning rate, a second backward, an optimizer whose kernel
torch would choose per subset) refused with an error naming it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_fsdp_v2 import OffloadPolicy, fully_shard
from testing.thread_steps import observe_thread_steps

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn

STRATEGIES = ("optim_grads_params", "optim")


def _wrap(strategy, fraction, step_in_backward, dtensor_params=True):
    torch.manual_seed(0)
    offload = None if fraction is None else OffloadPolicy(fraction=fraction, step_in_backward=step_in_backward)
    return fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], offload=offload,
                       dtensor_params=dtensor_params)


def _optimizer(model, kind):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)


def _backward(model, rank, step, k=2):
    for i, (x, y) in enumerate(make_batches(step, rank, k)):
        with (model.no_sync() if i < k - 1 else contextlib.nullcontext()):
            loss_fn(model(x), y).backward()


def _train(model, opt, rank, steps=3):
    for step in range(steps):
        _backward(model, rank, step)
        opt.step()
        opt.zero_grad()


def parity_worker(rank, world_size):
    out = {}
    for strategy in STRATEGIES:
        for kind in ("adamw", "sgd"):
            for fraction, step_in_backward in ((None, False), (0.5, True), (1.0, True)):
                model = _wrap(strategy, fraction, step_in_backward)
                opt = _optimizer(model, kind)
                stepped = observe_thread_steps(model)
                _train(model, opt, rank)
                engine = model._fsdp_engine
                handed = sum(g.offloaded is not None for g in engine.groups)     # the root's too
                out[(strategy, kind, fraction)] = (model.full_state_dict(), len(stepped), handed)
                if engine.backward_steps is not None:
                    fresh = _uploaded_before_step(model, rank)       # one more backward: its groups too
                    out[(strategy, kind, fraction, "uploaded")] = (sum(r.uploaded for r in stepped), fresh)
    return out


def _uploaded_before_step(model, rank):
    """After one more backward, before ``optimizer.step()``: per offloaded group (the root's too),
    whether its device compute shard already holds the host's new main weights."""
    engine = model._fsdp_engine
    _backward(model, rank, 3)
    engine.backward_steps.wait()
    return [torch.equal(g.offloaded.compute_shard, g.main_shard.to(g.offloaded.compute_shard.dtype))
            for g in engine.groups if g.offloaded is not None and g.offloaded.compute_shard is not None]


def test_groups_stepped_during_backward_train_bitwise_alike():
    for result in run_distributed(parity_worker, 2):
        for strategy in STRATEGIES:
            for kind in ("adamw", "sgd"):
                want, _, _ = result[(strategy, kind, None)]
                for fraction in (0.5, 1.0):
                    got, stepped, handed = result[(strategy, kind, fraction)]
                    assert all(torch.equal(got[n], want[n]) for n in want), (strategy, kind, fraction)
                    # steps 2 and 3 (the first teaches the optimizer), every offloaded group, the root's too
                    assert 0 < handed <= 4 and stepped == 2 * handed, (strategy, kind, fraction, stepped)
                assert result[(strategy, kind, 0.5)][2] < result[(strategy, kind, 1.0)][2] == 4
                # ZeRO-3: the thread uploads each group it stepped at once (ZeRO-1 refreshes after the step)
                uploaded, fresh = result[(strategy, kind, 1.0, "uploaded")]
                if strategy == "optim_grads_params":
                    assert uploaded == result[(strategy, kind, 1.0)][1] + 4 and fresh == [True] * 4, (kind, uploaded)
                else:
                    assert uploaded == 0 and fresh == [], (strategy, kind, uploaded, fresh)


def _error_of(action) -> str:
    try:
        action()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def errors_worker(rank, world_size):
    out = {}

    def trained(kind="adamw", dtensor_params=True, fraction=1.0):
        model = _wrap("optim_grads_params", fraction, True, dtensor_params)
        opt = _optimizer(model, kind)
        _train(model, opt, rank, steps=1)
        _backward(model, rank, 1)
        return model, opt

    model, opt = trained()
    out["clip"] = _error_of(lambda: model.clip_grad_norm_(1.0))
    # torch's clip: its foreach in-place ops bump plain tensors' version counters (not a DTensor's)
    model, opt = trained(dtensor_params=False)
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters()], 1e-3)
    out["torch clip"] = _error_of(opt.step)
    model, opt = trained(fraction=0.5)
    next(iter(model.parameters())).grad.mul_(0.5)          # the root's, not offloaded: left to the step
    out["in place"] = _error_of(opt.step)
    model, opt = trained()
    next(iter(model.parameters())).grad.mul_(0.5)          # the root's, offloaded: stepped on the thread
    out["in place, stepped"] = _error_of(opt.step)
    model, opt = trained()
    opt.param_groups[0]["lr"] = 0.5
    out["lr"] = _error_of(opt.step)
    model, opt = trained()
    out["next micro-batch"] = _error_of(lambda: _backward(model, rank, 2))
    model, opt = trained()
    out["zero_grad"] = _error_of(model.zero_grad)
    model = _wrap("optim_grads_params", 1.0, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _backward(model, rank, 0)
    out["foreach None"] = _error_of(opt.step)
    model, opt = trained()
    params = list(model.parameters())
    second = torch.optim.SGD(params[:1], lr=1e-2, foreach=False)
    opt.step()
    out["second optimizer"] = _error_of(second.step)
    model = _wrap("optim_grads_params", 1.0, True)
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    _backward(model, rank, 0)
    out["adagrad"] = _error_of(opt.step)
    return out


@pytest.fixture(scope="module")
def errors():
    return run_distributed(errors_worker, 2)[0]


@pytest.mark.parametrize("case, message", [
    ("clip", "RuntimeError: offload: clip_grad_norm_ after OffloadPolicy(step_in_backward=True) stepped groups"),
    ("torch clip", "RuntimeError: offload: the gradients of group"),
    ("in place", "RuntimeError: offload: the gradients of group <root>/float32/grad changed after backward while "
                 "other groups had stepped during it"),
    ("in place, stepped", "RuntimeError: offload: the gradients of group <root>/float32/grad changed after it "
                          "stepped during backward (OffloadPolicy(step_in_backward=True)): clipping or scaling them "
                          "needs step_in_backward=False."),
    ("lr", "RuntimeError: offload: the optimizer's hyperparameters changed between the step of the offloaded"),
    ("next micro-batch", "RuntimeError: offload: a forward after OffloadPolicy(step_in_backward=True) stepped groups "
                         "['blocks.2/float32/grad', 'blocks.1/float32/grad', 'blocks.0/float32/grad']... with the last "
                         "backward's gradients and before optimizer.step()"),
    ("zero_grad", "RuntimeError: offload: zero_grad after OffloadPolicy(step_in_backward=True) stepped groups"),
    ("foreach None", "ValueError: offload: OffloadPolicy(step_in_backward=True) needs AdamW's kernel chosen "
                     "explicitly in every param group (fused=True, or foreach=True / False), got fused=None"),
    ("second optimizer", "ValueError: offload: OffloadPolicy(step_in_backward=True) needs one optimizer over the "
                         "model's parameters; SGD steps some of them besides the AdamW that stepped them first."),
    ("adagrad", "ValueError: offload: OffloadPolicy(step_in_backward=True) steps groups with the optimizer's own "
                "per-parameter update, which it knows exact for torch.optim Adam, AdamW, SGD; got "
                "torch.optim.adagrad.Adagrad"),
])
def test_broken_promises_are_refused_naming_them(errors, case, message):
    assert errors[case].startswith(message), errors[case]


def test_step_in_backward_must_be_a_bool():
    with pytest.raises(TypeError, match=r"OffloadPolicy\.step_in_backward must be True or False, got 1"):
        OffloadPolicy(step_in_backward=1)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_step_threads_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"OffloadPolicy\.step_threads must be None or a positive int, got"):
        OffloadPolicy(step_in_backward=True, step_threads=bad)


def switch_interval_worker(rank, world_size):
    """Python's GIL switch interval: lowered from the first hand-over to optimizer.step()'s wait,
    then back ([Note: the stepping thread and the GIL]); left alone when someone else changed it;
    back when a model is dropped between its backward and its step."""
    import gc
    import sys
    import time
    from megatron_fsdp_v2.offload.backward_steps import STEP_SWITCH_INTERVAL_S
    base = sys.getswitchinterval()
    model = _wrap("optim_grads_params", 1.0, True)
    opt = _optimizer(model, "adamw")
    _train(model, opt, rank, steps=1)                  # the first step teaches the optimizer
    seen = {"before backward": sys.getswitchinterval()}
    _backward(model, rank, 1)
    seen["between backward and step"] = sys.getswitchinterval()
    opt.step()
    seen["after step"] = sys.getswitchinterval()
    opt.zero_grad()
    _backward(model, rank, 2)
    sys.setswitchinterval(0.001)                       # the user's own setting, made meanwhile
    opt.step()
    seen["user's setting kept"] = sys.getswitchinterval()
    sys.setswitchinterval(base)
    opt.zero_grad()
    _backward(model, rank, 3)
    del model, opt
    for _ in range(100):                               # the thread may still hold the last group
        gc.collect()
        if sys.getswitchinterval() == base:
            break
        time.sleep(0.05)
    seen["model dropped after backward"] = sys.getswitchinterval()
    return base, STEP_SWITCH_INTERVAL_S, seen


def test_switch_interval_lowered_only_while_groups_step_on_the_thread():
    for base, lowered, seen in run_distributed(switch_interval_worker, 2):
        assert lowered < base == 0.005, (lowered, base)
        assert seen == {"before backward": base, "between backward and step": pytest.approx(lowered),
                        "after step": base, "user's setting kept": 0.001, "model dropped after backward": base}, seen


def grads_after_backward_worker(rank, world_size):
    """Right after backward returns (the thread may still be stepping, the root's group last),
    every ``.grad`` is attached and holds the reduced gradient, as without offload."""
    out = {}
    for fraction in (None, 1.0):
        model = _wrap("optim_grads_params", fraction, fraction is not None)
        opt = _optimizer(model, "adamw")
        _train(model, opt, rank, steps=1)
        _backward(model, rank, 1)
        out[fraction] = [None if p.grad is None else p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
    return out


def test_grads_are_attached_and_final_when_backward_returns():
    for result in run_distributed(grads_after_backward_worker, 2):
        want, got = result[None], result[1.0]
        assert len(got) == len(want) and all(g is not None for g in got), [g is None for g in got]
        assert all(torch.equal(g, w) for g, w in zip(got, want)), [torch.equal(g, w) for g, w in zip(got, want)]


class _CopyInFlight:
    """Stands in for a device event of a gradient copy: ``synchronize`` blocks until released."""

    def __init__(self) -> None:
        import threading
        self.waiting, self.done = threading.Event(), threading.Event()

    def synchronize(self) -> None:
        self.waiting.set()
        self.done.wait(10)


class _Landing:
    """A handed-over group as BackwardSteps sees it: an offloaded group with a copy in flight."""

    def __init__(self, link) -> None:
        from megatron_fsdp_v2.offload.host_link import OffloadedGroup
        self.offloaded = OffloadedGroup(link, 4, torch.float32, 0, torch.float32)
        self.main_params = []

    def attach_main_grads(self, none_if_unused: bool) -> None:
        pass


def test_a_group_whose_copy_landed_attaches_while_another_still_waits():
    # The end of backward attaches every handed-over group; waiting for one group's copy while
    # holding the attach lock kept the stepping thread from a group whose copy had landed long
    # before (941M GPT, f = 1: layer 14 "landed" 120 ms late, the rest at once after it).
    import threading
    from megatron_fsdp_v2.offload.host_link import HostLink
    from megatron_fsdp_v2.offload.backward_steps import BackwardSteps
    link = HostLink(torch.device("cpu"), OffloadPolicy(fraction=1.0))
    steps = BackwardSteps(link)
    slow, landed = _Landing(link), _Landing(link)
    copy = _CopyInFlight()
    slow.offloaded._pending.append((copy, None))
    waiter = threading.Thread(target=steps._attach_handed, args=(slow, False))
    waiter.start()
    assert copy.waiting.wait(10)
    attached = threading.Event()
    other = threading.Thread(target=lambda: (steps._attach_handed(landed, False), attached.set()))
    other.start()
    assert attached.wait(5), "a landed group waited for another group's copy"
    assert id(landed) in steps._attached and id(slow) not in steps._attached
    copy.done.set()
    waiter.join(10)
    other.join(10)
    assert set(steps._attached) == {id(slow), id(landed)}


def release_worker(rank, world_size):
    out = {}
    for release in (None, False, True):
        torch.manual_seed(0)
        offload = None if release is None else OffloadPolicy(fraction=1.0, step_in_backward=True,
                                                               release_after_gather=release)
        model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                            offload=offload)
        opt = _optimizer(model, "adamw")
        stepped = observe_thread_steps(model)
        _train(model, opt, rank)
        out[release] = (model.full_state_dict(), len(stepped), sum(r.uploaded for r in stepped))
    return out


def test_released_shards_come_back_from_the_thread_except_the_roots():
    # With release_after_gather a non-root unit's compute shard goes up as soon as the thread
    # stepped it (behind backward, past its peak), not after optimizer.step(); the root's, freed at
    # the start of backward where the peak is, after the step. Steps 2 and 3: 3 blocks + the root.
    for result in run_distributed(release_worker, 2):
        want = result[None][0]
        for release in (False, True):
            got, stepped, uploaded = result[release]
            assert all(torch.equal(got[n], want[n]) for n in want), release
            assert stepped == 2 * 4, (release, stepped)
        assert result[False][2] == 2 * 4 and result[True][2] == 2 * 3, (result[False][2], result[True][2])


def observer_worker(rank, world_size):
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                        offload=OffloadPolicy(fraction=1.0, step_in_backward=True))
    opt = _optimizer(model, "adamw")
    _train(model, opt, rank, steps=1)                   # the first step learns the optimizer: no thread
    records: list = []
    remove = model._fsdp_engine.backward_steps.add_observer(records.append)
    _train(model, opt, rank, steps=2)
    remove()
    _train(model, opt, rank, steps=1)                   # stepped on the thread, unobserved
    return [(r.group, r.uploaded, r.handed_over is not None,
             r.handed_over <= r.began <= r.copied <= r.attached <= r.stepped <= r.upload_started) for r in records]


def test_the_thread_reports_each_group_step_to_its_observers_only():
    """The profiler hook that replaced the thread's counters and timeline: one record per group step
    (3 blocks and the root, 2 steps), times in order, nothing once removed."""
    for records in run_distributed(observer_worker, 2):
        assert len(records) == 2 * 4, records
        assert all(handed and ordered for _, _, handed, ordered in records), records
        assert all(uploaded for _, uploaded, _, _ in records), records       # ZeRO-3 uploads each at once
        assert len({group for group, *_ in records}) == 4, records
