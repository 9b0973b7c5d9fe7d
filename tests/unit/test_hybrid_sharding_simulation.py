"""``benchmarks/hybrid_sharding_simulation.py``: its counted bytes are the package's counted bytes.

The simulation's ``count_bytes(step_collectives(...))`` (bytes per group and collective of one
optimizer step, from ``build_layout`` padding) must equal ``comm_stats()`` of a real wrapped model:
a small Llama-shaped GPT (GQA, SwiGLU, untied output; shapes from the simulation's own
``gpt_units``) with bf16 compute weights and fp32 grads, ``optim_grads_params`` flat over 4 gloo
ranks and hybrid 2 replicas x 2 shards, one step of k=2 micro-batches (the first inside
``no_sync()``) after a warm-up step (so the prefetching schedule is the one counted). Persistent
memory per rank (weights and grads) is checked against ``persistent_bytes()``. HFSDP is not in the
package: only its inner collectives (those of HSDP) are checked against a run; the rest of its
model is analytic and checked for the ring and link arithmetic only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard
from megatron_fsdp_v2.fully_shard import default_alignment

from .dist_utils import run_distributed
from .test_hybrid_sharding import _hybrid_groups


def _load_simulation():
    name = "hybrid_sharding_simulation"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


sim = _load_simulation()

K = 2                                    # micro-batches per step
# Small, but with row-snapping padding at 2 and at 4 shards (so padding is part of what is checked).
TINY = sim.GPTShape(layers=2, hidden=12, ffn=21, heads=4, kv_heads=2, vocab=30)
BF16 = sim.Dtypes(compute=2, main=4, grad=4)


class Layer(nn.Module):
    """One transformer layer with the parameter order of ``gpt_units``' layer unit."""

    def __init__(self, s) -> None:
        super().__init__()
        h, kv = s.hidden, s.kv_heads * s.head_dim
        self.heads, self.kv_heads, self.head_dim, self.kv = s.heads, s.kv_heads, s.head_dim, kv
        self.attn_norm = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, h + 2 * kv, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h)
        self.fc1 = nn.Linear(h, 2 * s.ffn, bias=False)
        self.fc2 = nn.Linear(s.ffn, h, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split([h, self.kv, self.kv], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
                .repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(attn)
        gate, up = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class TinyGPT(nn.Module):
    """Root unit: embedding, final norm, output layer (untied), as ``gpt_units``' root."""

    def __init__(self, s) -> None:
        super().__init__()
        self.embedding = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.final_norm = nn.RMSNorm(s.hidden)
        self.output = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_norm(x))


def _step(model, optimizer, rank, seed, vocab):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for i in range(K):
        tokens = torch.randint(0, vocab, (2, 6), generator=g)
        targets = torch.randint(0, vocab, (2, 6), generator=g)
        loss = lambda: F.cross_entropy(model(tokens).float().reshape(-1, vocab), targets.reshape(-1))  # noqa: E731
        if i < K - 1:
            with model.no_sync():
                loss().backward()
        else:
            loss().backward()
    optimizer.step()
    optimizer.zero_grad()


def step_worker(rank, world, layout, shape_fields):
    s = sim.GPTShape(*shape_fields)
    groups = _hybrid_groups(world, 2) if layout == "2x2" else None
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(s), sharding_strategy="optim_grads_params", unit_modules=[Layer],
                        process_group=groups, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer, rank, 0, s.vocab)          # warm-up: the forward order (prefetch) is known
    model.reset_comm_stats()
    _step(model, optimizer, rank, 1, s.vocab)
    units = [(u.fqn or "<root>", [tuple(shape) for g in u.groups for shape in g.shapes])
             for u in model._fsdp_engine.units]
    groups_per_unit = [len(u.groups) for u in model._fsdp_engine.units]
    return units, groups_per_unit, model.comm_stats(), model.persistent_bytes()


@pytest.mark.parametrize("layout,scheme", [("flat", "flat_zero3"), ("2x2", "hsdp")], ids=["flat4", "hsdp_2x2"])
def test_counted_bytes_match_comm_stats(layout, scheme):
    world = 4
    topo = sim.Topology(world, gpus_per_node=2)
    units = sim.gpt_units(TINY)
    alignment = default_alignment(torch.device("cpu"))
    predicted = sim.count_bytes(sim.step_collectives(units, scheme, topo, K, BF16, alignment))
    want = dict(predicted[sim.SHARD])
    if sim.ACROSS in predicted:
        want[sim.ACROSS] = predicted[sim.ACROSS]
    assert (sim.ACROSS in want) == (scheme == "hsdp")
    memory = sim.memory_per_rank(units, scheme, topo, BF16, alignment)
    shards = topo.world if scheme == "flat_zero3" else topo.inner
    assert any(sim.build_layout(shapes, shards, alignment).padding_numel for _, shapes in units)   # padding counts

    results = run_distributed(step_worker, world, layout, dataclasses.astuple(TINY), timeout=120)
    for rank, (real_units, groups_per_unit, stats, persistent) in enumerate(results):
        assert real_units == [(name, list(shapes)) for name, shapes in units], rank   # gpt_units is the model
        assert groups_per_unit == [1] * len(units), rank
        assert stats == want, (rank, stats, want)
        assert persistent == {"main_weights": memory["main_weights"], "model_weights": memory["compute_weights"],
                              "grads": memory["grads"], "total": memory["main_weights"] + memory["grads"]}, rank
    if scheme == "hsdp":            # HFSDP's inner collectives are HSDP's: the part of it that exists
        hfsdp = sim.count_bytes(sim.step_collectives(units, "hfsdp", topo, K, BF16, alignment))
        measured_inner = {key: value for key, value in results[0][2].items() if key != sim.ACROSS}
        assert hfsdp[sim.SHARD] == measured_inner


def test_ring_costs_links_and_memory_formulas():
    """The analytic part: ring bytes per rank, which link a collective uses, HFSDP's outer traffic
    and memory, and that every scheme is flat ZeRO-3 inside one node."""
    units = sim.gpt_units(TINY)
    c = sim.Collective("all_gather", sim.SHARD, 800, 8)
    assert sim.ring_bytes_per_rank(c) == 700
    assert sim.ring_bytes_per_rank(sim.Collective("all_reduce", sim.ACROSS, 800, 4)) == 1200
    one_node, nodes = sim.Topology(8, 8), sim.Topology(64, 8)
    assert sim.link_of(c, one_node) == "inner"
    assert sim.link_of(sim.Collective("all_gather", sim.SHARD, 800, 64), nodes) == "outer"
    assert sim.link_of(sim.Collective("all_reduce", sim.ACROSS, 800, 8), nodes) == "outer"

    calls = {s: sim.step_collectives(units, s, one_node, K, BF16) for s in sim.SCHEMES}
    assert calls["flat_zero3"] == calls["hsdp"] == calls["hfsdp"]          # N_out = 1: nothing crosses nodes

    shard = sum(sim.build_layout(shapes, 8, 1).shard_numel for _, shapes in units)
    padded = sum(sim._outer_shard(sim.build_layout(shapes, 8, 1).shard_numel, 8) for _, shapes in units)
    hsdp = sim.link_bytes_per_rank(sim.step_collectives(units, "hsdp", nodes, K, BF16), nodes)
    hfsdp = sim.link_bytes_per_rank(sim.step_collectives(units, "hfsdp", nodes, K, BF16), nodes)
    flat = sim.link_bytes_per_rank(sim.step_collectives(units, "flat_zero3", nodes, K, BF16), nodes)
    assert hsdp["outer"] == pytest.approx(2 * 4 * shard * 7 / 8)
    assert hfsdp["outer"] == pytest.approx((4 + 2) * padded * 7 / 8)
    assert hsdp["inner"] == hfsdp["inner"] > 0 and flat["inner"] == 0 and flat["outer"] > hsdp["outer"]

    mem = sim.memory_per_rank(units, "hfsdp", nodes, BF16)
    assert mem["main_weights"] == 4 * padded // 8 and mem["optimizer_state"] == 8 * padded // 8
    assert mem["grads"] == 4 * shard and mem["compute_weights"] == 2 * shard


def test_script_runs_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib raises ImportError
    md, png = tmp_path / "out.md", tmp_path / "out.png"
    rows = sim.main(["--world-sizes", "8,64", "--out-md", str(md), "--out-png", str(png)])
    out = capsys.readouterr()
    assert "matplotlib is not installed: skipping the plot" in out.err and not png.exists()
    assert "| 64 | HFSDP |" in out.out and "| 64 | HFSDP |" in md.read_text()
    by = {(r.world, r.scheme): r for r in rows}
    assert by[64, "flat_zero3"].bound_by == "outer" and by[64, "hsdp"].inner_bytes == by[8, "hsdp"].inner_bytes
    assert by[64, "hfsdp"].outer_bytes < by[64, "hsdp"].outer_bytes
