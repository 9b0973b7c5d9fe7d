"""The model of PyTorch FSDP2's memory test and the bounds that test asserts.

Origin: pytorch/pytorch ``test/distributed/_composable/fsdp/test_fully_shard_memory.py``
(``test_fully_shard_training_memory``): ``Transformer(ModelArgs(vocab_size=32, n_layers=3,
dim=768, n_heads=12, weight_tying=False))`` from
``torch.testing._internal.distributed._tensor.common_dtensor``, every ``TransformerBlock`` and the
root wrapped, ``Adam(lr=1e-2, foreach=False)`` ("intermediates increase peak memory" with
foreach), one input of shape (1, 4), fp32. It reads ``torch.cuda.memory_stats()`` active bytes
in MB (1e6 B) above a base taken before the model exists, at world size 2.

The model is written out here with the same modules, parameter names, shapes and forward:
importing torch's own needs ``expecttest`` (torch.testing._internal), which the venvs lack.
``fsdp2_bounds`` gives the test's ``expected_mem_mb`` formulas (reshard_after_forward=True, no CPU
offload) in bytes, for any world size: ``model_sharded_numel`` is ``ceil(numel / world)``
(upstream writes ``(numel + 1) // 2`` for its 2 ranks).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["FSDP2_TEST_ARGS", "Transformer", "TransformerBlock", "fsdp2_bounds", "fsdp2_input", "fsdp2_numels"]

#: upstream's ModelArgs for the memory test (max_seq_len and dropout_p are ModelArgs' defaults)
FSDP2_TEST_ARGS = dict(vocab_size=32, n_layers=3, dim=768, n_heads=12, max_seq_len=16, dropout_p=0.1)
MB = 1e6
F32 = 4


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout_p: float) -> None:
        super().__init__()
        self.head_dim, self.n_heads, self.dropout_p = dim // n_heads, n_heads, dropout_p
        self.resid_dropout = nn.Dropout(dropout_p)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        q, k, v = (w(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, None, self.dropout_p if self.training else 0, True)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1)))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout_p: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads, dropout_p)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim, dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab_size: int = 32, n_layers: int = 3, dim: int = 768, n_heads: int = 12,
                 max_seq_len: int = 16, dropout_p: float = 0.1) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.dropout = nn.Dropout(dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, dropout_p) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        _, seq_len = tokens.size()
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(0, seq_len, device=tokens.device))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def fsdp2_input(device, vocab_size: int = 32) -> torch.Tensor:
    """Upstream's "small input to minimize activation memory usage"."""
    return torch.randint(0, vocab_size, (1, 4), device=device)


def fsdp2_numels(model: Transformer, world: int) -> dict:
    """The element counts upstream's formulas use, for ``world`` ranks."""
    unsharded = sum(p.numel() for p in model.parameters())
    non_block = sum(p.numel() for m in (model.tok_embeddings, model.pos_embeddings, model.norm, model.output)
                    for p in m.parameters())
    return {"unsharded": unsharded, "sharded": math.ceil(unsharded / world),
            "max_block": sum(p.numel() for p in model.layers[0].parameters()), "non_block": non_block}


def fsdp2_bounds(numels: dict) -> dict:
    """Upstream's ``expected_mem_mb`` per point, in bytes (reshard_after_forward=True, no offload):
    init and current after init (buffer 4 MB on the peak), forward and backward peaks (buffer
    16 MB), the optimizer step's peak (measured after a peak reset), after zero_grad."""
    s, block, non_block = numels["sharded"], numels["max_block"], numels["non_block"]
    init = (s + block) * F32
    return {
        "init_peak": init + 4 * MB,
        "init_current": init,
        "forward_peak": (3 * block + non_block + s) * F32 + 16 * MB,
        "backward_peak": (3 * block + non_block + 2 * s) * F32 + 16 * MB,
        "step_peak": 4 * s * F32 + 16 * MB,           # sharded params + grads + 2 Adam states
        "after_zero_grad": 3 * s * F32 + 2 * 16 * MB,
    }
