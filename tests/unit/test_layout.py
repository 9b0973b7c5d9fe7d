"""Properties of the pure flat-buffer layout (hypothesis)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fsdp_v2.layout import build_layout

sizes = st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=12)
dp_sizes = st.integers(min_value=1, max_value=9)
alignments = st.sampled_from([1, 2, 4, 16, 64])


@settings(max_examples=300, deadline=None)
@given(sizes, dp_sizes, alignments)
def test_shards_tile_the_buffer_without_overlap(numels, dp, alignment):
    layout = build_layout(numels, dp, alignment)
    assert layout.total_numel % dp == 0
    covered = []
    for rank in range(dp):
        start, end = layout.shard_range(rank)
        assert end - start == layout.shard_numel
        covered.extend(range(start, end))
    assert covered == list(range(layout.total_numel))


@settings(max_examples=300, deadline=None)
@given(sizes, dp_sizes, alignments)
def test_every_parameter_element_belongs_to_exactly_one_rank(numels, dp, alignment):
    layout = build_layout(numels, dp, alignment)
    for index, numel in enumerate(numels):
        owners = [0] * numel
        for rank in range(dp):
            piece = layout.shard_slice(index, rank)
            shard_start, _ = layout.shard_range(rank)
            for i in range(piece.param_start, piece.param_end):
                owners[i] += 1
                # the piece sits at the right place inside the shard
                assert shard_start + piece.shard_start + (i - piece.param_start) == layout.offsets[index] + i
        assert owners == [1] * numel


@settings(max_examples=300, deadline=None)
@given(sizes, dp_sizes, alignments)
def test_parameters_do_not_overlap_and_padding_is_bounded(numels, dp, alignment):
    layout = build_layout(numels, dp, alignment)
    ranges = sorted(layout.param_range(i) for i in range(len(numels)) if numels[i])
    for (_, end_a), (start_b, _) in zip(ranges, ranges[1:]):
        assert end_a <= start_b
    for offset in layout.offsets:
        assert offset % alignment == 0
    alignment_gaps = sum(layout.offsets[i] - (layout.offsets[i - 1] + numels[i - 1]) for i in range(1, len(numels)))
    end_padding = layout.total_numel - layout.data_numel
    assert 0 <= end_padding <= dp - 1
    assert layout.padding_numel == alignment_gaps + end_padding
    if alignment == 1:
        assert layout.padding_numel <= dp - 1


def test_parameter_may_straddle_ranks():
    layout = build_layout([10, 3], dp_size=4)   # total 13 -> 16, shards of 4
    assert [layout.shard_slice(0, r).numel for r in range(4)] == [4, 4, 2, 0]
    assert layout.shard_slice(1, 2) .param_start == 0 and layout.shard_slice(1, 3).numel == 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dp_size must be positive, got 0"):
        build_layout([3], 0)
    with pytest.raises(ValueError, match="alignment"):
        build_layout([3], 2, alignment=0)
    with pytest.raises(ValueError, match="rank must be in"):
        build_layout([3], 2).shard_range(2)
