"""FSDP2's habits on the parameters ``model.parameters()`` yields (issue 48 item 3), every strategy, 2 gloo ranks.

* ``register_post_accumulate_grad_hook`` on a sharded parameter runs once its reduced gradient is
  its ``.grad``: once per backward outside ``no_sync()`` (none inside it, whatever the strategy),
  once at an explicit ``reduce_gradients()``, never again at a repeated ``wait_gradient_reduction()``;
  the hook gets the parameter itself, with this rank's rows of torch DDP's averaged gradient.
  Optimizer-in-backward (one AdamW per parameter, stepped and zeroed in the hook) trains as torch
  DDP with one AdamW does, also with every group offloaded (the hook then gets the host gradient);
  ZeRO-1/2 refresh each group's weights once per step, not once per parameter stepped.
* ``register_hook`` on such a parameter is refused at the next forward, naming the parameter and
  ``register_post_accumulate_grad_hook``; once the hook is removed the model trains on.
* ``named_parameters`` / ``parameters`` honour ``recurse`` and ``remove_duplicate`` as torch's:
  a tied weight is listed under both names with ``remove_duplicate=False`` (GPT-2: 29 names, not 28).
* ``torch.load(f)`` with its default ``weights_only=True`` reads a per-rank
  ``torch.save(model.state_dict())`` (and the optimizer's), which loads back into the model.
"""

from __future__ import annotations

import io
import traceback

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from megatron_fsdp_v2 import STRATEGY_NAMES, OffloadPolicy, fully_shard
from megatron_fsdp_v2.row_sharded import local_piece

from .dist_utils import run_distributed
from .models import Block, EdgeNet, UnevenNet, make_batches
from .scenarios import loss_fn


def _rows(full: torch.Tensor, splits, rank: int) -> torch.Tensor:
    """This rank's rows of a full tensor, as its optimizer-facing piece holds them (0-d: ``[1]``)."""
    full = full.reshape(1) if full.dim() == 0 else full
    return full if splits is None else full[splits[rank]:splits[rank + 1]]


def _ddp_grads(rank: int, batches: list) -> dict:
    """torch DDP's averaged gradients of UnevenNet after backwards of ``batches`` (one step)."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(UnevenNet())
    for i, (x, y) in enumerate(batches):
        if i < len(batches) - 1:
            with ddp.no_sync():
                loss_fn(ddp(x), y).backward()
        else:
            loss_fn(ddp(x), y).backward()
    return {n: p.grad.clone() for n, p in ddp.module.named_parameters()}


# ---------------------------------------------------------------- a. post-accumulate-grad hooks
def post_accumulate_hooks(rank, strategy):
    """Counts and gradients the hooks see over: a backward; wait_gradient_reduction(); a no_sync
    micro-batch then a synced one; a no_sync micro-batch then reduce_gradients()."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    splits = {e.name: e.row_splits for e in model.sharded_parameters()}
    named = dict(model.named_parameters())
    calls, seen = {n: 0 for n in named}, {}

    def hook_for(name):
        def hook(param):
            calls[name] += 1
            seen[name] = (param is named[name], model.get_parameter(name) is param,
                          local_piece(param.grad).detach().clone())
        return hook

    for name, param in named.items():
        param.register_post_accumulate_grad_hook(hook_for(name))

    def diff_to_ddp(batches):
        want = _ddp_grads(rank, batches)
        return max(float((seen[n][2] - _rows(want[n], splits[n], rank)).abs().max()) if seen[n][2].numel() else 0.0
                   for n in named)

    out = {"params": len(named)}
    b = make_batches(0, rank, 2)
    loss_fn(model(b[0][0]), b[0][1]).backward()
    out["after_backward"] = sorted(set(calls.values()))
    out["identity"] = all(s[0] and s[1] for s in seen.values())
    out["diff_one"] = diff_to_ddp(b[:1])
    model.wait_gradient_reduction()
    out["after_wait"] = sorted(set(calls.values()))
    model.zero_grad()
    with model.no_sync():
        loss_fn(model(b[0][0]), b[0][1]).backward()
    out["after_no_sync"] = sorted(set(calls.values()))
    loss_fn(model(b[1][0]), b[1][1]).backward()
    out["after_synced"] = sorted(set(calls.values()))
    out["diff_two"] = diff_to_ddp(b)
    model.zero_grad()
    with model.no_sync():
        loss_fn(model(b[0][0]), b[0][1]).backward()
    model.reduce_gradients()
    out["after_reduce_gradients"] = sorted(set(calls.values()))
    out["diff_reduce_gradients"] = diff_to_ddp(b[:1])
    return out


def optimizer_in_backward(rank, strategy, offload):
    """One AdamW per parameter stepped and zeroed in its hook, 3 steps, against DDP + one AdamW."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(UnevenNet())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block],
                        offload=OffloadPolicy(fraction=1.0) if offload else None)
    host_grads = {id(m): g.offloaded.grad for g in model._fsdp_engine.groups for m in g.main_params
                  if g.offloaded is not None}
    on_host = []

    def step_in_hook(param):
        if id(param) in host_grads:
            on_host.append(local_piece(param.grad).untyped_storage().data_ptr()
                           == host_grads[id(param)].untyped_storage().data_ptr())
        optimizers[id(param)].step()
        optimizers[id(param)].zero_grad()

    optimizers = {}
    for param in model.parameters():
        optimizers[id(param)] = torch.optim.AdamW([param], lr=1e-2, foreach=False)
        param.register_post_accumulate_grad_hook(step_in_hook)
    model.reset_comm_stats()
    for step in range(3):
        x, y = make_batches(step, rank, 1)[0]
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
    all_gathers = model.comm_stats()["all_gather"]["count"]
    want = {n: t.detach() for n, t in ddp.module.state_dict().items()}
    full = model.full_state_dict()
    return {"diff": max(float((full[n] - want[n]).abs().max()) for n in want),
            "all_gathers": all_gathers, "groups": len(model._fsdp_engine.groups),
            "on_host": (len(on_host), all(on_host)), "offloaded": len({id(g) for g in host_grads.values()})}


# ---------------------------------------------------------------- b. register_hook
def tensor_hook(rank, strategy):
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    handle = model.blocks[1].up.weight.register_hook(lambda grad: grad * 2)
    x, y = make_batches(0, rank, 1)[0]
    try:
        model(x)
        error = None
    except RuntimeError as err:
        error = str(err)
    handle.remove()
    loss_fn(model(x), y).backward()
    want = _ddp_grads(rank, [(x, y)])
    splits = {e.name: e.row_splits for e in model.sharded_parameters()}
    return {"error": error, "diff": max(float((local_piece(p.grad) - _rows(want[n], splits[n], rank)).abs().max())
                                        if local_piece(p.grad).numel() else 0.0
                                        for n, p in model.named_parameters())}


# ---------------------------------------------------------------- c. named_parameters
def parameter_lists(rank, strategy):
    """Names per (recurse, remove_duplicate), torch's module and ours; ours yield main parameters."""
    out = {}
    reference = EdgeNet()
    for dtensor_params in (True, False):
        model = fully_shard(EdgeNet(), sharding_strategy=strategy, dtensor_params=dtensor_params)
        mains = {id(m) for g in model._fsdp_engine.groups for m in g.main_params}
        for recurse in (True, False):
            for remove_duplicate in (True, False):
                theirs = [n for n, _ in reference.named_parameters(recurse=recurse, remove_duplicate=remove_duplicate)]
                ours = list(model.named_parameters(recurse=recurse, remove_duplicate=remove_duplicate))
                out[(dtensor_params, recurse, remove_duplicate)] = (
                    theirs, [n for n, _ in ours], all(id(p) in mains for _, p in ours))
        out[(dtensor_params, "parameters")] = (len(list(reference.parameters(recurse=False))),
                                               len(list(model.parameters(recurse=False))),
                                               len(list(reference.parameters())), len(list(model.parameters())))
        ours = dict(model.named_parameters(remove_duplicate=False))
        out[(dtensor_params, "tied")] = ours["out.weight"] is ours["emb.weight"]
    return out


# ---------------------------------------------------------------- d. torch.load, weights only
def weights_only_load(rank, strategy):
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_batches(0, rank, 1)[0]
    loss_fn(model(x), y).backward()
    opt.step()
    saved = model.full_state_dict()
    files = {}
    for what, state in (("model", model.state_dict()), ("optimizer", opt.state_dict())):
        files[what] = io.BytesIO()
        torch.save(state, files[what])
        files[what].seek(0)
    out = {"types": sorted({type(v).__name__ for v in model.state_dict().values()})}
    try:
        loaded = torch.load(files["model"])          # weights_only=True: torch's default
        opt_loaded = torch.load(files["optimizer"])
    except Exception as err:  # noqa: BLE001 - the message is the result
        out["error"] = str(err)[-400:]
        return out
    loss_fn(model(x), y).backward()                  # move the weights away, then load them back
    opt.step()
    moved = model.full_state_dict()
    model.load_state_dict(loaded)
    opt.load_state_dict(opt_loaded)
    back = model.full_state_dict()
    out["moved"] = max(float((moved[n] - saved[n]).abs().max()) for n in saved)
    out["back"] = max(float((back[n] - saved[n]).abs().max()) for n in saved)
    out["keys"] = sorted(loaded) == sorted(model.state_dict())
    return out


CASES = {
    "post_accumulate_hooks": post_accumulate_hooks,
    "optimizer_in_backward": lambda rank, strategy: optimizer_in_backward(rank, strategy, offload=False),
    "optimizer_in_backward_offload": lambda rank, strategy: optimizer_in_backward(rank, strategy, offload=True),
    "tensor_hook": tensor_hook,
    "parameter_lists": parameter_lists,
    "weights_only_load": weights_only_load,
}


def habits_worker(rank, world_size):
    results = {}
    for case, run in CASES.items():
        for strategy in STRATEGY_NAMES:
            try:
                results[(case, strategy)] = ("ok", run(rank, strategy))
            except Exception:  # noqa: BLE001 - reported per case
                results[(case, strategy)] = ("error", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def habits():
    return run_distributed(habits_worker, 2, timeout=600)


def _ok(results, case, strategy):
    status, value = results[(case, strategy)]
    assert status == "ok", f"{case} / {strategy} raised:\n{value}"
    return value


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_post_accumulate_grad_hooks_run_once_the_reduced_gradient_is_attached(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "post_accumulate_hooks", strategy)
        assert out["params"] == 22
        assert out["after_backward"] == [1] and out["after_wait"] == [1]
        assert out["after_no_sync"] == [1] and out["after_synced"] == [2]
        assert out["after_reduce_gradients"] == [3]
        assert out["identity"]                    # the parameter itself, held by the module then
        assert out["diff_one"] < 1e-6 and out["diff_two"] < 1e-6 and out["diff_reduce_gradients"] < 1e-6


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize("case", ["optimizer_in_backward", "optimizer_in_backward_offload"])
def test_optimizer_in_backward_trains_like_ddp(habits, strategy, case):
    for rank_results in habits:
        out = _ok(rank_results, case, strategy)
        assert out["diff"] < 1e-6, out
        if strategy in ("optim", "optim_grads"):   # one refresh per group and step, not one per parameter
            assert out["all_gathers"] == 3 * out["groups"], out
        if case.endswith("offload"):
            assert out["offloaded"] == out["groups"] and out["on_host"] == (3 * 22, True), out


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_register_hook_is_refused_naming_the_parameter(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "tensor_hook", strategy)
        assert out["error"] is not None and "register_hook: parameter 'blocks.1.up.weight'" in out["error"]
        assert "register_post_accumulate_grad_hook" in out["error"] and "handle.remove()" in out["error"]
        assert out["diff"] < 1e-6                 # removed: the model trains on


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_named_parameters_honour_recurse_and_remove_duplicate(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "parameter_lists", strategy)
        for dtensor_params in (True, False):
            for recurse in (True, False):
                for remove_duplicate in (True, False):
                    theirs, ours, mains = out[(dtensor_params, recurse, remove_duplicate)]
                    assert ours == theirs and mains, (dtensor_params, recurse, remove_duplicate, ours, theirs)
            # the tied weight: both names with remove_duplicate=False, one parameter object
            assert len(out[(dtensor_params, True, False)][1]) == len(out[(dtensor_params, True, True)][1]) + 1
            assert out[(dtensor_params, "tied")]
            assert out[(dtensor_params, "parameters")] == (1, 1, 11, 11)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_torch_load_with_defaults_reads_a_per_rank_state_dict(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "weights_only_load", strategy)
        assert "error" not in out, out
        assert out["keys"] and out["moved"] > 1e-4 and out["back"] == 0.0
        if strategy != "no_shard":
            assert "DTensor" in out["types"] and "FlatRangeShard" in out["types"]      # plain DTensors, torch.chunk rows
