"""Per-parameter shards (group/layout.py, [Note: per-parameter shards]) and the copies between their two
orders (group/shard_order.py), checked against torch.chunk and a gather written out by hand."""

import pytest
import torch

from megatron_fsdp_v2.group.layout import build_layout
from megatron_fsdp_v2.group.shard_order import natural_from_gathered, own_from_natural, write_rank_major

SHAPES = [(7,), (3, 4), (2, 4), (3,), (), (5, 0), (0,), (768, 6)]


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]


def _natural(layout, params):
    natural = torch.zeros(layout.total_numel)
    for i, p in enumerate(params):
        start, end = layout.param_range(i)
        natural[start:end] = p.reshape(-1)
    return natural


def _rank_major_by_hand(layout, params):
    """Rank r's shard: its piece of every parameter at piece_start, zeros elsewhere."""
    shards = torch.zeros(layout.dp_size, layout.shard_numel)
    for i, p in enumerate(params):
        for r in range(layout.dp_size):
            piece = layout.shard_slice(i, r)
            shards[r, piece.shard_start:piece.shard_start + piece.numel] = p.reshape(-1)[piece.param_start:piece.param_end]
    return shards.reshape(-1)


@pytest.mark.parametrize("dp,alignment", [(2, 1), (3, 1), (4, 1), (8, 1), (2, 64), (3, 4)])
def test_pieces_are_torch_chunk_rows_of_every_parameter(dp, alignment):
    layout = build_layout(SHAPES, dp, alignment, per_parameter=True)
    assert layout.per_parameter and layout.total_numel == dp * layout.shard_numel
    for i, shape in enumerate(SHAPES):
        rows = shape[0] if shape else 1
        splits = layout.row_splits(i)
        assert splits[0] == 0 and splits[-1] == rows and list(splits) == sorted(splits)
        if alignment == 1 and layout.numels[i]:     # torch.chunk's split (FSDP2's Shard(0))
            chunks = torch.arange(rows).chunk(dp)
            assert [splits[r + 1] - splits[r] for r in range(len(chunks))] == [len(c) for c in chunks]
        start, _ = layout.param_range(i)
        assert start % alignment == 0 and layout.piece_start(i) * dp == start
        assert layout.piece_numel(i) % alignment == 0
    # no two pieces overlap in a shard, and every piece fits it
    for r in range(dp):
        spans = sorted((s.shard_start, s.shard_start + s.numel) for s in
                       (layout.shard_slice(i, r) for i in range(len(SHAPES))) if s.numel)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert all(end <= layout.shard_numel for _, end in spans)


def test_dp2_split_of_two_large_matrices_halves_both():
    """What the FSDP2 step-memory test needs: no rank holds a whole w1 or w2."""
    layout = build_layout([(768, 768)] * 4 + [(3072, 768), (768, 3072)], 2, per_parameter=True)
    assert [layout.shard_slice(i, r).numel for i in (4, 5) for r in (0, 1)] == [1536 * 768] * 2 + [384 * 3072] * 2
    assert layout.padding_numel == 0
    row_snapped = build_layout([(768, 768)] * 4 + [(3072, 768), (768, 3072)], 2)
    assert row_snapped.shard_slice(5, 1).numel == 768 * 3072         # the whole w2 on rank 1


@pytest.mark.parametrize("dp,alignment", [(2, 1), (3, 1), (4, 4), (8, 64)])
def test_copies_between_orders(dp, alignment):
    layout = build_layout(SHAPES, dp, alignment, per_parameter=True)
    params = _params(SHAPES)
    natural = _natural(layout, params)
    by_hand = _rank_major_by_hand(layout, params)
    back = torch.full((layout.total_numel,), float("nan"))
    natural_from_gathered(by_hand, layout, back)
    for i, p in enumerate(params):
        start, end = layout.param_range(i)
        assert torch.equal(back[start:end], p.reshape(-1))
    for r in range(dp):
        assert torch.equal(own_from_natural(natural, layout, r), by_hand.view(dp, -1)[r])
    # gradients written rank-major, straight into a reduce input that held garbage
    flat = torch.full((layout.total_numel,), float("nan"))
    flat.view(dp, -1)[:, sum(layout.piece_numel(i) for i in range(len(SHAPES))):] = 0
    for i, p in enumerate(params):
        write_rank_major(flat, layout, i, None if i == 1 else p.reshape(-1))
    expected = _rank_major_by_hand(layout, [torch.zeros_like(p) if i == 1 else p for i, p in enumerate(params)])
    assert torch.equal(flat, expected)


def test_row_snapped_layouts_are_their_own_rank_major_order():
    layout = build_layout(SHAPES, 3)
    assert not layout.per_parameter
    natural = _natural(layout, _params(SHAPES))
    for r in range(3):
        start, end = layout.shard_range(r)
        assert torch.equal(own_from_natural(natural, layout, r), natural[start:end])


def test_one_rank_is_unsplit():
    assert build_layout(SHAPES, 1, per_parameter=True) == build_layout(SHAPES, 1)
    assert build_layout(SHAPES, 1).row_splits(1) == (0, 3)
