"""A Megatron-FSDP user's command line runs unchanged through examples/pretrain_gpt.py (CPU, gloo,
2 ranks, Megatron-LM's own training loop: testing/pretrain_gpt_cpu.py's stand-ins).

``--use-megatron-fsdp --data-parallel-sharding-strategy S --use-distributed-optimizer --ckpt-format
fsdp_dtensor`` is what Megatron-LM 0.19.2's argument validation makes of a Megatron-FSDP run: it forces
the distributed optimizer for every strategy and demands the fsdp_dtensor format. For each strategy:

* Megatron-LM's own ``parse_args`` / ``validate_args`` of that command line (``sys.argv`` patched)
  accept it, with ``use_distributed_optimizer`` forced on even where the flag is left out;
* the launcher trains it: Megatron's ``DistributedOptimizer`` over our wrapper of that strategy
  (``no_shard``: replicated optimizer state, the sharded strategies half of it per rank), the same
  losses for every strategy;
* ``--save`` writes Megatron-FSDP's fsdp_dtensor layout, and a second run with ``--load`` continues
  exactly as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import sys

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ITERS = 4
#: A Megatron-FSDP run's flags (the strategy is added per case), then the model and the CPU run.
MEGATRON_FSDP_FLAGS = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "1e-3", "--vocab-size", "512", "--mock-data", "--transformer-impl", "local",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--use-cpu-initialization", "--distributed-backend",
    "gloo", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer", "--lr-decay-style", "constant",
    "--num-workers", "0",
]
_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")


def command_line(strategy: str, *more: str, distributed_optimizer: bool = True) -> list:
    flags = [f for f in MEGATRON_FSDP_FLAGS if distributed_optimizer or f != "--use-distributed-optimizer"]
    return flags + ["--data-parallel-sharding-strategy", strategy] + MODEL_FLAGS + list(more)


@contextlib.contextmanager
def _torchrun_environment(rank: int, world_size: int):
    """What torchrun sets, which Megatron-LM's parser reads (the pool restores the environment)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    yield


def megatron_parse_worker(rank, world_size, argv):
    """Megatron-LM's own argument parsing and validation of ``argv`` (no launcher involved)."""
    from megatron.training import arguments

    with _torchrun_environment(rank, world_size):
        # validate_args reads the GPU generation with --use-megatron-fsdp: Hopper's
        saved, sys.argv = (sys.argv, arguments.get_device_arch_version), ["pretrain_gpt.py", *argv]
        arguments.get_device_arch_version = lambda: 9
        try:
            args = arguments.parse_args()
            arguments.validate_args(args, {})
        finally:
            sys.argv, arguments.get_device_arch_version = saved
    return {k: getattr(args, k) for k in ("use_megatron_fsdp", "use_distributed_optimizer",
                                          "data_parallel_sharding_strategy", "ckpt_format", "data_parallel_size")}


def launcher_worker(rank, world_size, argv):
    """``examples/pretrain_gpt.py``'s ``main(argv)`` on CPU; what the optimizer it built looks like
    and the logged losses (Megatron logs on the last rank)."""
    from megatron_fsdp_v2.megatron.adapter import ORIGINAL_SHAPE_ATTR
    from testing.pretrain_gpt_cpu import launcher_on_cpu

    built = {}
    with _torchrun_environment(rank, world_size), launcher_on_cpu() as launcher:
        original = launcher.get_optimizer

        def recording_get_optimizer(config, chunks, *args, **kwargs):
            optimizer = original(config, chunks, *args, **kwargs)
            leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
            built.update(chunk=chunks[0], strategy=chunks[0].strategy.name, leaves=[type(leaf).__name__ for leaf in leaves],
                         main_numel=sum(p.numel() for p in chunks[0].parameters()),
                         full_numel=sum(getattr(p, ORIGINAL_SHAPE_ATTR).numel() for p in chunks[0].parameters()),
                         use_distributed_optimizer=config.use_distributed_optimizer)
            return optimizer

        launcher.get_optimizer = recording_get_optimizer
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                launcher.main(list(argv))
        except SystemExit as exc:       # --exit-interval: Megatron-LM ends the run with sys.exit
            built["exit"] = exc.code
        finally:
            launcher.get_optimizer = original
    built["losses"] = {int(i): float(v) for i, v in _LOSS.findall(log.getvalue())}
    chunk = built.pop("chunk")
    built["weights"] = {k: v.clone() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    return built


def test_megatron_lm_validation_makes_every_strategy_a_distributed_optimizer_run():
    for strategy in STRATEGIES:
        for flag in (True, False):
            (parsed, _) = run_distributed(megatron_parse_worker, 2, command_line(strategy, distributed_optimizer=flag))
            assert parsed == {"use_megatron_fsdp": True, "use_distributed_optimizer": True,
                              "data_parallel_sharding_strategy": strategy, "ckpt_format": "fsdp_dtensor",
                              "data_parallel_size": 2}, (strategy, flag, parsed)


@pytest.fixture(scope="module")
def trained():
    return {s: run_distributed(launcher_worker, 2, command_line(s), timeout=600) for s in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_launcher_trains_a_megatron_fsdp_command_line(trained, strategy):
    for rank, out in enumerate(trained[strategy]):
        assert out["strategy"] == strategy and out["leaves"] == ["DistributedOptimizer"], out
        assert out["use_distributed_optimizer"] is True
        if strategy == "no_shard":      # replicated optimizer state: the main weights are whole
            assert out["main_numel"] == out["full_numel"], out
        else:                           # sharded: this rank's half (rows, so not exactly)
            assert 0.3 * out["full_numel"] < out["main_numel"] < 0.7 * out["full_numel"], out
    losses = trained[strategy][1]["losses"]
    assert sorted(losses) == list(range(1, ITERS + 1)), losses
    assert losses[ITERS] < losses[1], losses
    reference = trained["no_shard"][1]["losses"]
    torch.testing.assert_close(torch.tensor([losses[i] for i in sorted(losses)]),
                               torch.tensor([reference[i] for i in sorted(reference)]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_save_and_load_in_fsdp_dtensor_continue_the_run(trained, tmp_path, strategy):
    """``--save`` at iteration 2 (Megatron-FSDP's fsdp_dtensor layout) and ``--exit-interval 2``, then
    ``--load`` of it: iteration 3's loss and the weights after iteration 4 are the uninterrupted run's,
    bitwise. (Megatron-LM logs iteration 4 of a resumed run as the mean of iterations 3 and 4.)"""
    save = ["--save", str(tmp_path), "--save-interval", "2", "--exit-interval", "2"]
    first = run_distributed(launcher_worker, 2, command_line(strategy, *save), timeout=600)
    assert sorted(first[1]["losses"]) == [1, 2] and first[1]["exit"] == 0
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    from megatron_fsdp_v2.megatron.checkpoint.checkpoint_format import FSDP_DTENSOR, detect_checkpoint_format

    assert detect_checkpoint_format(str(tmp_path / "iter_0000002")) == FSDP_DTENSOR
    resumed = run_distributed(launcher_worker, 2, command_line(strategy, "--load", str(tmp_path)), timeout=600)
    assert sorted(resumed[1]["losses"]) == [3, 4] and resumed[1]["losses"][3] == trained[strategy][1]["losses"][3]
    for rank in range(2):
        want = trained[strategy][rank]["weights"]
        assert resumed[rank]["weights"].keys() == want.keys()
        assert all(torch.equal(resumed[rank]["weights"][k], v) for k, v in want.items())
