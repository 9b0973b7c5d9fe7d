"""The comparison logic of ``tests/functional/validate_megatron_checkpoint.py`` (the GPU validation of
checkpoints across data-parallel sizes), on CPU, gloo:

* a checkpoint saved at dp 2 (``optim_grads_params``: every tensor in several chunks), loaded at dp 1
  into ``no_shard`` and saved again at once reads back as the same global tensors: bitwise equal,
  equal sha256 fingerprints, common optimizer state equal;
* one changed element, a missing tensor, a changed learning rate in the common state are each
  reported, naming the tensor (or the common-state entry);
* the loss tolerance arithmetic: the resumed run's second logged loss is compared with the mean of
  the reference's first two resumed iterations, tolerance = max(factor x noise, floor).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

def _script():
    from tests.functional import validate_megatron_checkpoint

    return validate_megatron_checkpoint


def save_worker(rank, world_size, path, strategy):
    from tests.unit.test_megatron_checkpoint import _megatron_on_cpu, _model_and_optimizer, _save, _train

    with _megatron_on_cpu(world_size, rank, 2) as batches:
        wrapper, config, optimizer = _model_and_optimizer(strategy)
        _train(wrapper, config, optimizer, batches, 2)
        _save(wrapper, optimizer, path)


def round_trip_worker(rank, world_size, source, path, strategy):
    """Load ``source`` into ``strategy`` at this world size and save it again at once."""
    from tests.unit.test_megatron_checkpoint import _load, _megatron_on_cpu, _model_and_optimizer, _save

    with _megatron_on_cpu(world_size, rank, 2):
        wrapper, _, optimizer = _model_and_optimizer(strategy)
        _load(wrapper, optimizer, source)
        _save(wrapper, optimizer, path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("validate_ckpt"))
    saved, resaved = os.path.join(base, "dp2"), os.path.join(base, "dp1")
    run_distributed(save_worker, 2, saved, "optim_grads_params")
    run_distributed(round_trip_worker, 1, saved, resaved, "no_shard")
    return saved, resaved


def test_state_resharded_dp2_to_dp1_reads_back_bitwise_equal(checkpoints):
    from torch.distributed.checkpoint import FileSystemReader

    script = _script()
    saved, resaved = checkpoints
    chunks = {k: len(m.chunks) for k, m in FileSystemReader(saved).read_metadata().state_dict_metadata.items()
              if hasattr(m, "chunks")}
    assert max(chunks.values()) >= 2                  # dp 2 wrote tensors in pieces
    want, got = script.read_checkpoint(saved), script.read_checkpoint(resaved)
    keys = sorted(want.tensors)
    # Megatron's fully_reshardable layout (our default save): optimizer.state.<state>.<param name>
    assert want.common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in keys)
    assert any(k.startswith("optimizer.state.param.") for k in keys) and any(not k.startswith("optimizer.") for k in keys)
    result = script.compare_states(want, got)
    assert result.equal, result.first_difference
    assert result.first_difference is None
    assert result.tensors == len(keys)
    assert result.elements == sum(t.numel() for t in want.tensors.values()) > 0
    assert result.fingerprints[0] == result.fingerprints[1] == script.fingerprint(got)
    # every group's step is 2 (two Adam steps were taken before saving); the layout keeps it in the common state
    groups = got.common["optimizer"]["optimizer"]["param_groups"]
    assert len(groups) == 2 and [g["step"] for g in groups] == [2.0, 2.0]


def test_perturbed_state_names_the_tensor(checkpoints):
    script = _script()
    saved, resaved = checkpoints
    want, got = script.read_checkpoint(saved), script.read_checkpoint(resaved)
    key = sorted(k for k in got.tensors if k.startswith("optimizer.state.exp_avg_sq."))[-1]
    changed = dict(got.tensors)
    changed[key] = got.tensors[key].clone()
    flat = changed[key].view(-1)
    flat[flat.numel() // 2] = torch.nextafter(flat[flat.numel() // 2], torch.tensor(float("inf")))  # one ulp
    result = script.compare_states(want, script.CheckpointState(changed, got.common))
    assert not result.equal
    assert result.first_difference.startswith(f"{key}: 1 of {flat.numel()} elements differ")
    assert result.fingerprints[0] != result.fingerprints[1]

    # a zero of the saved state read back as -0.0: equal values, different bits
    zero_key = sorted(got.tensors)[0]
    zeroed = script.CheckpointState({**want.tensors, zero_key: want.tensors[zero_key].clone().fill_(0.0)}, want.common)
    negative = script.CheckpointState({**got.tensors, zero_key: got.tensors[zero_key].clone().fill_(-0.0)}, got.common)
    assert torch.equal(zeroed.tensors[zero_key], negative.tensors[zero_key])
    result = script.compare_states(zeroed, negative)
    assert not result.equal and result.first_difference.startswith(f"{zero_key}: ")

    missing = {k: v for k, v in got.tensors.items() if k != key}
    result = script.compare_states(want, script.CheckpointState(missing, got.common))
    assert not result.equal and key in result.first_difference and "missing" in result.first_difference

    groups = [dict(g) for g in got.common["optimizer"]["optimizer"]["param_groups"]]
    groups[1]["lr"] *= 2
    common = {"optimizer": {**got.common["optimizer"], "optimizer": {"param_groups": groups}},
              "iteration": got.common["iteration"]}
    result = script.compare_states(want, script.CheckpointState(got.tensors, common))
    assert not result.equal
    assert result.first_difference == "common.optimizer.optimizer.param_groups[1].lr: 0.01 != 0.02"


def test_loss_tolerance_arithmetic():
    script = _script()
    reference = {6: 7.0, 7: 6.0, 8: 5.0}
    # the resumed run's second logged loss is the mean of its first two iterations: 6.5, not 6.0
    resumed = {6: 7.0, 7: 6.5, 8: 5.0 * (1 + 2e-4)}
    assert script.worst_rel(resumed, reference, range(6, 9)) == pytest.approx(2e-4)
    other = {6: 7.0 * (1 - 1e-4), 7: 6.0, 8: 5.0 * (1 + 3e-4)}
    noise = script.noise_floor(other, reference, range(6, 9))
    assert noise == pytest.approx(3e-4)
    assert script.tolerance(noise, 4.0, 1e-5) == pytest.approx(1.2e-3)
    assert script.tolerance(0.0, 4.0, 1e-5) == 1e-5
    assert script.parse_args([]).noise_factor == 10.0 and script.parse_args([]).rtol_floor == 1e-5
