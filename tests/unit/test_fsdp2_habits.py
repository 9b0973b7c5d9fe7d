"""FSDP2's habits on the parameters ``model.parameters()`` yields (issue 48 item 3), every strategy, 2 gloo ranks.

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
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn


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
def test_torch_load_with_defaults_reads_a_per_rank_state_dict(habits, strategy):
    for rank_results in habits:
        out = _ok(rank_results, "weights_only_load", strategy)
        assert "error" not in out, out
        assert out["keys"] and out["moved"] > 1e-4 and out["back"] == 0.0
        if strategy != "no_shard":
            assert "RowShardedTensor" in out["types"] and "FlatRangeShard" in out["types"]
