"""What ZeRO-3 holds on one GPU (a real 1-rank NCCL group) when ``optimizer.step()`` begins, on
FSDP2's memory-test model (tests/fsdp2_memory_model.py), grouped by the Python frames that
allocated each live block (``torch.cuda.memory._record_memory_history(stacks="python")``).

    python3 benchmarks/held_at_step.py        # one GPU, from the repository root

Found with it (docs/benchmarks.md, "ZeRO-3 at FSDP2's memory-test points"): each block's flat main
shard and grad shard (28.34 MB) is served from a 28 MiB segment whose 0.97 MiB remainder, under the
caching allocator's 1 MiB split threshold, stays in the block and counts as allocated.
"""
import collections
import os
import sys
sys.path.insert(0, os.getcwd())
import torch, torch.distributed as dist
from tests.dist_pool import free_port
from tests.fsdp2_memory_model import FSDP2_TEST_ARGS, Transformer, TransformerBlock, fsdp2_input
from megatron_fsdp_v2 import fully_shard

dev = torch.device("cuda", 0); torch.cuda.set_device(dev)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
lin = torch.nn.Linear(768, 768, device=dev); lin(torch.randn(1, 768, device=dev)).sum().backward(); del lin
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
torch.manual_seed(42)
with torch.device(dev):
    model = Transformer(**FSDP2_TEST_ARGS)
model = fully_shard(model, sharding_strategy="optim_grads_params", unit_modules=[TransformerBlock])
optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
loss = model(fsdp2_input(dev)); loss.sum().backward(); del loss
torch.cuda.synchronize()
held = torch.cuda.memory_allocated() - base
snap = torch.cuda.memory._snapshot()
by = collections.Counter(); n = collections.Counter()
for seg in snap["segments"]:
    for blk in seg["blocks"]:
        if blk["state"] != "active_allocated": continue
        fr = [f for f in (blk.get("frames") or []) if "torch/" not in f["filename"] or "megatron_fsdp_v2" in f["filename"]]
        key = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in fr[:4]) or "(none)"
        by[key] += blk["size"]; n[key] += 1
print(f"held above base {held/1e6:.3f} MB")
for key, size in by.most_common(25):
    print(f"{size/1e6:10.3f} MB x{n[key]:4d}  {key}")
