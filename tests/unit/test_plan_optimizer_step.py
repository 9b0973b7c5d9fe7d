"""``plan``'s ``foreach_step`` equals what torch's foreach ``optimizer.step()`` allocates beyond the
bytes it finds, per rank, every strategy, at dp 1 and 2: one main-dtype copy of the rank's pieces
for Adam / AdamW (``torch._foreach_sqrt``; Adam's coupled weight decay's ``torch._foreach_add``
first, as large), none for SGD with momentum. Measured on CPU from the allocator's events of torch's
foreach kernel (``_multi_tensor_adam`` / ``_multi_tensor_sgd``) in the second step (the first makes
the state; ZeRO-1/2's weight refresh after the step is ours, not the kernel's); its 0-d CPU
tensors (the step counter's increment) are the only bytes beyond the plan's."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.optim.adam as torch_adam
import torch.optim.sgd as torch_sgd

from megatron_fsdp_v2 import STRATEGY_NAMES, MixedPrecisionPolicy, OffloadPolicy, fully_shard, plan

from tests.cpu_live_bytes import allocated_peak

from .dist_utils import run_distributed
from .models import Block, EdgeNet, Tiny, UnevenNet, make_batches, make_token_batches

SCALARS = 64          # bytes of the step's 0-d CPU tensors, at most (12 B measured with torch 2.13)
MODELS = {"uneven": (UnevenNet, [Block], make_batches),
          "edge": (EdgeNet, [Block, Tiny], make_token_batches)}     # tied weights, a frozen layer
OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
              "adam": lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.1, foreach=True),
              "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)}
KERNELS = {"adamw": (torch_adam, "_multi_tensor_adam"), "adam": (torch_adam, "_multi_tensor_adam"),
           "sgd_momentum": (torch_sgd, "_multi_tensor_sgd")}
CASES = [(m, s, o) for m in MODELS for s in STRATEGY_NAMES for o in OPTIMIZERS]


def _loss(out, target):
    if out.dim() == 3:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return ((out - target) ** 2).mean()


def _kernel_peak(opt, optimizer: str) -> int:
    """``opt.step()``, and the most torch's foreach kernel allocated in it beyond what it found."""
    module, name = KERNELS[optimizer]
    kernel, peaks = getattr(module, name), []

    def measured(*args, **kwargs):
        peaks.append(allocated_peak(lambda: kernel(*args, **kwargs))[0])

    setattr(module, name, measured)           # torch's step looks the kernel up when it runs
    try:
        opt.step()
    finally:
        setattr(module, name, kernel)
    assert len(peaks) == 1, peaks             # one param group
    return peaks[0]


def _worker(rank, world_size):
    peaks = {}
    for model_name, strategy, optimizer in CASES:
        model_fn, units, batches = MODELS[model_name]
        torch.manual_seed(0)
        model = fully_shard(model_fn(), sharding_strategy=strategy, unit_modules=units)
        opt = OPTIMIZERS[optimizer](model.parameters())
        for step in range(2):
            for x, y in batches(step, rank, 1):
                _loss(model(x), y).backward()
            if step == 1:
                peaks[(model_name, strategy, optimizer)] = _kernel_peak(opt, optimizer)
            else:
                opt.step()
            opt.zero_grad()
    return peaks


@functools.lru_cache(maxsize=None)
def _measured(world_size: int):
    return run_distributed(_worker, world_size)


def _planned(model_name, strategy, optimizer, world_size, **kwargs):
    model_fn, units, _ = MODELS[model_name]
    with torch.device("meta"):
        model = model_fn()
    return plan(model, strategy, world_size=world_size, unit_modules=units, optimizer=optimizer, device="cpu",
                **kwargs)[strategy]


@pytest.mark.parametrize("world_size", [1, 2])
def test_foreach_step_is_what_torchs_foreach_step_allocates(world_size):
    for rank, peaks in enumerate(_measured(world_size)):
        for model_name, strategy, optimizer in CASES:
            planned = _planned(model_name, strategy, optimizer, world_size)
            want = planned.foreach_step[rank]
            if optimizer == "sgd_momentum":
                assert want == 0
            else:     # one main-dtype (fp32) copy of this rank's pieces: the optimizer state's half
                assert want == planned.ranks[rank]["optimizer_state"] // 2 > 0
            got = peaks[(model_name, strategy, optimizer)]
            assert want <= got <= want + SCALARS, (rank, model_name, strategy, optimizer, got, want)


def test_foreach_step_is_in_the_main_dtype_on_the_device_only_and_in_every_output():
    fp32 = _planned("uneven", "optim_grads_params", "adamw", 2)
    bf16 = _planned("uneven", "optim_grads_params", "adamw", 2,
                    mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert bf16.foreach_step == fp32.foreach_step == (6864, 6128)      # fp32 main weights either way
    assert fp32.foreach_step_bytes == 6864
    assert fp32.peak_bytes == fp32.persistent_bytes + fp32.temporaries["peak"]     # not in the peak
    offloaded = _planned("uneven", "optim_grads_params", "adamw", 2, offload=OffloadPolicy(fraction=1.0))
    assert offloaded.foreach_step == (0, 0)                            # the host steps every group
    assert fp32.as_dict()["foreach_step"] == [6864, 6128] and fp32.as_dict()["foreach_step_bytes"] == 6864
    with torch.device("meta"):
        model = UnevenNet()
    table = str(plan(model, "optim_grads_params", world_size=2, unit_modules=[Block], optimizer="adamw",
                     device="cpu"))
    header, row = (re.split(r"\s{2,}", line.strip()) for line in (table.splitlines()[0], table.splitlines()[2]))
    column = header.index("foreach step")
    assert header[column - 1] == "peak" and row[column] == "6.70 KiB", (header, row)    # 6864 B
    assert "bytes allocated (tensor sizes), not reserved" in table
