"""Small models with awkward shapes for the parity, counting and memory tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    """A unit: odd-sized linear layers, one without bias, and a 0-d scale."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        self.scale = nn.Parameter(torch.tensor(0.9))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + self.scale * self.down(torch.tanh(self.up(self.norm(x))))


class UnevenNet(nn.Module):
    """Embedding-free regression net: an input projection, ``depth`` Blocks, a head and a 0-d bias."""

    def __init__(self, width: int = 13, hidden: int = 37, depth: int = 3, out: int = 5) -> None:
        super().__init__()
        self.proj = nn.Linear(7, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, out, bias=False)
        self.offset = nn.Parameter(torch.tensor(0.1))

    def forward(self, x):
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.offset


def make_batches(seed: int, rank: int, count: int, batch: int = 4):
    """Deterministic (input, target) pairs, different per rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [(torch.randn(batch, 7, generator=g), torch.randn(batch, 5, generator=g)) for _ in range(count)]


class Tiny(nn.Module):
    """A unit holding one element: smaller than dp_size, so most ranks' shards of it are empty."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([1.1]))

    def forward(self, x):
        return x * self.gain


class EdgeNet(nn.Module):
    """Tied embedding/output weights, a frozen layer, a unit smaller than dp_size, a 0-d scale."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.tiny = Tiny()
        self.block = Block(width, 9)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, tokens):
        h = self.tiny(self.frozen(self.emb(tokens)))
        return self.out(self.block(h)) / self.temperature


class HeadNet(nn.Module):
    """A token model whose root (an embedding and an output layer, untied) outweighs its one Block:
    ZeRO-3's root gradients reduce at the end of backward, where the root's gathered weights and its
    reduce input could meet."""

    def __init__(self, vocab: int = 96, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.block = Block(width, 5)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        return self.out(self.block(self.emb(tokens)))


def make_token_batches(seed: int, rank: int, count: int, batch: int = 3, seq: int = 5, vocab: int = 11):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(count)]
