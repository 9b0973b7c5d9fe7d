"""megatron_fsdp_v2.optim.Muon on sharded parameters: torch.optim.Muon's update (and AdamW's for the
rest) on the full matrices, every strategy, uneven rows and ranks holding none, the exchange's bytes,
gradient accumulation and a checkpoint resumed at another dp size."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard, load_checkpoint, save_checkpoint
from megatron_fsdp_v2.optim import Muon
from megatron_fsdp_v2.optim.matrix_owners import assign_owners, build_exchange
from megatron_fsdp_v2.row_sharded import chunk_splits

from tests.comm_counter import CollectiveCounter

from .dist_utils import run_distributed

HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=None)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
MICRO_BATCHES = 2


class MuonBlock(nn.Module):
    """Matrices of 5, 6 and 2 rows (torch.chunk leaves ranks of dp 3 and 4 without rows; a wide and a
    tall one), a LayerNorm and a bias for AdamW."""

    def __init__(self, width: int = 6, hidden: int = 5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        self.mix = nn.Parameter(torch.randn(2, width) * 0.3)

    def forward(self, x):
        h = self.down(torch.tanh(self.up(self.norm(x))))
        return x + h + (x @ self.mix.t()).sum(-1, keepdim=True)


class MuonNet(nn.Module):
    """An embedding and an output head (AdamW by the usual rule) around two blocks."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(MuonBlock(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _is_muon(name: str, p) -> bool:
    return p.ndim == 2 and not name.startswith(("emb.", "head."))


def _batch(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 11, (3, 4), generator=g), torch.randint(0, 11, (3, 4), generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Shadow:
    """Single-process torch.optim.Muon (matrices) + torch.optim.AdamW (the rest) on full copies of the
    parameters, fed the full gradients of the sharded run: the update the sharded step must equal."""

    def __init__(self, named: list) -> None:
        self.names = [n for n, _ in named]
        self.params = {n: nn.Parameter(_full(p)) for n, p in named}
        muon = [self.params[n] for n, p in named if _is_muon(n, p)]
        rest = [self.params[n] for n, p in named if not _is_muon(n, p)]
        self.opts = [torch.optim.Muon(muon, **HYPER), torch.optim.AdamW(rest, **ADAMW)]

    def step(self, named: list) -> None:
        for n, p in named:
            self.params[n].grad = None if p.grad is None else _full(p.grad)
        for opt in self.opts:
            opt.step()

    def state(self) -> dict:
        return {"params": {n: p.detach() for n, p in self.params.items()}, "opts": [o.state_dict() for o in self.opts]}

    def load(self, state: dict) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state["params"][n])
        for opt, sd in zip(self.opts, state["opts"]):
            opt.load_state_dict(sd)

    def max_diff(self, named: list) -> float:
        return max((_full(p) - self.params[n]).abs().max().item() for n, p in named)


def _muon_for(model) -> Muon:
    named = list(model.named_parameters())
    return Muon([{"params": [p for n, p in named if _is_muon(n, p)]},
                 {"params": [p for n, p in named if not _is_muon(n, p)], "use_muon": False}],
                **HYPER, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                adamw_weight_decay=ADAMW["weight_decay"])


def _hybrid_groups(world: int, inner_size: int):
    """(outer, inner) groups of this rank: inner = consecutive ranks, outer = same position."""
    rank = dist.get_rank()
    inner = outer = None
    for start in range(0, world, inner_size):               # every rank creates every group, in order
        group = dist.new_group(list(range(start, start + inner_size)))
        inner = group if start <= rank < start + inner_size else inner
    for position in range(inner_size):
        group = dist.new_group(list(range(position, world, inner_size)))
        outer = group if rank % inner_size == position else outer
    return outer, inner


def train_worker(rank, world, strategy, steps, save_dir=None, load_dir=None, hybrid=None):
    """``steps`` steps of MICRO_BATCHES micro-batches (no_sync for all but the last); per step the
    collectives comm_stats counted during optimizer.step() and the theory's; at the end the largest
    difference from the Shadow. ``hybrid``: None (flat), "hsdp" or "hfsdp" (2 x world/2)."""
    torch.manual_seed(0)
    wrap = {}
    if hybrid is not None:
        wrap = dict(process_group=_hybrid_groups(world, world // 2),
                    outer_sharding_strategy="optim" if hybrid == "hfsdp" else "no_shard")
    model = fully_shard(MuonNet(), sharding_strategy=strategy, unit_modules=[MuonBlock], **wrap)
    opt = _muon_for(model)
    named = list(model.named_parameters())
    shadow = Shadow(named)
    if load_dir is not None:
        load_checkpoint(load_dir, model, opt)
        shadow.load(torch.load(os.path.join(load_dir, "shadow.pt"), weights_only=False))
    matrix_numel = sum(p.numel() for n, p in named if _is_muon(n, p))
    sharded = strategy != "no_shard" and world > 1
    per_step, counter = [], CollectiveCounter()
    for step in range(steps):
        for micro in range(MICRO_BATCHES):
            tokens, target = _batch(step, micro, rank)
            with model.no_sync() if micro < MICRO_BATCHES - 1 else contextlib.nullcontext():
                logits = model(tokens)
                nn.functional.cross_entropy(logits.reshape(-1, 11), target.reshape(-1)).backward()
        model.reset_comm_stats()
        with counter:
            opt.step()
        stats = model.comm_stats()
        stats = stats["whole_world"] if hybrid == "hfsdp" else stats      # HFSDP's main weights: over the world
        theory = {"count": 2, "bytes": 2 * 2 * matrix_numel} if sharded else {"count": 0, "bytes": 0}
        # the engine's refresh after any optimizer's step: ZeRO-1/2 issue one all-gather per group in it
        refreshes = len(model._fsdp_engine.groups) if strategy in ("optim", "optim_grads") and world > 1 else 0
        refreshes = stats["all_gather"]["count"] if hybrid else refreshes   # (hybrid refreshes: test_hfsdp.py)
        others = {k: stats[k]["count"] for k in ("reduce_scatter", "all_reduce", "broadcast")}
        dispatched = counter.take().get("all_to_all", (0, 0))      # (calls, bytes this rank sent)
        per_step.append((stats["all_to_all"], theory, stats["all_gather"]["count"], refreshes, others, dispatched))
        shadow.step(named)
        opt.zero_grad()
    if save_dir is not None:
        save_checkpoint(save_dir, model, opt)
        if rank == 0:
            torch.save(shadow.state(), os.path.join(save_dir, "shadow.pt"))
    assert all(p.grad is None for _, p in named)
    return max(shadow.max_diff(named), _forward_diff(model, shadow, rank)), per_step


def _forward_diff(model, shadow: Shadow, rank: int) -> float:
    """The wrapped model's next forward against the shadow's weights: the engine refreshed (ZeRO-1/2)
    or gathers (ZeRO-3) the weights Muon stepped."""
    reference = MuonNet()
    reference.load_state_dict({n: p.detach() for n, p in shadow.params.items()})
    tokens, _ = _batch(99, 0, rank)
    with torch.no_grad():
        return (model(tokens) - reference(tokens)).abs().max().item()


def _check_step_collectives(results: list, replicas: int = 1) -> None:
    """Each optimizer.step(): Muon's two all-to-alls of the theory's bytes (counted by comm_stats on
    every rank; dispatched: what the ranks sent adds up to them), the engine's weight refresh
    (ZeRO-1/2), nothing else."""
    for step in range(len(results[0][1])):
        sent = 0
        for _, per_step in results:
            counted, theory, gathers, refreshes, others, (calls, nbytes) = per_step[step]
            assert counted == theory
            assert calls == theory["count"]
            assert gathers == refreshes
            assert others == {"reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}
            sent += nbytes
        assert sent == replicas * theory["bytes"]         # (HSDP: each replica exchanges over its inner group)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_muon_equals_torch_muon_on_full_matrices_with_uneven_rows(world):
    """ZeRO-3 at dp 2, 3 (rows 2/2/1, 1/1/0) and 4 (2/2/1/0, 1/1/0/0): 5 steps within 1e-6 of
    torch.optim.Muon + AdamW given the same gradients, and 2 all-to-alls of 2 Psi_matrix (bf16)."""
    results = run_distributed(train_worker, world, "optim_grads_params", 5)
    assert all(diff <= 1e-6 for diff, _ in results), results
    _check_step_collectives(results)


@pytest.mark.parametrize("strategy", [s for s in STRATEGY_NAMES if s != "optim_grads_params"])
def test_muon_every_strategy(strategy):
    """no_shard steps whole matrices on every rank (no collective); ZeRO-1/2 as ZeRO-3."""
    results = run_distributed(train_worker, 3, strategy, 5)
    assert all(diff <= 1e-6 for diff, _ in results), results
    _check_step_collectives(results)


@pytest.mark.parametrize("hybrid", ["hsdp", "hfsdp"])
def test_muon_hybrid_sharding(hybrid):
    """2 x 2: HSDP orthogonalizes within each replica's inner group (counted there), HFSDP over the
    world its main weights are sharded over (counted under "whole_world")."""
    results = run_distributed(train_worker, 4, "optim_grads_params", 3, None, None, hybrid)
    assert all(diff <= 1e-6 for diff, _ in results), results
    _check_step_collectives(results, replicas=2 if hybrid == "hsdp" else 1)


class ExpertLayer(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.experts = nn.ModuleList([nn.Linear(width, width, bias=False)])     # this expert-parallel rank's

    def forward(self, x):
        return torch.tanh(self.dense(x)) + torch.tanh(self.experts[0](x))


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ExpertLayer() for _ in range(2))
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def experts_worker(rank, world, steps):
    """EP 2 x EDP 2: dense matrices orthogonalized over the data-parallel group, expert matrices over
    their expert-data-parallel group (counted under comm_stats()["experts"])."""
    expert_groups = [dist.new_group(list(range(position, world, 2))) for position in range(2)]
    torch.manual_seed(rank % 2)                    # each expert-parallel rank its own experts
    model = fully_shard(MoENet(), sharding_strategy="optim_grads_params", unit_modules=[ExpertLayer],
                        expert_process_group=expert_groups[rank % 2], expert_params=lambda n, p: ".experts." in n)
    opt = _muon_for(model)
    named = list(model.named_parameters())
    shadow, counter, per_step = Shadow(named), CollectiveCounter(), []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(3, 6, generator=g), torch.randn(3, 1, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        model.reset_comm_stats()
        with counter:
            opt.step()
        stats = model.comm_stats()
        per_step.append((stats["all_to_all"], stats["experts"]["all_to_all"], counter.take()["all_to_all"]))
        shadow.step(named)
        opt.zero_grad()
    dense = sum(p.numel() for n, p in named if _is_muon(n, p) and ".experts." not in n)
    experts = sum(p.numel() for n, p in named if _is_muon(n, p) and ".experts." in n)
    return shadow.max_diff(named), per_step, dense, experts


def test_muon_expert_matrices_over_the_expert_group():
    results = run_distributed(experts_worker, 4, 3)
    assert all(diff <= 1e-6 for diff, *_ in results), results
    _, _, dense, experts = results[0]
    assert dense == experts == 72
    for step in range(3):
        for _, per_step, _, _ in results:
            assert per_step[step][:2] == ({"count": 2, "bytes": 4 * dense}, {"count": 2, "bytes": 4 * experts})
        # what the 4 ranks sent: the dense exchange once, each of the 2 expert groups' once
        assert sum(r[1][step][2][1] for r in results) == 4 * dense + 2 * 4 * experts
        assert all(r[1][step][2][0] == 4 for r in results)


def test_muon_checkpoint_saved_at_dp2_resumes_at_dp3(tmp_path):
    """Momentum and AdamW moments saved by save_checkpoint at dp 2 load at dp 3 (resharded) and the
    run goes on as torch's optimizers continued from their own state."""
    path = str(tmp_path / "ckpt")
    for diff, _ in run_distributed(train_worker, 2, "optim", 3, path):
        assert diff <= 1e-6, diff
    for diff, _ in run_distributed(train_worker, 3, "optim_grads_params", 2, None, path):
        assert diff <= 1e-6, diff


def fresh_checkpoint_worker(rank, world, path):
    """Saved before any step (no state yet: the state a first step would make, made without
    stepping), then loaded into another model and optimizer."""
    torch.manual_seed(0)
    model = fully_shard(MuonNet(), sharding_strategy="optim", unit_modules=[MuonBlock])
    opt = _muon_for(model)
    save_checkpoint(path, model, opt)
    assert not opt.state
    other = fully_shard(MuonNet(), sharding_strategy="optim_grads_params", unit_modules=[MuonBlock])
    other_opt = _muon_for(other)
    load_checkpoint(path, other, other_opt)
    return sorted({key for state in other_opt.state.values() for key in state})


def test_muon_checkpoint_before_the_first_step(tmp_path):
    for keys in run_distributed(fresh_checkpoint_worker, 2, str(tmp_path / "ckpt")):
        assert keys == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]


def test_owners_balance_bytes_largest_first():
    assert assign_owners([10, 40, 30, 20], 2) == (0, 0, 1, 1)       # 40 -> 0, 30 -> 1, 20 -> 1, 10 -> 0
    assert assign_owners([5, 5, 5], 4) == (0, 1, 2)
    numels = [7 * 13, 300, 5, 300, 64, 1, 90]
    owners = assign_owners(numels, 3)
    loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(numels)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_exchange_delivers_every_matrix_whole_to_its_owner_and_rows_back(size):
    """The two all-to-alls simulated over every rank's plan: each owner assembles its matrices
    whole in row order, and the scatter returns each rank exactly its own rows."""
    shapes = [(5, 6), (6, 5), (2, 6), (1, 3), (9, 2)]
    splits = [chunk_splits(rows, size) for rows, _ in shapes]
    plans = [build_exchange(shapes, splits, size, rank) for rank in range(size)]
    full = [torch.arange(r * c).view(r, c) + 1000 * i for i, (r, c) in enumerate(shapes)]
    mine = []
    for rank, plan in enumerate(plans):
        buf = torch.empty(plan.mine_numel, dtype=torch.long)
        for i, (start, numel) in enumerate(plan.mine):
            buf[start:start + numel] = full[i][splits[i][rank]:splits[i][rank + 1]].reshape(-1)
        mine.append(list(buf.split(list(plan.mine_splits))))
    owned = [torch.cat([mine[src][dst] for src in range(size)]) for dst in range(size)]
    for rank, plan in enumerate(plans):
        assert owned[rank].numel() == plan.owned_numel
        for i, pieces in plan.owned.items():
            assert plan.owners[i] == rank
            whole = torch.cat([owned[rank][s:s + n] for s, n in pieces]).view(shapes[i])
            assert torch.equal(whole, full[i])
    back = [list(owned[rank].split(list(plans[rank].owned_splits))) for rank in range(size)]
    for rank, plan in enumerate(plans):
        got = torch.cat([back[src][rank] for src in range(size)])
        for i, (start, numel) in enumerate(plan.mine):
            assert torch.equal(got[start:start + numel], full[i][splits[i][rank]:splits[i][rank + 1]].reshape(-1))
    assert all(p.covered_numel == sum(r * c for r, c in shapes) for p in plans)


def test_muon_refuses_non_matrices_marked_use_muon():
    with pytest.raises(ValueError, match="use_muon=True holds a parameter of shape \\(3,\\)"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])



class WideBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ff = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.ff(x))


class WideNet(nn.Module):
    """64-wide matrices (MuonNet's 6-wide ones show no bfloat16 flip in a few steps): an embedding
    and a head (AdamW) around two blocks."""

    def __init__(self, vocab: int = 256, width: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(WideBlock(width), WideBlock(width))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.emb(tokens)))


STEPS = 3
#: How far last-bit gradient differences can move the weights in STEPS steps: up to NS_FLIP_SPREAD
#: (one flipped bfloat16 input element, test_newton_schulz_spreads_one_flipped_bfloat16_element_over_the_matrix)
#: times lr per step, and a few such flips per step (momentum carries them on). Which elements cross a
#: rounding boundary depends on the CPU's matmul kernels, so the distances themselves differ between
#: machines (0.0079 for DDP against one process on one Xeon, under 1e-3 on another); this bound does not.
NS_FLIP_SPREAD = 0.05
ROUNDING_SPREAD = 4 * STEPS * HYPER["lr"] * NS_FLIP_SPREAD


def _wide_batches(step: int, rank: int, micro_batches: int) -> list:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randint(0, 256, (4, 16), generator=g) for _ in range(micro_batches)]


def _wide_steps(model, optimizers: list, batches, no_sync) -> dict:
    """STEPS steps of next-token cross-entropy over ``batches(step)`` (the last outside ``no_sync``);
    returns the first step's full gradients."""
    first = {}
    for step in range(STEPS):
        micro = batches(step)
        for i, tokens in enumerate(micro):
            with no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                logits = model(tokens)[:, :-1].reshape(-1, 256)
                (nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1)) / len(micro)).backward()
        if step == 0:
            first = {n: _full(p.grad) for n, p in getattr(model, "module", model).named_parameters()}
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return first


def _torch_optimizers(named: list) -> list:
    """torch.optim.Muon for the matrices, torch.optim.AdamW for the rest (the Shadow's split)."""
    return [torch.optim.Muon([p for n, p in named if _is_muon(n, p)], **HYPER),
            torch.optim.AdamW([p for n, p in named if not _is_muon(n, p)], **ADAMW)]


def data_parallel_muon_worker(rank, world, strategy, micro_batches):
    """The full weights after STEPS steps of ours and of torch DDP with torch.optim.Muon + AdamW
    (both on ``world`` ranks), and, on rank 0, of one process given every rank's micro-batches as one batch."""
    torch.manual_seed(0)
    ours = fully_shard(WideNet(), sharding_strategy=strategy, unit_modules=[WideBlock])
    grads = {}
    grads["ours"] = _wide_steps(ours, [_muon_for(ours)], lambda step: _wide_batches(step, rank, micro_batches), ours.no_sync)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(WideNet())
    grads["ddp"] = _wide_steps(ddp, _torch_optimizers(list(ddp.module.named_parameters())),
                lambda step: _wide_batches(step, rank, micro_batches), ddp.no_sync)
    out = {"ours": {n: _full(p) for n, p in ours.named_parameters()},
           "ddp": {n: _full(p) for n, p in ddp.module.named_parameters()}, "grads": grads}
    if rank == 0:
        torch.manual_seed(0)
        single = WideNet()
        grads["one_process"] = _wide_steps(single, _torch_optimizers(list(single.named_parameters())),
                    lambda step: [torch.cat([t for r in range(world) for t in _wide_batches(step, r, micro_batches)])],
                    contextlib.nullcontext)
        out["one_process"] = {n: p.detach().clone() for n, p in single.named_parameters()}
    return out


def _largest_difference(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("strategy, micro_batches", [("no_shard", 2), ("optim_grads_params", 1), ("optim_grads_params", 2)])
def test_muon_on_two_ranks_is_torch_ddp_with_torch_muon(strategy, micro_batches):
    """What "torch.optim.Muon's update" means on 2 ranks (docs/user_guide.md, "Muon"). Ours equals
    torch DDP with torch.optim.Muon bitwise wherever the gradients are summed in DDP's order
    (no_shard; every strategy at one micro-batch per step); ZeRO-2/3 reduce-scatter every micro-batch
    (over ranks, then over micro-batches): a rounding away. Both are as far from one process given
    every rank's micro-batches as one batch (at most a few lr x bfloat16 ulps of Newton-Schulz's output per step):
    its gradients sum the same products in another order (one matmul over the whole batch), last
    bits apart, and where
    such a difference crosses a bfloat16 rounding boundary Newton-Schulz spreads it (below)."""
    results = run_distributed(data_parallel_muon_worker, 2, strategy, micro_batches)
    for out in results:
        if strategy == "no_shard" or micro_batches == 1:
            assert _largest_difference(out["ours"], out["ddp"]) == 0.0
        else:       # the first step's gradients a rounding apart; the weights as far as Newton-Schulz spreads it
            assert 0.0 < _largest_difference(out["grads"]["ours"], out["grads"]["ddp"]) <= 1e-6
            assert 0.0 < _largest_difference(out["ours"], out["ddp"]) <= ROUNDING_SPREAD
    ours, ddp, one = results[0]["ours"], results[0]["ddp"], results[0]["one_process"]
    grads = results[0]["grads"]
    differing = (grads["ddp"]["blocks.0.ff.weight"] != grads["one_process"]["blocks.0.ff.weight"]).sum().item()
    assert differing > 100 and _largest_difference(grads["ddp"], grads["one_process"]) < 1e-6
    assert 0.0 < _largest_difference(ddp, one) <= ROUNDING_SPREAD
    assert 0.0 < _largest_difference(ours, one) <= ROUNDING_SPREAD


def test_newton_schulz_spreads_one_flipped_bfloat16_element_over_the_matrix():
    """Why a last-bit gradient difference shows at all: once an fp32 difference crosses a bfloat16
    rounding boundary of Newton-Schulz's input, one element 1 ulp apart makes most of the output
    differ (every matmul mixes every element, each result rounded to bfloat16 again), by up to
    a few bfloat16 ulps of the output: times lr per step in the weights."""
    from megatron_fsdp_v2.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, zeropower_via_newtonschulz

    matrix = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    flipped = matrix.clone()
    flipped[0, 0] = torch.nextafter(flipped[0, 0], torch.tensor(float("inf"), dtype=torch.bfloat16))
    a, b = (zeropower_via_newtonschulz(m, DEFAULT_NS_COEFFICIENTS, 5, 1e-7).float() for m in (matrix, flipped))
    assert (a != b).sum().item() > 64 * 64 // 2
    assert 1e-3 < (a - b).abs().max().item() < NS_FLIP_SPREAD

