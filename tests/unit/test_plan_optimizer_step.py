"""``plan``'s ``step_temporaries`` against what torch's ``optimizer.step()`` allocates beyond the
bytes it finds, per rank, every strategy, at dp 1 and 2.

* ``foreach``: exactly one main-dtype copy of the rank's pieces for Adam / AdamW
  (``torch._foreach_sqrt``; Adam's coupled weight decay's ``torch._foreach_add`` first, as large),
  none for SGD with momentum.
* ``single`` (``foreach=False``): a bound, the largest piece times 3 (AdamW) or 4 (Adam with weight
  decay), at most one piece above what the kernel holds (the previous parameter's denominator).

Measured on CPU from the allocator's events of torch's kernel (``_multi_tensor_adam`` /
``_single_tensor_adam`` and SGD's) in the second step (the first makes the state; ZeRO-1/2's weight
refresh after the step is ours, not the kernel's); its 0-d CPU tensors (the step counter's
increment) are the only bytes beyond the plan's."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.optim.adam as torch_adam
import torch.optim.sgd as torch_sgd

from megatron_fsdp_v2 import STRATEGY_NAMES, MixedPrecisionPolicy, OffloadPolicy, fully_shard, plan
from megatron_fsdp_v2.plan.optimizer_step import SINGLE_STEP_COPIES

from tests.cpu_live_bytes import allocated_peak

from .dist_utils import run_distributed
from .models import Block, EdgeNet, Tiny, UnevenNet, make_batches, make_token_batches

SCALARS = 64          # bytes of the step's 0-d CPU tensors, at most (12 B measured with torch 2.13)
MODELS = {"uneven": (UnevenNet, [Block], make_batches),
          "edge": (EdgeNet, [Block, Tiny], make_token_batches)}     # tied weights, a frozen layer
OPTIMIZERS = {"adamw": lambda params, foreach: torch.optim.AdamW(params, lr=1e-3, foreach=foreach),
              "adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-3, weight_decay=0.1, foreach=foreach),
              "sgd_momentum": lambda params, foreach: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)}
KERNEL_NAMES = {("adam", "foreach"): "_multi_tensor_adam", ("adam", "single"): "_single_tensor_adam",
                ("sgd", "foreach"): "_multi_tensor_sgd", ("sgd", "single"): "_single_tensor_sgd"}
STEP_KERNELS = ("foreach", "single")
CASES = [(m, s, o, k) for m in MODELS for s in STRATEGY_NAMES for o in OPTIMIZERS for k in STEP_KERNELS]


def _loss(out, target):
    if out.dim() == 3:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return ((out - target) ** 2).mean()


def _kernel_peak(opt, optimizer: str, kernel_name: str) -> int:
    """``opt.step()``, and the most torch's kernel allocated in it beyond what it found."""
    module = torch_sgd if optimizer.startswith("sgd") else torch_adam
    name = KERNEL_NAMES[("sgd" if optimizer.startswith("sgd") else "adam", kernel_name)]
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


def _local(param):
    return param.to_local() if hasattr(param, "to_local") else param


def _worker(rank, world_size):
    peaks = {}
    for model_name, strategy, optimizer, kernel in CASES:
        model_fn, units, batches = MODELS[model_name]
        torch.manual_seed(0)
        model = fully_shard(model_fn(), sharding_strategy=strategy, unit_modules=units)
        opt = OPTIMIZERS[optimizer](model.parameters(), kernel == "foreach")
        for step in range(2):
            for x, y in batches(step, rank, 1):
                _loss(model(x), y).backward()
            if step == 1:
                largest = max(_local(p).numel() * _local(p).element_size() for p in model.parameters() if p.requires_grad)
                peaks[(model_name, strategy, optimizer, kernel)] = _kernel_peak(opt, optimizer, kernel), largest
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
def test_step_temporaries_are_what_torchs_kernels_allocate(world_size):
    for rank, peaks in enumerate(_measured(world_size)):
        for model_name, strategy, optimizer, kernel in CASES:
            planned = _planned(model_name, strategy, optimizer, world_size, optimizer_kernel=kernel)
            want = planned.step_temporaries[rank]
            got, largest = peaks[(model_name, strategy, optimizer, kernel)]
            case = (rank, model_name, strategy, optimizer, kernel, got, want)
            if optimizer == "sgd_momentum":
                assert want == 0
                low = 0
            elif kernel == "foreach":    # one main-dtype (fp32) copy of this rank's pieces: the optimizer state's half
                assert want == planned.ranks[rank]["optimizer_state"] // 2 > 0
                low = want
            else:                        # a bound, at most one piece (the previous parameter's) above the kernel
                assert want == SINGLE_STEP_COPIES[optimizer] * largest > 0, case
                low = want - largest
            assert low <= got <= want + SCALARS, case


def test_step_temporaries_are_in_the_main_dtype_on_the_device_only_and_in_every_output():
    fp32 = _planned("uneven", "optim_grads_params", "adamw", 2)
    bf16 = _planned("uneven", "optim_grads_params", "adamw", 2,
                    mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert fp32.optimizer_kernel == "foreach"                            # torch's default on CUDA
    assert bf16.step_temporaries == fp32.step_temporaries == (6864, 6128)   # fp32 main weights either way
    assert fp32.step_temporaries_bytes == 6864
    assert fp32.peak_bytes == fp32.persistent_bytes + fp32.temporaries["peak"]     # not in the peak
    assert fp32.step_peak_bytes == fp32.phases["step"] + 6864
    offloaded = _planned("uneven", "optim_grads_params", "adamw", 2, offload=OffloadPolicy(fraction=1.0))
    assert offloaded.step_temporaries == (0, 0)                         # the host steps every group
    assert _planned("uneven", "optim_grads_params", "adamw", 2, optimizer_kernel="fused").step_temporaries == (0, 0)
    out = fp32.as_dict()
    assert out["step_temporaries"] == [6864, 6128] and out["step_temporaries_bytes"] == 6864
    assert out["optimizer_kernel"] == "foreach" and out["fit_bytes"] == fp32.fit_bytes
    with torch.device("meta"):
        model = UnevenNet()
    table = str(plan(model, "optim_grads_params", world_size=2, unit_modules=[Block], optimizer="adamw",
                     device="cpu"))
    header, row = (re.split(r"\s{2,}", line.strip()) for line in (table.splitlines()[0], table.splitlines()[2]))
    column = header.index("step temps")
    assert header[column - 1] == "peak" and row[column] == "6.70 KiB", (header, row)    # 6864 B
    assert "bytes allocated (tensor sizes), not reserved" in table and "adamw (foreach kernel)" in table


def test_the_budget_must_hold_the_optimizer_steps_peak():
    """A budget between a plan's temporaries' peak and its foreach step's peak: the plan fits with a
    fused step and not with torch's default foreach one, and the error says the step's peak."""
    with torch.device("meta"):
        model = UnevenNet()
    fused = plan(model, "no_shard", world_size=1, unit_modules=[Block], optimizer="adamw", device="cpu",
                 optimizer_kernel="fused")["no_shard"]
    foreach = plan(model, "no_shard", world_size=1, unit_modules=[Block], optimizer="adamw",
                   device="cpu")["no_shard"]
    assert fused.fit_bytes == fused.peak_bytes < foreach.fit_bytes == foreach.step_peak_bytes
    budget = fused.fit_bytes
    assert plan(model, "no_shard", world_size=1, unit_modules=[Block], optimizer="adamw", device="cpu",
                optimizer_kernel="fused", budget_bytes=budget).chosen.strategy == "no_shard"
    with pytest.raises(ValueError, match=r"its foreach optimizer step .* KiB\)"):
        plan(model, "no_shard", world_size=1, unit_modules=[Block], optimizer="adamw", device="cpu",
             budget_bytes=budget)
    with pytest.raises(ValueError, match=r"optimizer_kernel must be one of \['foreach', 'fused', 'single'\], "
                                         r"got 'apex'"):
        plan(model, "no_shard", optimizer_kernel="apex")
