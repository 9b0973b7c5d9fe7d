"""bf16 compute weights, fp32 main weights and grad accumulation: parity with a hand-written
bf16-compute / fp32-master data-parallel reference, for every strategy."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_v2 import STRATEGY_NAMES, MixedPrecisionPolicy, fully_shard

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn

K = 2
STEPS = 3


def reference_masters(rank, world_size, grad_comm_dtype):
    """fp32 masters -> bf16 compute copy -> bf16 grads summed in fp32 over micro-batches ->
    mean over ranks (in grad_comm_dtype) -> AdamW on the masters."""
    torch.manual_seed(0)
    master = UnevenNet()
    compute = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    for step in range(STEPS):
        accum = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        for x, y in make_batches(step, rank, K):
            compute.zero_grad()
            loss_fn(compute(x.bfloat16()).float(), y).backward()
            for n, p in compute.named_parameters():
                accum[n] += p.grad.float()
        for n, p in master.named_parameters():
            g = accum[n].to(grad_comm_dtype)
            dist.all_reduce(g)
            p.grad = g.float() / world_size
        opt.step()
        with torch.no_grad():
            for (n, p), (_, c) in zip(master.named_parameters(), compute.named_parameters()):
                c.copy_(p)
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def mp_worker(rank, world_size):
    out = {}
    for comm_dtype in (torch.float32, torch.bfloat16):
        ref = reference_masters(rank, world_size, comm_dtype)
        for strategy in STRATEGY_NAMES:
            torch.manual_seed(0)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, grad_comm_dtype=comm_dtype)
            model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block],
                                mixed_precision=policy)
            compute_dtypes = {p.dtype for g in model._fsdp_engine.groups for p in g.params}
            main_dtypes = {p.dtype for p in model.parameters()}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(STEPS):
                for i, (x, y) in enumerate(make_batches(step, rank, K)):
                    with (model.no_sync() if i < K - 1 else contextlib.nullcontext()):
                        loss_fn(model(x.bfloat16()).float(), y).backward()
                grad_dtypes = {p.grad.dtype for p in model.parameters()}
                opt.step()
                opt.zero_grad()
            full = model.full_state_dict()
            err = max(float((full[n] - ref[n]).abs().max()) for n in ref)
            out[(strategy, str(comm_dtype))] = (err, compute_dtypes, main_dtypes, grad_dtypes,
                                                model.comm_stats()["reduce_scatter"]["bytes"],
                                                model.comm_stats()["all_reduce"]["bytes"])
    return out


def test_bf16_compute_fp32_master_matches_reference():
    results = run_distributed(mp_worker, 2)
    for result in results:
        for (strategy, comm), (err, compute, main, grads, rs_bytes, ar_bytes) in result.items():
            assert compute == {torch.bfloat16}, strategy
            assert main == {torch.float32} and grads == {torch.float32}, strategy
            # bf16 reductions: ZeRO-2/3 round every micro-batch's reduce, the reference rounds once
            tol = 1e-5 if comm == "torch.float32" else 3e-2
            assert err < tol, (strategy, comm, err)
        # reducing in bf16 halves the bytes of the gradient collectives
        for strategy in STRATEGY_NAMES:
            fp32 = result[(strategy, "torch.float32")]
            bf16 = result[(strategy, "torch.bfloat16")]
            assert bf16[4] * 2 == fp32[4] and bf16[5] * 2 == fp32[5], strategy
