"""A model built on the meta device and wrapped over torch's fake process group (one process
playing rank 0 of N, to measure a rank's memory before launch) is materialized on the current
accelerator, as under NCCL in the real job, not on the CPU (the largest-model search at a fake
8-way group, docs/benchmarks_history.md, failed in the embedding with "index is on cuda:0, different from other tensors on cpu")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron_fsdp_v2 import fully_shard
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16))
    model = fully_shard(model, sharding_strategy="optim_grads_params",
                        init_fn=lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    out = model(torch.arange(8, device=next(model.parameters()).device))
    print(sorted({p.device.type for p in model.parameters()}), out.device.type, tuple(out.shape))
    dist.destroy_process_group()
""")


def _devices() -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the CPU case; the GPU case below")
def test_meta_model_over_the_fake_group_stays_on_the_cpu_without_an_accelerator():
    assert _devices() == "['cpu'] cpu (8, 16)"


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs a GPU: the accelerator case")
def test_meta_model_over_the_fake_group_is_materialized_on_the_accelerator():
    kind = torch.accelerator.current_accelerator().type
    assert _devices() == f"['{kind}'] {kind} (8, 16)"
