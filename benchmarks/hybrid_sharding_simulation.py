#!/usr/bin/env python3
"""Step-time lower bounds of flat ZeRO-3, HSDP and HFSDP for a 70B GPT on a two-level network.

No GPU, no process group: the bytes each collective moves are counted from the package's own
flat-buffer layout (``megatron_fsdp_v2.layout.build_layout``, the padding ``fully_shard`` uses: per-parameter
shards for flat ZeRO-3 and HSDP, row-snapped for HFSDP)
and turned into time with a two-level bandwidth model (docs/benchmarks.md, "Simulation: flat
ZeRO-3 vs HSDP vs HFSDP for a 70B GPT")::

    python benchmarks/hybrid_sharding_simulation.py            # prints the table, writes the .md and .png

Setting: G GPUs per node (``--gpus-per-node``, 8); N ranks; inner group = the GPUs of a node,
N_in = min(G, N); outer group = the same GPU of every node, N_out = N / N_in. Per unit u (each
transformer layer, and the root: embeddings, final norm, output layer) P_u(n) is its padded
element count when its flat buffer is laid out over n shards (``build_layout(shapes, n,
alignment).total_numel``; alignment as ``fully_shard`` uses on a GPU) and S_u(n) = P_u(n) / n its
shard. Bytes per element: compute weights c = 2 (bf16), main weights m = 4 (fp32), grads g = 4
(fp32, reduced in fp32), Adam state 8. A step is k micro-batches (``--micro-batches``).

Collectives per step (bytes of the full buffer, as ``comm_stats()`` counts them: an all-gather's
output, a reduce-scatter's input, an all-reduce's tensor), per unit:

* flat ZeRO-3 (``optim_grads_params`` over all N ranks; "shard" group = the world): per
  micro-batch all-gather c*P_u(N) in forward, again in backward, reduce-scatter g*P_u(N).
* HSDP (``fully_shard(..., sharding_strategy="optim_grads_params", process_group=(outer, inner))``:
  sharded over the inner group, replicated across the outer): the same three per micro-batch over
  the inner group with P_u(N_in); per step one all-reduce of the reduced grad shard g*S_u(N_in)
  over the outer group ("across_replicas").
* HFSDP (the same call with ``outer_sharding_strategy="optim"``; comm/replicas.py, [Note: sharding
  across replicas (HFSDP)]): the buffer is laid out over the whole world, P_u(N) (flat ZeRO-3's
  padding), main weights, grads and Adam state sharded over all N ranks, compute weights gathered
  inside the node. Per micro-batch over the inner group: each of the three collectives is N_out
  calls, one per block of N_in world shards (c*P_u(N)/N_out or g*P_u(N)/N_out each; together the
  bytes of one full-buffer call). Per step over the outer group: one reduce-scatter of the inner
  grad shard g*S_u(N)*N_out = g*P_u(N)/N_in (each rank keeps its world shard) and one all-gather
  of the updated weights into the inner shard of compute weights, c*P_u(N)/N_in of output (bf16),
  after the optimizer step. With N_out = 1 (one node) HFSDP is flat ZeRO-3 and is reported as
  such (the package would still keep an inner copy of the compute weights there: use flat).
  World-wide collectives (``comm_stats()["whole_world"]``: the grad-norm all-reduce of
  ``clip_grad_norm_``, full-state gathers) are not part of the step modelled here.

``step_collectives`` lists them, one record (name, group, bytes, ranks) per call;
``count_bytes`` sums them per group and collective in ``comm_stats()``'s format (the unit test
checks it against the package's real counter on a small model: flat, HSDP and HFSDP).

Ring cost per rank: all-gather / reduce-scatter of an S-byte full buffer over n ranks moves
S*(n-1)/n bytes, all-reduce 2*S*(n-1)/n. Link: the inner group uses the fast link (``--inner-bw``,
900 GB/s per GPU), the outer group the slow one (``--outer-bw``, 50 GB/s per GPU); flat ZeRO-3's
world group uses the fast link at N <= G and, once its ring crosses nodes (N_out > 1), the slow one
for all its bytes. T_inner = inner bytes / inner bw, T_outer = outer bytes / outer bw,
T_compute = 6 * params * (micro-batch * seq * k) / (peak FLOP/s * mfu) (attention FLOPs left out:
a lower bound). Step-time lower bound (perfect overlap) = max(T_compute, T_inner, T_outer);
no overlap = T_compute + T_inner + T_outer.

Persistent memory per rank (main weights + Adam state + grads + kept compute-weight shards, what
``persistent_bytes()`` counts plus Adam state; no activations, no temporaries), summed over units:

* flat ZeRO-3:  (m + 8 + g) * P/N
* HSDP:         (m + 8 + g) * P/N_in
* HFSDP:        (m + 8 + g) * P/N + c * P/N_in   (the inner shard of bf16 compute weights each
  rank keeps to gather from)

with P/n read as S_u(n) (HFSDP: S_u(N), and P/N_in as S_u(N) * N_out). HFSDP's inner grad shard,
g * P/N_in, is a per-step temporary (allocated at a step's first inner reduce-scatter, freed after
the outer one) and is reported apart (``inner_grad_shard``), not in the total; the other
temporaries (full unit buffers of every scheme) are left out.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:                  # this checkout's megatron_fsdp_v2
    sys.path.insert(0, str(REPO))

from megatron_fsdp_v2.comm import COLLECTIVES  # noqa: E402
from megatron_fsdp_v2.group.layout import build_layout  # noqa: E402

SCHEMES = ("flat_zero3", "hsdp", "hfsdp")
SCHEME_LABELS = {"flat_zero3": "flat ZeRO-3", "hsdp": "HSDP", "hfsdp": "HFSDP"}
SHARD, ACROSS = "shard", "across_replicas"       # comm_stats(): top level, and its "across_replicas"
ADAM_BYTES = 8
DEFAULT_MD = REPO / "benchmarks" / "results" / "2026-11-30" / "hybrid_sharding_simulation.md"
DEFAULT_PNG = REPO / "docs" / "images" / "hybrid_sharding_simulation.png"


def gpu_alignment() -> int:
    """The alignment ``fully_shard`` uses for parameters on a GPU (``default_alignment``)."""
    import torch

    from megatron_fsdp_v2.fully_shard import default_alignment

    return default_alignment(torch.device("cuda"))


# ------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class GPTShape:
    """A Llama-style GPT: RMSNorm, GQA attention with a fused qkv weight, SwiGLU MLP, untied output."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA2_70B = GPTShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=32000)


def gpt_units(shape: GPTShape) -> list[tuple[str, list[tuple[int, ...]]]]:
    """``[(unit name, [parameter shapes in registration order])]``: the root unit first
    (embedding, final norm, output layer), then one unit per transformer layer."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    root = [(shape.vocab, h), (h,), (shape.vocab, h)]
    layer = [(h,), (h + 2 * kv, h), (h, h), (h,), (2 * shape.ffn, h), (h, shape.ffn)]
    return [("<root>", root)] + [(f"layers.{i}", list(layer)) for i in range(shape.layers)]


def param_count(units: Sequence[tuple[str, Sequence[tuple[int, ...]]]]) -> int:
    return sum(math.prod(s) for _, shapes in units for s in shapes)


# ------------------------------------------------------------------------------------ collectives
@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: compute weights, main weights, grads (and their collectives)."""

    compute: int = 2
    main: int = 4
    grad: int = 4


@dataclass(frozen=True)
class Collective:
    """One collective call: ``nbytes`` is the full buffer (comm_stats' convention) over ``ranks``."""

    name: str      # all_gather | reduce_scatter | all_reduce
    group: str     # SHARD (the strategy's group) | ACROSS (the outer replicate group)
    nbytes: int
    ranks: int
    what: str = ""


@dataclass(frozen=True)
class Topology:
    world: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.gpus_per_node < 1:
            raise ValueError(f"world and gpus_per_node must be positive, got {self.world}, {self.gpus_per_node}.")
        if self.world > self.gpus_per_node and self.world % self.gpus_per_node:
            raise ValueError(f"world {self.world} must be a multiple of gpus_per_node {self.gpus_per_node}.")

    @property
    def inner(self) -> int:
        return min(self.gpus_per_node, self.world)

    @property
    def outer(self) -> int:
        return self.world // self.inner


def effective_scheme(scheme: str, topo: Topology) -> str:
    """The scheme that runs: HFSDP with one node (N_out = 1) is flat ZeRO-3 (module docstring)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}.")
    return "flat_zero3" if scheme == "hfsdp" and topo.outer == 1 else scheme


def shard_group_size(scheme: str, topo: Topology) -> int:
    """Ranks the per-micro-batch collectives run over (the "shard" group of ``comm_stats()``)."""
    return topo.world if effective_scheme(scheme, topo) == "flat_zero3" else topo.inner


def layout_shards(scheme: str, topo: Topology) -> int:
    """Shards each unit's flat buffer is laid out (padded) over: HSDP the inner group; flat
    ZeRO-3 and HFSDP the world (HFSDP's world shard index is ``outer rank * N_in + inner rank``)."""
    return topo.inner if effective_scheme(scheme, topo) == "hsdp" else topo.world


def unit_layout(shapes, scheme: str, topo: Topology, alignment: int):
    """A unit's layout as ``fully_shard`` builds it for ZeRO-3 under ``scheme``: per-parameter
    shards (group/layout.py), except HFSDP's two-level row-snapped shards."""
    return build_layout(shapes, layout_shards(scheme, topo), alignment,
                        per_parameter=effective_scheme(scheme, topo) != "hfsdp")


def step_collectives(units, scheme: str, topo: Topology, micro_batches: int, dtypes: Dtypes = Dtypes(),
                     alignment: int = 1) -> list[Collective]:
    """Every collective of one optimizer step of ``scheme`` (module docstring), in issue order per
    unit, one record per call. ``units``: ``[(name, [shapes])]``, one parameter group each."""
    scheme = effective_scheme(scheme, topo)
    n_shard = shard_group_size(scheme, topo)
    # HFSDP: every inner collective is N_out calls, one per block of N_in world shards
    blocks = topo.outer if scheme == "hfsdp" else 1
    out: list[Collective] = []
    for name, shapes in units:
        layout = unit_layout(shapes, scheme, topo, alignment)
        block, shard = layout.total_numel // blocks, layout.shard_numel
        for mb in range(micro_batches):
            for what, kind, size in (("fwd", "all_gather", dtypes.compute), ("bwd", "all_gather", dtypes.compute),
                                     ("grads", "reduce_scatter", dtypes.grad)):
                out.extend(Collective(kind, SHARD, size * block, n_shard, f"{name} {what} mb{mb} block{b}")
                           for b in range(blocks))
        if topo.outer == 1 or scheme == "flat_zero3":
            continue
        if scheme == "hsdp":
            out.append(Collective("all_reduce", ACROSS, dtypes.grad * shard, topo.outer, f"{name} grad shard"))
        else:                                        # hfsdp: the inner shard is N_out world shards
            inner_shard = shard * topo.outer
            out.append(Collective("reduce_scatter", ACROSS, dtypes.grad * inner_shard, topo.outer,
                                  f"{name} inner grad shard"))
            out.append(Collective("all_gather", ACROSS, dtypes.compute * inner_shard, topo.outer,
                                  f"{name} inner weight shard (after the optimizer step)"))
    return out


def count_bytes(collectives: Iterable[Collective]) -> dict:
    """``{group: {collective: {"count", "bytes"}, ..., "total_bytes"}}`` summed per (name, group),
    in ``comm_stats()``'s format (bytes of the full buffers)."""
    out: dict = {}
    for c in collectives:
        group = out.setdefault(c.group, {**{n: {"count": 0, "bytes": 0} for n in COLLECTIVES}, "total_bytes": 0})
        group[c.name]["count"] += 1
        group[c.name]["bytes"] += c.nbytes
        group["total_bytes"] += c.nbytes
    return out


def ring_bytes_per_rank(c: Collective) -> float:
    """Bytes one rank sends in a ring implementation of ``c``."""
    factor = (c.ranks - 1) / c.ranks
    return (2 if c.name == "all_reduce" else 1) * c.nbytes * factor


def link_of(c: Collective, topo: Topology) -> str:
    """"inner" (fast, within a node) or "outer" (slow, across nodes): a group whose ranks span
    nodes is bounded by the slow link."""
    if c.group == ACROSS:
        return "outer"
    return "inner" if c.ranks <= topo.gpus_per_node else "outer"


def link_bytes_per_rank(collectives: Iterable[Collective], topo: Topology) -> dict:
    out = {"inner": 0.0, "outer": 0.0}
    for c in collectives:
        out[link_of(c, topo)] += ring_bytes_per_rank(c)
    return out


# ----------------------------------------------------------------------------------------- memory
def memory_per_rank(units, scheme: str, topo: Topology, dtypes: Dtypes = Dtypes(), alignment: int = 1) -> dict:
    """Bytes per rank by role (module docstring). ``total``: the persistent ones (main weights,
    Adam state, grads, kept compute weights; ``compute_weights`` is 0 for flat and HSDP: ZeRO-3
    keeps none between uses). ``inner_grad_shard``: HFSDP's per-step temporary, not in ``total``."""
    scheme = effective_scheme(scheme, topo)
    mem = {"main_weights": 0, "optimizer_state": 0, "grads": 0, "compute_weights": 0}
    inner_grad_shard = 0
    for _, shapes in units:
        shard = unit_layout(shapes, scheme, topo, alignment).shard_numel
        mem["main_weights"] += dtypes.main * shard
        mem["optimizer_state"] += ADAM_BYTES * shard
        mem["grads"] += dtypes.grad * shard
        if scheme == "hfsdp":                # the inner shard: this rank's world shard of every block
            mem["compute_weights"] += dtypes.compute * shard * topo.outer
            inner_grad_shard += dtypes.grad * shard * topo.outer
    mem["total"] = sum(mem.values())
    mem["inner_grad_shard"] = inner_grad_shard
    return mem


# ---------------------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class Row:
    world: int
    scheme: str
    counted: dict            # count_bytes() of the step
    inner_bytes: float       # ring bytes per rank per step on each link
    outer_bytes: float
    inner_s: float
    outer_s: float
    compute_s: float
    memory: dict

    @property
    def lower_bound_s(self) -> float:
        return max(self.compute_s, self.inner_s, self.outer_s)

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.inner_s + self.outer_s

    @property
    def bound_by(self) -> str:
        times = {"compute": self.compute_s, "inner": self.inner_s, "outer": self.outer_s}
        return max(times, key=times.get)


def simulate(args) -> list[Row]:
    units = gpt_units(LLAMA2_70B)
    params = param_count(units)
    tokens = args.micro_batch_size * args.seq_len * args.micro_batches
    compute_s = 6 * params * tokens / (args.peak_flops * args.mfu)
    dtypes = Dtypes()
    rows = []
    for world in args.world_sizes:
        topo = Topology(world, args.gpus_per_node)
        for scheme in SCHEMES:
            calls = step_collectives(units, scheme, topo, args.micro_batches, dtypes, args.alignment)
            link = link_bytes_per_rank(calls, topo)
            rows.append(Row(world, scheme, count_bytes(calls), link["inner"], link["outer"],
                            link["inner"] / (args.inner_bw * 1e9), link["outer"] / (args.outer_bw * 1e9), compute_s,
                            memory_per_rank(units, scheme, topo, dtypes, args.alignment)))
    return rows


def markdown_table(rows: Sequence[Row]) -> str:
    lines = ["| N | scheme | inner GB/rank/step | outer GB/rank/step | inner s | outer s | compute s | "
             "lower bound s | no-overlap s | bound by | memory GiB/rank |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r.world} | {SCHEME_LABELS[r.scheme]} | {r.inner_bytes / 1e9:.1f} | "
                     f"{r.outer_bytes / 1e9:.1f} | "
                     f"{r.inner_s:.3f} | {r.outer_s:.3f} | {r.compute_s:.3f} | **{r.lower_bound_s:.3f}** | "
                     f"{r.no_overlap_s:.3f} | {r.bound_by} | {r.memory['total'] / 2**30:.1f} |")
    return "\n".join(lines)


def counted_table(rows: Sequence[Row]) -> str:
    """Full-buffer bytes per group and collective (``count_bytes``, comm_stats' convention)."""
    def cell(group: Optional[dict], name: str) -> str:
        if group is None or not group[name]["count"]:
            return "-"
        return f"{group[name]['count']} / {group[name]['bytes'] / 1e9:.1f}"

    lines = ["| N | scheme | shard group all_gather | shard group reduce_scatter | across_replicas all_reduce | "
             "across_replicas reduce_scatter | across_replicas all_gather |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        shard, across = r.counted.get(SHARD), r.counted.get(ACROSS)
        lines.append(f"| {r.world} | {SCHEME_LABELS[r.scheme]} | {cell(shard, 'all_gather')} | "
                     f"{cell(shard, 'reduce_scatter')} | {cell(across, 'all_reduce')} | "
                     f"{cell(across, 'reduce_scatter')} | {cell(across, 'all_gather')} |")
    return "\n".join(lines)


def memory_table(rows: Sequence[Row]) -> str:
    lines = ["| N | scheme | main weights | Adam state | grads | compute weights | total GiB | "
             "per-step temporary: inner grad shard |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = {k: v / 2**30 for k, v in r.memory.items()}
        temporary = f"{m['inner_grad_shard']:.1f}" if r.memory["inner_grad_shard"] else "-"
        lines.append(f"| {r.world} | {SCHEME_LABELS[r.scheme]} | {m['main_weights']:.1f} | {m['optimizer_state']:.1f} "
                     f"| {m['grads']:.1f} | {m['compute_weights']:.1f} | {m['total']:.1f} | {temporary} |")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: Path) -> bool:
    """Left: step-time lower bound (solid) and no-overlap sum (dotted) vs N per scheme; right: the
    communication time on each link a scheme uses. Log x. False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}", file=sys.stderr)
        return False
    worlds = sorted({r.world for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for scheme, marker in zip(SCHEMES, "osD"):
        mine = [r for r in rows if r.scheme == scheme]
        x = [r.world for r in mine]
        line, = left.plot(x, [r.lower_bound_s for r in mine], marker=marker,
                          label=f"{SCHEME_LABELS[scheme]} lower bound")
        left.plot(x, [r.no_overlap_s for r in mine], marker=marker, linestyle=":", alpha=0.6, color=line.get_color(),
                  label=f"{SCHEME_LABELS[scheme]} no overlap")
        for link, style in (("outer", "-"), ("inner", "--")):      # links a scheme does not use: no point
            used = [r for r in mine if getattr(r, f"{link}_s") > 0]
            right.plot([r.world for r in used], [getattr(r, f"{link}_s") for r in used], marker=marker,
                       linestyle=style, alpha=1.0 if link == "outer" else 0.6, color=line.get_color(),
                       label=f"{SCHEME_LABELS[scheme]} {link} link")
    right.set_yscale("log")
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    right.yaxis.set_minor_formatter(NullFormatter())
    left.set_ylim(bottom=0)
    for ax in (left, right):
        ax.plot(worlds, [rows[0].compute_s] * len(worlds), "k--", linewidth=1, label="compute")
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds)
        ax.set_xticklabels([str(w) for w in worlds])
        ax.set_xlabel("GPUs (N), 8 per node")
        ax.set_ylabel("seconds per step")
        ax.grid(True, which="both", alpha=0.3)
    left.set_title("70B GPT step time: lower bound vs no overlap", fontsize=10)
    right.set_title("communication time per link (log y)", fontsize=10)
    left.legend(fontsize=7)
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _command(argv: Sequence[str]) -> str:
    return " ".join(["python", "benchmarks/hybrid_sharding_simulation.py", *argv])


def report(args, rows: Sequence[Row], argv: Sequence[str]) -> str:
    units = gpt_units(LLAMA2_70B)
    s = LLAMA2_70B
    return "\n".join([
        "# Simulation: flat ZeRO-3 vs HSDP vs HFSDP, 70B GPT",
        "",
        f"Command: `{_command(argv)}` (no GPU; formulas in the script's docstring and docs/benchmarks.md).",
        "",
        f"Model: {s.layers} layers, hidden {s.hidden}, ffn {s.ffn} (SwiGLU), {s.heads} heads / {s.kv_heads} KV heads, "
        f"vocab {s.vocab}, untied: {param_count(units):,} parameters in {len(units)} units. "
        f"Alignment {args.alignment} elements. Network: {args.gpus_per_node} GPUs per node, inner "
        f"{args.inner_bw:g} GB/s, outer {args.outer_bw:g} GB/s per GPU. Step: {args.micro_batches} micro-batches of "
        f"{args.micro_batch_size} x {args.seq_len} tokens per rank; compute at {args.peak_flops:.4g} FLOP/s x mfu "
        f"{args.mfu:g}. Bytes: bf16 compute weights, fp32 main weights and grads (reduced in fp32), 8-byte Adam state.",
        "",
        "Step time (ring bytes per rank per step; lower bound = max(compute, inner, outer)):",
        "",
        markdown_table(rows),
        "",
        "Counted collectives per rank per step (calls / GB of full buffers, as `comm_stats()` counts them; shard "
        "group: the world for flat ZeRO-3, the node for HSDP and HFSDP, whose inner collectives are N_out block "
        "calls each):",
        "",
        counted_table(rows),
        "",
        "Memory per rank (GiB): persistent state (total), and HFSDP's inner grad shard, which lives only "
        "from a step's first inner reduce-scatter to its outer reduce-scatter. HFSDP at one node (N_out = 1) "
        "is flat ZeRO-3 and is shown as such.",
        "",
        memory_table(rows),
        "",
    ])


def parse_args(argv: Optional[Sequence[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 512],
                   help="comma-separated N")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--inner-bw", type=float, default=900.0, help="GB/s per GPU within a node")
    p.add_argument("--outer-bw", type=float, default=50.0, help="GB/s per GPU across nodes")
    p.add_argument("--micro-batches", type=int, default=8, help="k micro-batches per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--peak-flops", type=float, default=989e12, help="H200 bf16 dense")
    p.add_argument("--mfu", type=float, default=1.0)
    p.add_argument("--alignment", type=int, default=None, help="elements (default: fully_shard's on a GPU)")
    p.add_argument("--out-md", default=str(DEFAULT_MD), help="'' to skip")
    p.add_argument("--out-png", default=str(DEFAULT_PNG), help="'' to skip")
    args = p.parse_args(argv)
    if args.alignment is None:
        args.alignment = gpu_alignment()
    return args


def main(argv: Optional[Sequence[str]] = None) -> list[Row]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    rows = simulate(args)
    print(markdown_table(rows))
    if args.out_md:
        path = Path(args.out_md)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report(args, rows, argv))
        print(f"wrote {os.path.relpath(path, REPO) if path.is_absolute() else path}")
    if args.out_png and plot(rows, Path(args.out_png)):
        print(f"wrote {os.path.relpath(args.out_png, REPO) if Path(args.out_png).is_absolute() else args.out_png}")
    return rows


if __name__ == "__main__":
    main()
