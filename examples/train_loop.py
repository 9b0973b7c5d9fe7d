# torchrun --nproc-per-node 2 examples/train_loop.py            (gloo on CPU, NCCL on GPUs)
import contextlib, os, torch, torch.distributed as dist
from megatron_fsdp_v2 import fully_shard, export_full_state_dict

class MyBlock(torch.nn.Module):                            # the repeated layer: one unit each
    def __init__(self, width):
        super().__init__()
        self.ff = torch.nn.Linear(width, width)
    def forward(self, x):
        return x + torch.relu(self.ff(x))

class Model(torch.nn.Module):                              # embedding, blocks, output head
    def __init__(self, vocab=256, width=64, layers=4):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.blocks = torch.nn.Sequential(*[MyBlock(width) for _ in range(layers)])
    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))

def micro_batches(step, count=2):                          # this rank's data: random tokens here
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return [torch.randint(0, 256, (4, 32), generator=g).to(device) for _ in range(count)]

def train(model, opt, steps=5):                            # next-token cross-entropy
    for step in range(steps):
        batches = micro_batches(step)
        for i, tokens in enumerate(batches):               # gradients reduce after the last only
            with model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                logits, targets = model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()
                (torch.nn.functional.cross_entropy(logits, targets) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # global norm, same on all ranks
        opt.step(); opt.zero_grad()                        # the next forward sees the new weights

gpu = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None)
model = fully_shard(Model().to(device), sharding_strategy="optim_grads_params",
                    unit_modules=[MyBlock])
params = list(model.parameters())                          # DTensors with the original shapes
opt = torch.optim.AdamW([                                  # build it AFTER fully_shard
    {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},   # decay matrices only
    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=1e-3, fused=True)
train(model, opt)
with model.summon_full_params():                           # full weights on the module, e.g. to log
    print(f"rank {dist.get_rank()}: |head.weight| = {float(model.head.weight.norm()):.4f}")
export_full_state_dict(model, "model.pt")                  # one file of full tensors, from rank 0
dist.destroy_process_group()
