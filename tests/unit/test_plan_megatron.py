"""``--data-parallel-sharding-strategy auto`` through examples/pretrain_gpt.py and the adapter,
and ``python -m megatron_fsdp_v2.plan`` for a Megatron GPT and a torch model."""

from __future__ import annotations

import importlib.util
import re

import pytest

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

from .test_megatron_adapter import LAUNCHER_ARGS, MODEL_SEED, SEQ, VOCAB  # noqa: E402


def _wrap_auto(world_size, reserve_bytes):
    """Parse the launcher's flags with ``auto``, wrap a tiny GPT through get_model's call; return
    (chosen, ddp_config's strategy, what plan chooses for the same budget, planned peaks, flag)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training import training

    import torch

    from examples import pretrain_gpt
    from megatron_fsdp_v2 import plan
    from megatron_fsdp_v2.megatron.adapter import _mixed_precision
    from megatron_fsdp_v2.megatron.wrap_settings import megatron_adam_kernel
    from megatron_fsdp_v2.plan.resolve import device_total_memory
    from tests.megatron_cpu import build_tiny_gpt

    args = pretrain_gpt.parse_args(LAUNCHER_ARGS + ["--data-parallel-sharding-strategy", "auto",
                                                    "--activation-reserve-gib", repr(reserve_bytes / (1 << 30))])
    ddp_config = training.get_megatron_ddp_config(args)
    model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ)
    budget = device_total_memory(torch.device("cpu")) - args.activation_reserve_bytes
    planned = plan(model, world_size=world_size, unit_modules=[TransformerLayer], device="cpu",
                   mixed_precision=_mixed_precision(config, ddp_config), optimizer="adam",
                   micro_batches=args.global_batch_size // (args.micro_batch_size * world_size),
                   broadcast_buffers=False, budget_bytes=budget, optimizer_kernel=megatron_adam_kernel())
    with pretrain_gpt.use_fully_sharded_data_parallel(args):
        (chunk,) = training.wrap_model_chunks_with_ddp([model], config, ddp_config, DP=training.DDP,
                                                      pg_collection=None, bucket_sizes=[None],
                                                      disable_bucketing_per_chunk=[False])
    peaks = {c.strategy: c.fit_bytes for c in planned.candidates}
    return (chunk.strategy.name, chunk.ddp_config.data_parallel_sharding_strategy, planned.chosen.strategy, peaks,
            args.data_parallel_sharding_strategy)


def _auto_launcher_worker(rank, world_size):
    import torch

    from megatron_fsdp_v2.plan import NoPlanFitsError
    from megatron_fsdp_v2.plan.resolve import device_total_memory
    from tests.megatron_cpu import destroy_megatron_parallel_state, init_megatron_parallel_state, patch_megatron_for_cpu

    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            roomy = _wrap_auto(world_size, 0)
            smallest = min(roomy[3].values())
            # reserve all but one byte less than the smallest plan's peak: none fits
            try:
                _wrap_auto(world_size, device_total_memory(torch.device("cpu")) - smallest + 1)
            except NoPlanFitsError as error:
                return roomy, str(error)
            return roomy, None
        finally:
            destroy_megatron_parallel_state()


def test_launcher_auto_chooses_what_plan_chooses():
    (roomy, tight), _ = run_distributed(_auto_launcher_worker, 2, timeout=300)
    name, in_config, planned, peaks, flag = roomy
    assert flag == "auto" and name == in_config == planned == "optim"     # room for all: fewest bytes, smaller peak
    smallest = min(peaks, key=peaks.get)
    assert tight is not None and f"the smallest is {smallest} at" in tight and f"({peaks[smallest]} bytes" in tight


def test_plan_command_prints_every_strategy_for_a_megatron_gpt(capsys):
    from megatron_fsdp_v2.plan.__main__ import main

    main(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--vocab-size", "100", "--bf16", "--world-size", "4", "--hybrid", "2x2", "--device", "cpu"])
    out = capsys.readouterr().out
    rows = [line.split()[0] + (" " + line.split()[1] if "x" in line.split()[1] else "")
            for line in out.splitlines()[3:11]]
    assert rows == ["no_shard", "optim", "optim_grads", "optim_grads_params",
                    "no_shard 2x2", "optim 2x2", "optim_grads 2x2", "optim_grads_params 2x2"]
    # vocabulary padded to 128 as Megatron-LM does: 128 x 64 word + 32 x 64 position embeddings
    assert out.startswith(f"GPTModel: {(128 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64) / 1e6:.1f}M")


def test_plan_command_for_a_torch_model_by_import_path(capsys):
    from megatron_fsdp_v2.plan.__main__ import main

    main(["--model", "tests.unit.models:UnevenNet", "--unit-modules", "tests.unit.models:Block",
          "--world-size", "2", "--device", "cpu", "--budget-gib", "1"])
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[3:7]] == ["no_shard", "optim", "optim_grads",
                                                                  "optim_grads_params"]
    # UnevenNet's few-row parameters: ZeRO-1's torch.chunk pieces pad > PADDING_TIE beyond DDP's buffer;
    # ZeRO-2 moves as many bytes as ZeRO-1, and its foreach step peaks lower (its gradients sharded)
    assert out.rstrip().endswith("budget 1.00 GiB: chosen no_shard, runner-up optim_grads")
    main(["--model", "tests.unit.models:UnevenNet", "--unit-modules", "tests.unit.models:Block",
          "--world-size", "2", "--device", "cpu", "--budget-gib", "1", "--optimizer-kernel", "fused"])
    assert capsys.readouterr().out.rstrip().endswith("budget 1.00 GiB: chosen no_shard, runner-up optim")
    with pytest.raises(SystemExit, match="missing: --num-layers"):
        main(["--hidden-size", "8"])


def test_plan_command_plans_offload_fractions_and_activations(capsys):
    import torch

    from megatron_fsdp_v2 import plan
    from megatron_fsdp_v2.plan.__main__ import main
    from megatron_fsdp_v2.plan.compact import compact_table
    from tests.unit.models import Block, UnevenNet

    main(["--model", "tests.unit.models:UnevenNet", "--unit-modules", "tests.unit.models:Block", "--world-size", "2",
          "--device", "cpu", "--strategies", "optim_grads_params", "--offload-fractions", "1,0.5",
          "--activation-gib", "0.25"])
    out = capsys.readouterr().out
    labels = [" ".join(line.split()[:3]) for line in out.splitlines()[3:6]]
    assert labels[1:] == ["optim_grads_params offload 0.5", "optim_grads_params offload 1"], out
    with torch.device("meta"):
        net = UnevenNet()
    want = plan(net, "optim_grads_params", world_size=2, unit_modules=[Block], device="cpu",
                offload_fractions=[0.0, 0.5, 1.0], activation_bytes=1 << 28, broadcast_buffers=True)
    assert compact_table(want) in out
    main(["--model", "tests.unit.models:UnevenNet", "--unit-modules", "tests.unit.models:Block", "--world-size", "2",
          "--device", "cpu", "--strategies", "optim_grads_params", "--offload-fractions", "1,0.5",
          "--activation-gib", "0.25", "--wide"])
    assert str(want) in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--offload-fractions must be comma-separated numbers"):
        main(["--model", "tests.unit.models:UnevenNet", "--offload-fractions", "half"])


#: The README's ``python -m megatron_fsdp_v2.plan`` example (a Megatron GPT), on the CPU.
README_PLAN = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
               "--vocab-size", "32000", "--bf16", "--world-size", "8", "--device", "cpu"]
#: The optional columns: a hybrid shape (longer names), with activations and a budget; offload (longest names).
PLAN_EXTRAS = [["--hybrid", "2x4"], ["--hybrid", "2x4", "--budget-gib", "20", "--activation-gib", "4"],
               ["--offload-fractions", "0.5,1", "--budget-gib", "6", "--activation-gib", "4"]]
#: The wide table's columns that the compact one leaves out.
WIDE_ONLY = ["weights", "main", "grads", "optimizer", "(padding)", "gathered", "reduce in", "held grads",
             "trace pool", "temp peak", "all-gather", "reduce-scatter", "all-reduce", "outer all-reduce",
             "sent/rank", "host link"]


def _header(out: str) -> list:
    """The table's column names (cells are two or more spaces apart; names hold single spaces)."""
    return re.split(r"\s{2,}", out.splitlines()[1].strip())


@pytest.mark.parametrize("extra", PLAN_EXTRAS, ids=lambda e: " ".join(e))
def test_plan_command_fits_100_columns_and_wide_has_every_column(capsys, extra):
    from megatron_fsdp_v2.plan.__main__ import main

    main(README_PLAN + extra)
    compact = capsys.readouterr().out
    assert all(len(line) <= 100 for line in compact.splitlines()), compact
    header = _header(compact)
    assert header[:3] == ["strategy", "kept", "peak"] and "moved/step" in header, header
    assert not set(header) & set(WIDE_ONLY), header
    if "--budget-gib" in extra:
        assert header[-1] == "fits" and "chosen" in compact and "runner-up" in compact
    main(README_PLAN + extra + ["--wide"])
    wide = _header(capsys.readouterr().out)
    assert set(WIDE_ONLY) <= set(wide), wide


def test_plan_command_json_holds_every_number_of_the_wide_table(capsys):
    import json

    from megatron_fsdp_v2.plan.__main__ import main

    main(README_PLAN + ["--hybrid", "2x4", "--budget-gib", "20", "--activation-gib", "4"])
    compact = capsys.readouterr().out
    main(README_PLAN + ["--hybrid", "2x4", "--budget-gib", "20", "--activation-gib", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 8 and data["budget_bytes"] == 20 << 30 and data["optimizer"] == "adam"
    names = [c["name"] for c in data["candidates"]]
    assert names == ["no_shard", "optim", "optim_grads", "optim_grads_params", "no_shard 2x4", "optim 2x4",
                     "optim_grads 2x4", "optim_grads_params 2x4"], names
    assert f"chosen {data['chosen']}" in compact and f"runner-up {data['runner_up']}" in compact
    for candidate in data["candidates"]:
        assert candidate["peak_bytes"] == candidate["persistent_bytes"] + candidate["temporaries"]["peak"]
        assert candidate["persistent_bytes"] == max(r["total"] for r in candidate["ranks"])
        assert candidate["peak_with_activations"] >= candidate["peak_bytes"]
    zero3 = data["candidates"][3]
    assert zero3["comm"]["all_gather"]["count"] > 0 and zero3["moved_bytes"] == zero3["wire_bytes"]
