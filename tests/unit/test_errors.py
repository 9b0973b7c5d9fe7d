"""Bad input gets an exception that names the argument, what was got and what is allowed."""

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard

from .dist_utils import run_distributed
from .models import Block, UnevenNet


def test_unknown_strategy_error_lists_auto_too(single_rank_group):
    with pytest.raises(ValueError) as info:
        fully_shard(UnevenNet(), sharding_strategy="zero4")
    assert str(info.value) == ("sharding_strategy must be one of ['no_shard', 'optim', 'optim_grads', "
                               "'optim_grads_params', 'auto'], got 'zero4'.")


def test_unknown_allocator(single_rank_group):
    with pytest.raises(ValueError, match=r"allocator must be one of .*got 'cuda_graphs'"):
        fully_shard(UnevenNet(), sharding_strategy="optim", allocator="cuda_graphs")


def test_unit_modules_must_be_module_classes(single_rank_group):
    with pytest.raises(TypeError, match="unit_modules must contain nn.Module subclasses, got 'Block'"):
        fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=["Block"])
    with pytest.raises(TypeError, match="unit_modules must contain nn.Module subclasses"):
        fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[int])


def test_unit_modules_matching_nothing_is_an_error(single_rank_group):
    with pytest.raises(ValueError, match=r"unit_modules: no submodule of UnevenNet is an instance of \['GRU'\]"):
        fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[nn.GRU])


def test_parameters_on_two_devices(single_rank_group):
    model = UnevenNet()
    model.head.to("meta")
    with pytest.raises(ValueError, match=r"module: all parameters must be on one device, got parameters on "
                                         r"\['cpu', 'meta'\]"):
        fully_shard(model, sharding_strategy="optim")


def test_integer_parameters(single_rank_group):
    model = UnevenNet()
    model.count = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"module: parameter 'count' has dtype torch.int64; only floating-point"):
        fully_shard(model, sharding_strategy="optim")


def test_wrapping_twice(single_rank_group):
    model = fully_shard(UnevenNet(), sharding_strategy="optim")
    with pytest.raises(ValueError, match="module: FullyShardedUnevenNet is already wrapped by fully_shard"):
        fully_shard(model, sharding_strategy="optim")


def test_bad_mixed_precision(single_rank_group):
    with pytest.raises(TypeError, match="mixed_precision must be a MixedPrecisionPolicy or None, got dict"):
        fully_shard(UnevenNet(), sharding_strategy="optim", mixed_precision={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match=r"MixedPrecisionPolicy.main_params_dtype must be a floating torch.dtype, "
                                         r"got torch.int32"):
        MixedPrecisionPolicy(main_params_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"main_grads_dtype must equal main_params_dtype \(torch.float32\), "
                                         r"got torch.bfloat16"):
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16)


def test_not_a_module(single_rank_group):
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got Tensor"):
        fully_shard(torch.zeros(3), sharding_strategy="optim")


def test_load_full_state_dict_names_bad_keys(single_rank_group):
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block])
    sd = model.full_state_dict()
    sd.pop("head.weight")
    sd["extra.weight"] = torch.zeros(2)
    sd["proj.bias"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"missing keys \['head.weight'\], unexpected keys \['extra.weight'\], "
                                         r"mis-shaped keys \['proj.bias: expected \(13,\), got \(4,\)'\]"):
        model.load_full_state_dict(sd)


def _mismatch_worker(rank, world_size):
    model = UnevenNet(width=13 if rank == 0 else 14)
    try:
        fully_shard(model, sharding_strategy="optim")
    except ValueError as err:
        return str(err)
    return None


def test_ranks_with_different_models_fail_fast_instead_of_hanging():
    messages = run_distributed(_mismatch_worker, 2)
    assert messages[0] == ("module: parameter names/shapes/dtypes differ between data-parallel ranks: rank 0 "
                           "disagrees with ranks [1]; first difference: parameter 'proj.weight' is shape (13, 7) "
                           "dtype torch.float32 on rank 0 but shape (14, 7) dtype torch.float32 on rank 1. Every "
                           "rank must build the same model before fully_shard.")
    assert messages[1] is not None and ("rank 1 disagrees with ranks [0]; first difference: parameter "
                                        "'proj.weight' is shape (14, 7) dtype torch.float32 on rank 1 but shape "
                                        "(13, 7) dtype torch.float32 on rank 0") in messages[1]


def test_first_difference_names_a_missing_or_renamed_parameter():
    from megatron_fsdp_v2.wrap.checks import first_difference

    a = [("w", (2, 3), "torch.float32", True), ("b", (3,), "torch.float32", True)]
    assert first_difference(a, a[:1], 0, 2) == ("first difference: rank 0 has 2 parameters, rank 2 1; the first "
                                                "extra one is 'b' (shape (3,) dtype torch.float32)")
    renamed = [a[0], ("c", (3,), "torch.bfloat16", False)]
    assert first_difference(a, renamed, 0, 1) == (
        "first difference: parameter #1 is 'b' (shape (3,) dtype torch.float32) on rank 0 but 'c' "
        "(shape (3,) dtype torch.bfloat16 (frozen)) on rank 1")
