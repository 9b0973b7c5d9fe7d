"""FSDP2's all-gather extension protocol with a class of our own: the 5-argument
``fsdp_pre_all_gather`` (told from torchao's 1-argument form by arity), ``fsdp_post_all_gather``
called once and then with ``out=``, and training equal to the same model without the class."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard
from tests.unit.dist_utils import run_distributed

PRESERVED = {torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
             torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
             torch.ops.aten._to_copy.default, torch.ops.aten.split.Tensor, torch.ops.aten.clone.default}
CALLS = []


class Bf16GatherTensor(torch.Tensor):
    """Gathers itself in bf16 through the 5-argument form and logs every call of the protocol."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func == torch.ops.aten.detach.default:
            return Bf16GatherTensor(args[0]._data)
        args, kwargs = pytree.tree_map_only(Bf16GatherTensor, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, Bf16GatherTensor, out) if func in PRESERVED else out

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return Bf16GatherTensor(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        CALLS.append(("pre", tuple(outer_size), tuple(outer_stride), type(module).__name__, mp_policy.param_dtype,
                      mesh.size()))
        return (self._data.to(torch.bfloat16),), {"marker": 7}

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        CALLS.append(("post", out is not None, metadata["marker"], param_dtype, tuple(outputs[0].shape)))
        if out is not None:
            return None            # the gathered bytes landed in the storage ``out`` views
        (data,) = outputs
        return data, (data,)


def build(custom: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 1))
    if custom:
        model[0].weight = nn.Parameter(Bf16GatherTensor(model[0].weight.detach()))
    return model


def worker(rank, world_size, strategy, custom):
    CALLS.clear()
    model = fully_shard(build(custom), sharding_strategy=strategy,
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(5, 8, generator=g).bfloat16(), torch.randn(5, 1, generator=g)
    losses = []
    for _ in range(4):
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, list(CALLS)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_five_argument_protocol_trains_like_plain_parameters(strategy):
    plain, _ = run_distributed(worker, 3, strategy, False)[0]
    custom, calls = run_distributed(worker, 3, strategy, True)[0]
    assert custom == pytest.approx(plain, abs=1e-6)
    pres = [c for c in calls if c[0] == "pre"]
    posts = [c for c in calls if c[0] == "post"]
    # the whole parameter's size and stride, its module, our policy as FSDP2's, the group's mesh
    assert pres[0][1:] == ((6, 8), (8, 1), "Linear", torch.bfloat16, 3)
    # post: made once (at wrap), then refilled in place at every gather; the metadata passed through
    assert [p[1] for p in posts] == [False] + [True] * (len(posts) - 1)
    assert all(p[2] == 7 and p[3] == torch.bfloat16 for p in posts)
    rows = 6 if strategy == "no_shard" else 3 * 2          # dp 3: pieces of 2 rows, gathered
    assert posts[0][4] == (rows, 8)
    # at wrap, then ZeRO-3: in each step's forward and again in its backward; the others: before
    # the forward of each step whose weights changed (steps 2 to 4)
    gathers = 1 + (2 * 4 if strategy == "optim_grads_params" else 3)
    assert len(pres) == len(posts) == gathers, calls
