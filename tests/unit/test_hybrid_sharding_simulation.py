"""``benchmarks/hybrid_sharding_simulation.py``: its counted bytes are the package's counted bytes.

The simulation's ``count_bytes(step_collectives(...))`` (calls and bytes per group and collective
of one optimizer step, from ``build_layout`` padding) must equal ``comm_stats()`` of a real wrapped
model: a small Llama-shaped GPT (GQA, SwiGLU, untied output; shapes from the simulation's own
``gpt_units``) with bf16 compute weights and fp32 grads, ``optim_grads_params`` flat over 4 gloo
ranks, HSDP at 2 replicas x 2 shards and HFSDP at 2 x 2 (``outer_sharding_strategy="optim"``: inner
collectives in N_out = 2 block calls, one outer reduce-scatter and one outer all-gather per unit),
one step of k=2 micro-batches (the first inside ``no_sync()``) after a warm-up step (so the
prefetching schedule is the one counted). Memory per rank is checked against the package:
``persistent_bytes()`` after the optimizer step and before ``zero_grad()`` (which, with
``set_to_none=True``, frees the gradient buffers), and HFSDP's inner grad shard, a per-step
temporary, against the buffers alive between the two micro-batches (none after the step's last
backward). The ring and link arithmetic is checked on its own.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard
from megatron_fsdp_v2.fully_shard import default_alignment
from tests.benchmark_modules import load_benchmark_module

from .dist_utils import run_distributed
from .test_hybrid_sharding import _hybrid_groups


sim = load_benchmark_module("hybrid_sharding_simulation")

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


def _inner_grad_bytes(model) -> int:
    """Bytes of HFSDP's inner grad shards alive now (the per-step temporary)."""
    return sum(0 if g.levels.inner_grad is None else g.levels.inner_grad.numel() * g.levels.inner_grad.element_size()
               for g in model._fsdp_engine.groups)


def _step(model, optimizer, rank, seed, vocab, record=None):
    """One optimizer step of K micro-batches; ``record`` (a dict) gets the memory read mid-step."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for i in range(K):
        tokens = torch.randint(0, vocab, (2, 6), generator=g)
        targets = torch.randint(0, vocab, (2, 6), generator=g)
        loss = lambda: F.cross_entropy(model(tokens).float().reshape(-1, vocab), targets.reshape(-1))  # noqa: E731
        if i < K - 1:
            with model.no_sync():
                loss().backward()
            if record is not None:
                record["inner_grad_mid_step"] = _inner_grad_bytes(model)
        else:
            loss().backward()
    optimizer.step()
    if record is not None:
        record["inner_grad_after_step"] = _inner_grad_bytes(model)
        record["persistent"] = model.persistent_bytes()     # before zero_grad(set_to_none=True) frees the grads
    optimizer.zero_grad()


def step_worker(rank, world, layout, shape_fields, outer_sharding):
    s = sim.GPTShape(*shape_fields)
    groups = _hybrid_groups(world, 2) if layout == "2x2" else None
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(s), sharding_strategy="optim_grads_params", unit_modules=[Layer],
                        process_group=groups, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                        outer_sharding_strategy=outer_sharding)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer, rank, 0, s.vocab)          # warm-up: the forward order (prefetch) is known
    model.reset_comm_stats()
    record: dict = {}
    _step(model, optimizer, rank, 1, s.vocab, record)
    units = [(u.fqn or "<root>", [tuple(shape) for g in u.groups for shape in g.shapes])
             for u in model._fsdp_engine.units]
    groups_per_unit = [len(u.groups) for u in model._fsdp_engine.units]
    return units, groups_per_unit, model.comm_stats(), record


@pytest.mark.parametrize("layout,scheme", [("flat", "flat_zero3"), ("2x2", "hsdp"), ("2x2", "hfsdp")],
                         ids=["flat4", "hsdp_2x2", "hfsdp_2x2"])
def test_counted_bytes_match_comm_stats(layout, scheme):
    world = 4
    topo = sim.Topology(world, gpus_per_node=2)
    units = sim.gpt_units(TINY)
    alignment = default_alignment(torch.device("cpu"))
    calls = sim.step_collectives(units, scheme, topo, K, BF16, alignment)
    predicted = sim.count_bytes(calls)
    want = dict(predicted[sim.SHARD])
    if sim.ACROSS in predicted:
        want[sim.ACROSS] = predicted[sim.ACROSS]
    assert (sim.ACROSS in want) == (scheme != "flat_zero3")
    memory = sim.memory_per_rank(units, scheme, topo, BF16, alignment)
    shards = sim.layout_shards(scheme, topo)
    assert shards == (topo.inner if scheme == "hsdp" else topo.world)
    padding = [sim.unit_layout(shapes, scheme, topo, alignment).padding_numel for _, shapes in units]
    assert any(padding) == (scheme != "hsdp"), padding    # padding counts (HSDP: every row count even over 2)
    if scheme == "hfsdp":           # per micro-batch and unit: N_out = 2 inner calls per collective
        assert want["all_gather"]["count"] == 2 * K * len(units) * topo.outer
        assert want["reduce_scatter"]["count"] == K * len(units) * topo.outer
        assert {k: v["count"] for k, v in want[sim.ACROSS].items() if k != "total_bytes"} == {
            "all_gather": len(units), "reduce_scatter": len(units), "all_reduce": 0, "broadcast": 0, "all_to_all": 0}
        assert memory["compute_weights"] > 0 and memory["inner_grad_shard"] == 2 * memory["compute_weights"]
    else:
        assert memory["compute_weights"] == memory["inner_grad_shard"] == 0

    outer_sharding = "optim" if scheme == "hfsdp" else "no_shard"
    results = run_distributed(step_worker, world, layout, dataclasses.astuple(TINY), outer_sharding, timeout=120)
    for rank, (real_units, groups_per_unit, stats, record) in enumerate(results):
        assert real_units == [(name, list(shapes)) for name, shapes in units], rank   # gpt_units is the model
        assert groups_per_unit == [1] * len(units), rank
        world_wide = stats.pop("whole_world", None)       # HFSDP: world-wide ops (grad norm): none in this step
        assert (world_wide is not None) == (scheme == "hfsdp"), rank
        assert world_wide is None or world_wide["total_bytes"] == 0, (rank, world_wide)
        assert stats == want, (rank, stats, want)
        assert record["persistent"] == {
            "main_weights": memory["main_weights"], "model_weights": memory["compute_weights"],
            "grads": memory["grads"],
            "total": memory["main_weights"] + memory["compute_weights"] + memory["grads"]}, rank
        assert record["inner_grad_mid_step"] == memory["inner_grad_shard"], rank     # alive across micro-batches
        assert record["inner_grad_after_step"] == 0, rank                              # freed by the outer reduce


def test_ring_costs_links_and_memory_formulas():
    """The arithmetic on top of the counted records: ring bytes per rank, which link a collective
    uses, HFSDP's traffic and memory at 8 nodes, and that every scheme is flat ZeRO-3 inside one node."""
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

    assert sim.memory_per_rank(units, "hfsdp", one_node, BF16) == sim.memory_per_rank(units, "flat_zero3", one_node,
                                                                                       BF16)

    shard = sum(sim.build_layout(shapes, 8, 1, per_parameter=True).shard_numel for _, shapes in units)  # HSDP: the node
    world_shard = sum(sim.build_layout(shapes, 64, 1).shard_numel for _, shapes in units)   # HFSDP: over the world
    hsdp = sim.link_bytes_per_rank(sim.step_collectives(units, "hsdp", nodes, K, BF16), nodes)
    hfsdp_calls = sim.step_collectives(units, "hfsdp", nodes, K, BF16)
    hfsdp = sim.link_bytes_per_rank(hfsdp_calls, nodes)
    flat = sim.link_bytes_per_rank(sim.step_collectives(units, "flat_zero3", nodes, K, BF16), nodes)
    assert hsdp["outer"] == pytest.approx(2 * 4 * shard * 7 / 8)
    assert hfsdp["outer"] == pytest.approx((4 + 2) * 8 * world_shard * 7 / 8)     # inner shard = N_out world shards
    # inner: the bytes of flat ZeRO-3's padded buffers, over the node, in N_out = 8 calls per collective
    assert hfsdp["inner"] == pytest.approx(K * (2 * 2 + 4) * 64 * world_shard * 7 / 8)
    assert sum(c.group == sim.SHARD for c in hfsdp_calls) == 8 * 3 * K * len(units)
    assert hsdp["inner"] > 0 and flat["inner"] == 0 and flat["outer"] > hsdp["outer"]

    mem = sim.memory_per_rank(units, "hfsdp", nodes, BF16)
    assert mem["main_weights"] == 4 * world_shard and mem["optimizer_state"] == 8 * world_shard
    assert mem["grads"] == 4 * world_shard and mem["compute_weights"] == 2 * 8 * world_shard
    assert mem["total"] == (4 + 8 + 4) * world_shard + 2 * 8 * world_shard
    assert mem["inner_grad_shard"] == 4 * 8 * world_shard                            # temporary: not in total


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
