"""Expert parameters on their own group: ``fully_shard(..., expert_process_group=G, expert_params=...)``.

CPU gloo, 4 ranks = 2 expert-parallel ranks x 2 expert-data-parallel ranks (G: ranks holding the
same experts, {0, 2} and {1, 3}). Each rank runs its own tokens through the dense layers and its
expert-parallel rank's experts. The exact reference is one unsharded model holding every expert,
whose loss is the mean of all ranks' losses: its expert gradients are the sum over the ranks
holding that expert divided by the world (Megatron DDP's scaling), and its gradient norm counts
every element once. Every strategy, 3 steps of k=2 micro-batches (the first in ``no_sync()``),
clip 0.5, AdamW: weights, norms within 1e-5; the experts group carries the strategy table's
collectives over G (``comm_stats()["experts"]``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_v2 import STRATEGY_NAMES, fully_shard

from .dist_utils import run_distributed

STEPS, K, EP, HIDDEN = 3, 2, 2, 8
LR, WD, CLIP = 1e-2, 0.1, 0.5


class Layer(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(experts))

    def forward(self, x, first_expert=0, count=None):
        experts = list(self.experts)[first_expert:first_expert + (count or len(self.experts))]
        return torch.tanh(self.dense(x)) + sum(torch.tanh(e(x)) for e in experts) / len(experts)


class MoENet(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(experts) for _ in range(2))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x, first_expert=0, count=None):
        for layer in self.layers:
            x = layer(x, first_expert, count)
        return self.head(x)


def _batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, HIDDEN, generator=g), torch.randn(4, 1, generator=g)


def _global_model():
    torch.manual_seed(0)
    return MoENet(experts=EP)         # one expert per expert-parallel rank here


def _local_from_global(global_model, ep_rank):
    """This rank's model: dense weights of the global one, its expert-parallel rank's expert."""
    local = MoENet(experts=1)
    state = {}
    for name, value in global_model.state_dict().items():
        if ".experts." in name:
            prefix, index, rest = name.split(".experts.")[0], int(name.split(".experts.")[1].split(".")[0]), \
                name.split(".experts.")[1].split(".", 1)[1]
            if index == ep_rank:
                state[f"{prefix}.experts.0.{rest}"] = value
        else:
            state[name] = value
    local.load_state_dict(state)
    return local


def _reference(world):
    """Losses, norms and final weights of the unsharded global model (every rank computes it)."""
    model = _global_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(STEPS):
        for micro in range(K):
            total = 0.0
            for rank in range(world):
                x, y = _batch(step, micro, rank)
                total = total + ((model(x, rank % EP, 1) - y) ** 2).mean() / world
            total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return norms, model


def parity_worker(rank, world, strategies):
    ep_rank, edp_rank = rank % EP, rank // EP
    groups = {}
    for position in range(EP):                     # expert-data-parallel groups: same expert-parallel rank
        groups[position] = dist.new_group(list(range(position, world, EP)))
    expert_group = groups[ep_rank]
    norms_want, want_model = _reference(world)
    want = _local_from_global(want_model, ep_rank).state_dict()
    out = {}
    for strategy in strategies:
        torch.manual_seed(100 + rank)             # other weights everywhere: wrapping must take rank 0's of each group
        local = MoENet(experts=1)
        start = _local_from_global(_global_model(), ep_rank).state_dict()
        with torch.no_grad():                      # only each expert group's rank 0 holds the right start values
            for name, param in local.named_parameters():
                if edp_rank == 0 and ".experts." in name or rank == 0:
                    param.copy_(start[name])
        model = fully_shard(local, sharding_strategy=strategy, unit_modules=[Layer], expert_process_group=expert_group,
                            expert_params=lambda name, p: ".experts." in name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        model.reset_comm_stats()
        norms = []
        for step in range(STEPS):
            for micro in range(K):
                x, y = _batch(step, micro, rank)
                if micro < K - 1:
                    with model.no_sync():
                        ((model(x) - y) ** 2).mean().backward()
                else:
                    ((model(x) - y) ** 2).mean().backward()
            norms.append(float(model.clip_grad_norm_(CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        stats = model.comm_stats()
        out[strategy] = (norms, model.full_state_dict(), stats, model.persistent_bytes())
    return norms_want, want, out


@pytest.fixture(scope="module")
def parity_results():
    return run_distributed(parity_worker, 4, STRATEGY_NAMES, timeout=600)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_expert_groups_match_the_unsharded_global_model(parity_results, strategy):
    for rank, (norms_want, want, out) in enumerate(parity_results):
        norms, got, _, _ = out[strategy]
        assert norms == pytest.approx(norms_want, rel=1e-5), (rank, strategy)
        assert norms[0] > CLIP                      # clipping really scaled the gradients
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {strategy} {name}")
    # expert-parallel peers hold different experts, expert-data-parallel peers the same
    expert = "layers.0.experts.0.weight"
    assert not torch.equal(parity_results[0][2][strategy][1][expert], parity_results[1][2][strategy][1][expert])
    torch.testing.assert_close(parity_results[0][2][strategy][1][expert], parity_results[2][2][strategy][1][expert],
                               rtol=0, atol=0)


# Per step over the experts group G (2 ranks), per unit (2 layers; the root holds no expert):
# one expert weight of 8x8 = 64 elements per layer unit, fp32 (CPU: no alignment padding).
EXPERT_BYTES = 64 * 4
PER_STEP = {   # (collective, count, bytes) per step, 2 units, k = 2 micro-batches
    "no_shard": {"all_reduce": (2, 2 * EXPERT_BYTES)},
    "optim": {"reduce_scatter": (2, 2 * EXPERT_BYTES), "all_gather": (2, 2 * EXPERT_BYTES)},
    "optim_grads": {"reduce_scatter": (2 * K, 2 * K * EXPERT_BYTES), "all_gather": (2, 2 * EXPERT_BYTES)},
    # forward and backward gather each unit per micro-batch; one reduce-scatter per unit and micro-batch
    "optim_grads_params": {"all_gather": (2 * 2 * K, 2 * 2 * K * EXPERT_BYTES),
                           "reduce_scatter": (2 * K, 2 * K * EXPERT_BYTES)},
}


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_expert_group_carries_the_strategy_table_collectives(parity_results, strategy):
    for rank, (_, _, out) in enumerate(parity_results):
        stats = out[strategy][2]["experts"]
        for collective, (count, nbytes) in PER_STEP[strategy].items():
            assert stats[collective]["count"] == STEPS * count, (rank, strategy, collective, stats)
            assert stats[collective]["bytes"] == STEPS * nbytes, (rank, strategy, collective, stats)
        # the clip's one scalar all-reduce over G for sharded strategies, none otherwise
        sharded = strategy != "no_shard"
        assert stats["all_reduce"]["count"] == (STEPS * 2 if strategy == "no_shard" else STEPS * int(sharded)), \
            (rank, strategy, stats)
        persistent = out[strategy][3]
        assert persistent["main_weights"] > 0


def refusal_worker(rank, world, case):
    groups = dist.new_group([0, 2]), dist.new_group([1, 3])          # every rank creates both, in order
    expert_group = groups[rank % 2]
    try:
        if case == "half":
            fully_shard(MoENet(1), sharding_strategy="optim", expert_process_group=expert_group)
        elif case == "checkpoint":
            model = fully_shard(MoENet(1), sharding_strategy="optim", expert_process_group=expert_group,
                                expert_params=lambda n, p: ".experts." in n)
            model.state_dict()
        elif case == "none_selected":
            fully_shard(MoENet(1), sharding_strategy="optim", expert_process_group=expert_group,
                        expert_params=lambda n, p: False)
        elif case == "meta":
            with torch.device("meta"):
                net = MoENet(1)
            fully_shard(net, sharding_strategy="optim", expert_process_group=expert_group,
                        expert_params=lambda n, p: ".experts." in n)
    except (ValueError, TypeError) as exc:
        return str(exc)
    finally:
        dist.barrier()                   # no rank tears its groups down while a peer still connects
        for group in groups:             # pooled workers: no sockets left behind for later tests
            dist.destroy_process_group(group)
    return None


@pytest.mark.parametrize("case,words", [
    ("half", "expert_process_group and expert_params go together"),
    ("checkpoint", "names repeat across expert-parallel ranks"),
    ("meta", "meta device"),
    ("none_selected", "expert_params: selected no parameter of MoENet"),
])
def test_expert_arguments_are_checked_on_every_rank(case, words):
    messages = run_distributed(refusal_worker, 4, case)
    assert all(m is not None and words in m for m in messages), messages


def test_deepseek_v3_expert_shapes_pad_under_half_a_percent_at_ep2_dp4():
    """DeepSeek-V3-like experts (hidden 7168, moe_ffn_hidden 2048, SwiGLU fc1 2 x 2048 rows,
    256 experts over EP2: 128 per rank) sharded over the expert-data-parallel group of EP2 x DP4
    (4 ranks), as one unit's expert group on a GPU (64-element alignment): the padding is below
    0.5% (Megatron-FSDP's LCM padding grew with these shapes); also at 8 and 2 shards."""
    from megatron_fsdp_v2.group.layout import build_layout

    shapes = [shape for _ in range(256 // 2) for shape in ((2 * 2048, 7168), (7168, 2048))]
    real = sum(rows * cols for rows, cols in shapes)
    for shards in (4, 8, 2):
        layout = build_layout(shapes, shards, 64)
        padding = (layout.total_numel - real) / real
        assert 0 <= padding < 5e-3, (shards, padding)
        assert layout.total_numel % shards == 0
