"""Ranks whose control flow differs get a clear error on every rank, by default, naming the first
call where they differ (comm/ledger.py, [Note: ranks that issue different collectives]):
a unit skipped on one rank, ``save_checkpoint`` or ``export_full_state_dict`` called on rank 0
only. Without the check gloo aborts the process (SIGABRT). The watchdog's comparison after a
stall (NCCL's path) is tested on gloo with calls recorded but not issued."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_v2 import CollectiveMismatchError, export_full_state_dict, fully_shard, save_checkpoint
from megatron_fsdp_v2.comm.ledger import CHECK_ENV, CollectiveLedger, LedgerMode
from megatron_fsdp_v2.comm.ledger_registry import ledger_for
from megatron_fsdp_v2.comm.watchdog import KEY_PREFIX, LedgerWatchdog, first_difference

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn


class SkippingNet(UnevenNet):
    """Skips its middle block on the ranks where ``skip_middle`` is set."""

    skip_middle = False

    def forward(self, x):
        h = self.proj(x)
        for index, block in enumerate(self.blocks):
            if index == 1 and self.skip_middle:
                continue
            h = block(h)
        return self.head(h) + self.offset


def _raised(fn):
    """(class name, message) of what ``fn`` raised, or None."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 -- the test asserts the class
        return type(err).__name__, str(err)
    return None


def _step(model, opt, rank, step=0):
    x, y = make_batches(step, rank, 1)[0]
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------- a unit skipped on one rank
def skipped_unit_worker(rank, world_size):
    out = {}
    for strategy in ("optim_grads_params", "optim_grads"):
        torch.manual_seed(0)
        model = fully_shard(SkippingNet(), sharding_strategy=strategy, unit_modules=[Block])
        model.skip_middle = rank == 1
        x, y = make_batches(0, rank, 1)[0]
        out[strategy] = _raised(lambda: loss_fn(model(x), y).backward())
    return out


def test_a_unit_skipped_on_one_rank_raises_on_every_rank_naming_the_first_differing_unit():
    assert os.environ.get(CHECK_ENV) is None          # the default, no debugging variable
    for out in run_distributed(skipped_unit_worker, 2):
        # ZeRO-3: rank 1 gathers blocks.2 where rank 0 gathers blocks.1 (forward)
        name, message = out["optim_grads_params"]
        assert name == "CollectiveMismatchError", message
        assert "issue different collectives, found before issuing them" in message
        assert "rank 0: #" in message and "all_gather of 1080 x float32 for weights of blocks.1/float32/grad" \
            in message, message
        assert "rank 1: #" in message and "for weights of blocks.2/float32/grad" in message, message
        assert "was the same on every rank: all_gather of" in message and "blocks.0/float32/grad" in message
        # ZeRO-2: rank 1 reduces blocks.0's gradients where rank 0 reduces blocks.1's (backward)
        name, message = out["optim_grads"]
        assert name == "CollectiveMismatchError", message
        assert "rank 0: #" in message and "reduce_scatter of" in message and "grads of blocks.1/float32/grad" in message
        assert "grads of blocks.0/float32/grad" in message.split("rank 1: ")[1], message


# ---------------------------------------------------------------- save functions on rank 0 only
def rank0_only_worker(rank, world_size, directory):
    out = {}
    for strategy in ("optim_grads_params", "optim"):
        for case in ("save_checkpoint", "export_full_state_dict"):
            torch.manual_seed(0)
            model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _step(model, opt, rank)
            path = os.path.join(directory, f"{strategy}-{case}")
            if rank == 0:          # the classic mistake: `if rank == 0: save(...)`; the others train on
                save = (lambda: save_checkpoint(path, model, opt)) if case == "save_checkpoint" else \
                    (lambda: export_full_state_dict(model, path + ".pt"))
                out[(strategy, case)] = _raised(save)
            else:
                out[(strategy, case)] = _raised(lambda: _step(model, opt, rank, step=1))
    return out


def test_save_functions_called_on_rank_0_only_raise_on_every_rank_naming_the_call(tmp_path):
    for rank, out in enumerate(run_distributed(rank0_only_worker, 2, str(tmp_path))):
        for (strategy, case), raised in out.items():
            assert raised is not None, (rank, strategy, case)
            name, message = raised
            assert name == "CollectiveMismatchError", (rank, strategy, case, message)
            rank0, rank1 = message.split("rank 0: ")[1].split("; rank 1: ")
            if case == "save_checkpoint":
                assert "all_gather_object for save_checkpoint: recovering from an earlier save" in rank0, message
            else:
                assert "all_gather of" in rank0 and "for main weights of <root>/float32/grad" in rank0, message
            # rank 1 is in its next step: ZeRO-3 gathers the root's weights; ZeRO-1 reduces gradients
            want = "for weights of <root>/float32/grad" if strategy == "optim_grads_params" else "grads of"
            assert want in rank1, message
            assert "save_checkpoint, load_checkpoint and export_full_state_dict together" in message


# ---------------------------------------------------------------- the environment variable
def modes_worker(rank, world_size):
    out = {}
    for setting in ("", "1", "0"):
        if setting:
            os.environ[CHECK_ENV] = setting
        else:
            os.environ.pop(CHECK_ENV, None)
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block])
        comm = model._fsdp_engine.comm
        before = comm.ledger.count
        _step(model, torch.optim.SGD(model.parameters(), lr=0.1), rank)
        out[setting] = (comm.ledger_mode.value, comm.ledger.count - before)
    os.environ[CHECK_ENV] = "2"
    out["bad"] = _raised(lambda: fully_shard(UnevenNet(), sharding_strategy="optim"))
    return out


def test_check_variable_selects_checked_recorded_or_off():
    for out in run_distributed(modes_worker, 2):
        assert out[""][0] == "check" and out[""][1] > 0          # gloo: checked by default
        assert out["1"] == out[""]                              # =1: every backend as gloo
        assert out["0"] == ("off", 0)                          # =0: nothing recorded or checked
        assert out["bad"] == ("ValueError", f"{CHECK_ENV} must be unset, 0 (off) or 1 (check every collective on "
                                            "every backend), got '2'.")


# ---------------------------------------------------------------- the watchdog (NCCL's path)
def test_first_difference_is_the_first_call_every_rank_holds_that_differs():
    assert first_difference([{1: "a", 2: "b", 3: "c"}, {1: "a", 2: "b", 3: "c"}]) is None
    assert first_difference([{1: "a", 2: "b"}, {1: "a", 2: "b", 3: "c", 4: "d"}]) is None   # slower, not different
    assert first_difference([{1: "a", 2: "b", 3: "x"}, {1: "a", 2: "b", 3: "c", 4: "d"}]) == 3
    assert first_difference([{5: "a", 6: "x", 7: "y"}, {3: "q", 4: "r", 5: "a", 6: "b"}]) == 6   # rings ending apart
    assert first_difference([{}, {1: "a"}]) is None


def watchdog_worker(rank, world_size):
    group = dist.new_group([0, 1])
    ledger = CollectiveLedger(group)
    watchdog = LedgerWatchdog()
    weights = torch.zeros(10)
    try:
        watchdog.watch(ledger, stall_s=0.3)
        for unit in (["blocks.0", "blocks.1", "blocks.2"] if rank == 0 else ["blocks.0", "blocks.2", "head"]):
            ledger.before("all_gather", weights, f"weights of {unit}", LedgerMode.RECORD)   # recorded, not issued
        if rank == 1:                     # ran ahead (NCCL queues on): a longer ring, the same first difference
            for _ in range(5):
                ledger.before("reduce_scatter", weights, "grads of head", LedgerMode.RECORD)
        deadline = time.monotonic() + 30
        while ledger.armed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        raised = _raised(lambda: ledger.before("all_gather", weights, "weights of head", LedgerMode.RECORD))
        return raised, len(watchdog.reports)
    finally:
        watchdog.shut_down()
        store = dist.distributed_c10d._get_default_store()
        dist.barrier()
        store.delete_key(f"{KEY_PREFIX}/{ledger.group_name}/{rank}")


def test_watchdog_reports_the_first_differing_call_after_a_stall():
    for raised, reports in run_distributed(watchdog_worker, 2):
        assert reports == 1
        name, message = raised
        assert name == "CollectiveMismatchError"
        assert "found by the watchdog after" in message and "without a new collective" in message
        assert "rank 0: #2 all_gather of 10 x float32 for weights of blocks.1; " \
               "rank 1: #2 all_gather of 10 x float32 for weights of blocks.2)" in message, message
        assert "The call before, #1, was the same on every rank: all_gather of 10 x float32 for weights of " \
               "blocks.0." in message


def test_a_ledger_is_one_per_group_and_counts_every_communicator(single_rank_group):
    assert ledger_for(None) is ledger_for(single_rank_group)
    before = ledger_for(None).count
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block])
    x, y = make_batches(0, 0, 1)[0]
    loss_fn(model(x), y).backward()
    assert model._fsdp_engine.comm.ledger is ledger_for(None)
    assert ledger_for(None).count > before
    with pytest.raises(CollectiveMismatchError, match="found by a test"):
        ledger = ledger_for(None)
        ledger.armed = CollectiveMismatchError("found by a test", [])
        loss_fn(model(x), y).backward()
