"""``plan`` with bf16 compute and CPU offload against what the engine really holds: every storage
alive after the step (not only ``persistent_bytes()``, which could share a mistake with the plan),
device and host bytes by kind, the host-link copies of one step, and our bytes at the moments the
activation-aware peak adds activations to ([Note: the peak with activations]); dp 1 and 2, every
strategy, offload fractions 0, 0.5 and 1; and the choice among offload fractions."""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
import torch.distributed.tensor
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp_v2 import STRATEGY_NAMES, MixedPrecisionPolicy, OffloadPolicy, fully_shard, plan
from megatron_fsdp_v2.offload.host_link import HostLink
from megatron_fsdp_v2.row_sharded import local_piece
from testing.settled import settled

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches

K = 2
FRACTIONS = (0.0, 0.5, 1.0)
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
HOST = ("host_main_weights", "host_grads", "host_grad_staging")


def _storages() -> dict:
    """data_ptr -> (bytes, the tensor in words) of every tensor storage Python can reach (DTensors:
    their local piece), but a DeviceMesh's own rank table."""
    out, meshes = {}, []
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            meshes.append(obj.mesh.untyped_storage().data_ptr())
        if type(obj) in (torch.Tensor, torch.nn.Parameter) or isinstance(obj, torch.distributed.tensor.DTensor):
            tensor = getattr(obj, "_local_tensor", obj)
            if tensor.device.type != "meta" and tensor.untyped_storage().nbytes():
                nbytes = tensor.untyped_storage().nbytes()
                out[tensor.untyped_storage().data_ptr()] = (nbytes, f"{type(obj).__name__}{tuple(obj.shape)} {obj.dtype}")
    for ptr in meshes:
        out.pop(ptr, None)
    return out


def _count_copies(counts: dict):
    """HostLink.copy, counting (calls, bytes) of what crosses: gradients landing on the host during
    backward, weights sent back after the optimizer's step (its own post-hook flips ``after_step``
    before the engine's global one uploads)."""
    original = HostLink.copy

    def copy(self, dst, make_src, upload=False, after=None):
        src = make_src()
        assert upload == counts["after_step"], "an upload outside the step's post-hook, or a landing inside it"
        kind = counts["h2d_weights" if upload else "d2h_grads"]
        kind["count"] += 1
        kind["bytes"] += src.numel() * src.element_size()
        return original(self, dst, lambda: src, upload=upload, after=after)
    return copy


def _state_bytes(model, opt) -> tuple:
    """(device, host) optimizer-state bytes, by where each group's main weights live."""
    device = host = 0
    for group in model._fsdp_engine.groups:
        for main in group.main_params:
            nbytes = sum(local_piece(t).numel() * t.element_size() for key, t in opt.state.get(main, {}).items()
                         if key != "step")
            if group.offloaded is None:
                device += nbytes
            else:
                host += nbytes
    return device, host


def _step(model, opt, rank, step, k):
    for i, (x, y) in enumerate(make_batches(step, rank, k)):
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            ((model(x.bfloat16()).float() - y) ** 2).mean().backward()
    opt.step()


def _measure(rank, strategy, fraction, before):
    """Step 2 of K micro-batches: kinds, real storage (above ``before``), copies."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block], mixed_precision=POLICY,
                        offload=OffloadPolicy(fraction=fraction))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts = {"after_step": False, "d2h_grads": {"count": 0, "bytes": 0}, "h2d_weights": {"count": 0, "bytes": 0}}
    _step(model, opt, rank, 0, K)
    opt.zero_grad()
    opt.register_step_post_hook(lambda *args: counts.__setitem__("after_step", True))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HostLink, "copy", _count_copies(counts))
        _step(model, opt, rank, 1, K)
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    new = [item for ptr, item in settled(_storages).items() if ptr not in before]
    real = sum(nbytes for nbytes, _ in new) - steps
    device_state, host_state = _state_bytes(model, opt)
    counts.pop("after_step")
    out = {"kept": model.persistent_bytes(), "state": (device_state, host_state), "real": real, "copies": counts,
           "storages": sorted(new)}
    del model, opt
    gc.collect()
    return out


def _worker(rank, world_size):
    """Every case after each strategy ran once (whatever torch makes once per process), above one
    settled baseline: each case frees its model, so a storage not in the baseline is the case's own."""
    gc.collect()
    for strategy in STRATEGY_NAMES:
        _measure(rank, strategy, 0.0, _storages())
    _measure(rank, "optim_grads_params", 1.0, _storages())
    before = settled(_storages)
    return {(s, f): _measure(rank, s, f, before) for s in STRATEGY_NAMES for f in FRACTIONS}


@functools.lru_cache(maxsize=None)
def _measured(world_size):
    return run_distributed(_worker, world_size)


def _planned(world_size, strategy, fraction, micro_batches=K, **kwargs):
    with torch.device("meta"):
        model = UnevenNet()
    return plan(model, strategy, world_size=world_size, unit_modules=[Block], mixed_precision=POLICY,
                optimizer="adamw", micro_batches=micro_batches, device="cpu",
                offload=OffloadPolicy(fraction=fraction), **kwargs).candidates[0]


CASES = [(w, s, f) for w in (1, 2) for s in STRATEGY_NAMES for f in FRACTIONS]


@pytest.mark.parametrize("world_size,strategy,fraction", CASES, ids=[f"dp{w}-{s}-f{f:g}" for w, s, f in CASES])
def test_plan_equals_real_storage_and_host_bytes_with_bf16_and_offload(world_size, strategy, fraction):
    planned = _planned(world_size, strategy, fraction)
    for rank, results in enumerate(_measured(world_size)):
        got, want = results[(strategy, fraction)], planned.ranks[rank]
        kept = got["kept"]
        assert {k: kept[k] for k in ("model_weights", "main_weights", "grads")} == \
               {k: want[k] for k in ("model_weights", "main_weights", "grads")}, rank
        assert {k: kept.get(k, 0) for k in HOST} == {k: want[k] for k in HOST}, rank
        assert got["state"] == (want["optimizer_state"], want["host_optimizer_state"]), rank
        # every byte alive after the step (device and host are one memory on CPU)
        assert got["real"] == want["total"] + want["host_total"], (rank, got["storages"])
        assert got["copies"] == planned.transfers, rank


def test_offload_rows_and_the_choice_among_fractions():
    fractions = (0, 0.5, 1)
    with torch.device("meta"):
        model = UnevenNet()
    kwargs = dict(world_size=2, unit_modules=[Block], mixed_precision=POLICY, optimizer="adamw", device="cpu")
    every = plan(model, offload_fractions=fractions, **kwargs)
    assert [c.name for c in every.candidates[:3]] == ["no_shard", "no_shard offload 0.5", "no_shard offload 1"]
    zero3 = every["optim_grads_params offload 1"]
    assert zero3.ranks[0]["main_weights"] == zero3.ranks[0]["optimizer_state"] == zero3.ranks[0]["grads"] == 0
    assert zero3.transfer_bytes > 0 and zero3.moved_bytes == zero3.wire_bytes + zero3.transfer_bytes
    # room for all: no offload (it only adds copies); a budget only offloaded plans fit: the one moving least
    # (ZeRO-2 at one micro-batch sends ZeRO-1's bytes, within PADDING_TIE, and keeps a smaller peak)
    assert plan(model, offload_fractions=fractions, budget_bytes=10 ** 9, **kwargs).chosen.name == "optim_grads"
    unoffloaded = min(c.fit_bytes for c in every.candidates if c.offload_fraction is None)
    tight = plan(model, offload_fractions=fractions, budget_bytes=unoffloaded - 1, **kwargs)
    fitting = [c for c in every.candidates if c.fit_bytes < unoffloaded]
    assert tight.chosen.offload_fraction is not None
    assert tight.chosen.moved_bytes == min(c.moved_bytes for c in fitting)
    with pytest.raises(ValueError, match="offload and offload_fractions: give one"):
        plan(model, offload=OffloadPolicy(fraction=1.0), offload_fractions=fractions, **kwargs)
    with pytest.raises(ValueError, match="OffloadPolicy.fraction must be a number with 0 <= fraction <= 1, got 2"):
        plan(model, offload_fractions=(0, 2), **kwargs)
    with pytest.raises(ValueError, match=r"offload with hybrid sharding is not supported.*hybrid_shape \(2, 1\)"):
        plan(model, offload=OffloadPolicy(fraction=1.0), **{**kwargs, "hybrid_shape": (2, 1)})
    with pytest.raises(ValueError, match="activation_bytes must be None or a number of bytes >= 0, got -1"):
        plan(model, activation_bytes=-1, **kwargs)


# -- the moments the peak with activations adds them to ----------------------------------------

def _ours(model, opt) -> int:
    """Our device bytes now: kept buffers, optimizer state, live allocator buffers."""
    return model.persistent_bytes()["total"] + _state_bytes(model, opt)[0] + model._fsdp_engine.allocator.live_bytes


def _phase_worker(rank, world_size):
    """One micro-batch per step; our bytes at forward end, when the unit before the last gets its
    first gradient (``scale``'s: autograd accumulates leaves first; our hook runs after this one)
    and after the step."""
    out = {}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        net = UnevenNet()
        seen = {}
        net.blocks[-2].scale.register_post_accumulate_grad_hook(
            lambda p: seen.setdefault("last_unit_backward", _ours(model, opt)) and None)
        model = fully_shard(net, sharding_strategy=strategy, unit_modules=[Block], mixed_precision=POLICY)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            seen.clear()
            (x, y), = make_batches(step, rank, 1)
            loss = ((model(x.bfloat16()).float() - y) ** 2).mean()
            seen["forward_end"] = _ours(model, opt)
            loss.backward()
            opt.step()
            seen["step"] = _ours(model, opt)
            opt.zero_grad()
            gc.collect()        # a pooled worker's leftover cycle must not keep a freed buffer's views alive
        out[strategy] = dict(seen)
        del model, opt, net
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_phases_equal_our_bytes_at_those_moments(world_size):
    results = run_distributed(_phase_worker, world_size)
    for strategy in STRATEGY_NAMES:
        planned = _planned(world_size, strategy, 0.0, micro_batches=1, activation_bytes=10 ** 6)
        # the phases are the most loaded rank's; a rank holding fewer rows (ZeRO-3's torch.chunk
        # pieces leave the last ranks short) holds that much less at every moment
        most = max(r["total"] for r in planned.ranks)
        for rank, got in enumerate(results):
            fewer = most - planned.ranks[rank]["total"]
            assert got[strategy] == {k: v - fewer for k, v in planned.phases.items()}, (strategy, rank)
        assert planned.peak_with_activations == max(planned.phases["last_unit_backward"] + 10 ** 6,
                                                    planned.phases["step"], planned.peak_bytes)


def _largest_non_root_main_shard(rank, world_size, out=5, per_child=False) -> tuple:
    """The engine's largest fp32 main shard of an offloaded group: (non-root, any)."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(out=out), sharding_strategy="optim_grads_params", unit_modules=[Block],
                        mixed_precision=POLICY, offload=OffloadPolicy(fraction=1.0, step_in_backward=True),
                        reduce_root_per_child=per_child)
    engine = model._fsdp_engine
    sizes = [(u.is_root, g.main_shard.numel() * g.main_shard.element_size()) for u in engine.units
             for g in u.groups if g.offloaded is not None]
    return max(n for root, n in sizes if not root), max(n for _, n in sizes)


def test_uploads_during_backward_add_one_groups_main_dtype_copy_to_backward():
    """``OffloadPolicy(step_in_backward=True)``: ZeRO-3 uploads each non-root group the host thread
    stepped during backward, one at a time, casting on the device from a main-dtype (fp32) copy of
    the group's shard: backward holds the largest such copy (offload/backward_steps.py), with
    ``release_after_gather`` too (the released shards come back from the thread). Not for ZeRO-1
    (refresh after the step)."""
    with torch.device("meta"):
        model = UnevenNet()
    kwargs = dict(world_size=2, unit_modules=[Block], mixed_precision=POLICY, optimizer="adamw", device="cpu")

    def backward_bytes(strategy, **policy):
        return plan(model, strategy, offload=OffloadPolicy(fraction=1.0, **policy), **kwargs).candidates[0].phases[
            "last_unit_backward"]

    # the engine's own: the largest fp32 main shard of an offloaded non-root group
    largest = run_distributed(_largest_non_root_main_shard, 2)[0][0]
    assert largest > 0
    assert backward_bytes("optim_grads_params", step_in_backward=True) - backward_bytes("optim_grads_params") \
        == largest
    assert backward_bytes("optim_grads_params", step_in_backward=True, release_after_gather=True) \
        - backward_bytes("optim_grads_params", release_after_gather=True) == largest
    assert backward_bytes("optim", step_in_backward=True) == backward_bytes("optim")


def test_root_uploads_at_backward_start_count_with_reduce_root_per_child():
    """With ``reduce_root_per_child`` the root's groups reduce, step and upload from the thread as
    their gradients complete (a GPT's output layer at the start of backward), so backward's copy
    is the largest over every offloaded group, the root's included; without it the root's come at
    the end of backward, after the activations (a head of 13 x 200 here: the largest group)."""
    with torch.device("meta"):
        model = UnevenNet(out=200)
    kwargs = dict(world_size=2, unit_modules=[Block], mixed_precision=POLICY, optimizer="adamw", device="cpu")

    def added(per_child, release=False):
        phases = [plan(model, "optim_grads_params", reduce_root_per_child=per_child, **kwargs,
                       offload=OffloadPolicy(fraction=1.0, step_in_backward=sib, release_after_gather=release)
                       ).candidates[0].phases["last_unit_backward"]
                  for sib in (True, False)]
        return phases[0] - phases[1]

    non_root, _ = run_distributed(_largest_non_root_main_shard, 2, 200)[0]
    _, any_group = run_distributed(_largest_non_root_main_shard, 2, 200, True)[0]
    assert any_group > non_root > 0
    assert added(False) == non_root and added(True) == any_group
    # released shards: the root's, freed at the start of backward, go up after the step
    assert added(True, release=True) == non_root
