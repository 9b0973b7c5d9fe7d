"""``WrapOptions`` (wrap/options.py): every ``fully_shard`` setting travels as one checked object."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch.nn as nn

from megatron_fsdp_v2 import fully_shard
from megatron_fsdp_v2.fully_shard import FullyShardedModule
from megatron_fsdp_v2.wrap.options import WrapOptions

#: fully_shard's arguments that are not settings: the module and the groups (communicators).
NOT_OPTIONS = {"module", "process_group", "expert_process_group"}


def test_every_fully_shard_setting_is_a_wrap_option_with_the_same_default():
    parameters = inspect.signature(fully_shard).parameters
    fields = {f.name: f for f in dataclasses.fields(WrapOptions)}
    assert set(parameters) - NOT_OPTIONS == set(fields)
    for name, field in fields.items():
        if parameters[name].default is not inspect.Parameter.empty:
            assert field.default == parameters[name].default, name


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(persistent_grads=1), TypeError, "persistent_grads must be True or False, got 1."),
    (dict(unused_param_grads="zero"), ValueError, "unused_param_grads must be 'none' or 'zeros', got 'zero'."),
    (dict(auto_strategy=object()), ValueError, "auto_strategy is used with sharding_strategy='auto' only"),
    (dict(init_fn=3), TypeError, "init_fn must be a callable taking a module, or None, got int."),
])
def test_check_names_the_setting_what_was_given_and_what_is_allowed(kwargs, error, message):
    options = WrapOptions("optim", **kwargs)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        options.check(nn.Linear(2, 2), FullyShardedModule, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.offload = None


def test_check_returns_the_strategy_or_none_for_auto():
    assert WrapOptions("optim_grads").check(nn.Linear(2, 2), FullyShardedModule, None).name == "optim_grads"
    assert WrapOptions("auto").check(nn.Linear(2, 2), FullyShardedModule, None) is None
