"""FSDP2's habits on the parameters ``model.parameters()`` yields (issue 48 item 3), every strategy, 2 gloo ranks.

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

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from .dist_utils import run_distributed
from .models import Block, EdgeNet, UnevenNet, make_batches
from .scenarios import loss_fn


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
            assert "RowShardedTensor" in out["types"] and "FlatRangeShard" in out["types"]
