"""ZeRO-2/3's reduce input (group/unreduced_grads.py): one ``torch._chunk_cat`` for a whole group
where the layout is that kernel's order, element for element what the per-parameter copies write,
and the per-parameter copies wherever it is not."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fsdp_v2.group.layout import build_layout
from megatron_fsdp_v2.group.unreduced_grads import UnreducedGrads

shape_lists = st.lists(st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=3).map(tuple),
                       min_size=1, max_size=8)


class _Ops(TorchDispatchMode):
    """The aten ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _write(layout, grads, one_copy: bool):
    """The reduce input ``write_into`` fills; ``one_copy=False``: as for a layout that is not the
    kernel's order (the per-parameter copies)."""
    held = UnreducedGrads(len(grads))
    for index, grad in enumerate(grads):
        if grad is not None:
            held.add(index, grad)
    flat = torch.full((layout.total_numel,), float("nan"))          # every element must be written
    held.write_into(flat, layout if one_copy else dataclasses.replace(layout, chunk_cat_chunks=0))
    assert not held.any()
    return flat


@settings(max_examples=200, deadline=None)
@given(shape_lists, st.integers(min_value=1, max_value=5), st.sampled_from([1, 4, 64]), st.booleans(),
       st.sampled_from(["all", "missing", "strided", "two dtypes"]))
def test_one_copy_writes_what_the_per_parameter_copies_write(shapes, dp, alignment, per_parameter, grads_are):
    layout = build_layout(shapes, dp, alignment, per_parameter=per_parameter)
    generator = torch.Generator().manual_seed(len(shapes) * 31 + dp)
    grads = [torch.randn(*shape, 2, generator=generator)[..., 0] if grads_are == "strided"      # not contiguous
             else torch.randn(shape, generator=generator) for shape in shapes]
    grads = [g.to(torch.bfloat16) for g in grads]
    if grads_are == "missing":
        grads[0] = None
    if grads_are == "two dtypes":
        grads[0] = grads[0].float()
    fused, loop = _write(layout, grads, True), _write(layout, grads, False)
    assert not fused.isnan().any() and torch.equal(fused, loop)


def _llama_layer(hidden: int, intermediate: int) -> list:
    return [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate), (hidden,), (hidden,)]


@pytest.mark.parametrize("hidden, dp", [(768, 1), (1024, 8), (4096, 64)])
def test_a_transformer_layer_is_one_chunk_cat(hidden, dp):
    """A Llama-shaped layer (9 parameters, GPU alignment) in bf16, reduced in fp32: one launch."""
    shapes = _llama_layer(hidden, 2 * hidden)
    for per_parameter in (True,) if dp > 1 else (False,):
        layout = build_layout(shapes, dp, 64, per_parameter=per_parameter)
        assert layout.chunk_cat_chunks == dp
        held = UnreducedGrads(len(shapes))
        for index, shape in enumerate(shapes):
            held.add(index, torch.ones(shape, dtype=torch.bfloat16))
        flat = torch.empty(layout.total_numel)
        with _Ops() as ops:
            held.write_into(flat, layout)
        launches = {name: n for name, n in ops.names.items() if name not in ("aten.view", "aten.slice")}
        assert launches == {"aten._chunk_cat": 1}, ops.names
        assert flat.sum().item() == sum(torch.Size(s).numel() for s in shapes)


@pytest.mark.parametrize("shapes, dp, per_parameter", [
    ([(8, 4), ()], 2, True),             # a 0-d parameter (torch._chunk_cat crashes on those)
    ([(8, 4), (0, 4)], 2, True),         # an empty one (it refuses those)
    ([(3,), (64, 4)], 1, False),         # a gap before the aligned second parameter
    ([(3, 4)], 8, True),                 # fewer rows than ranks: pieces padded to the alignment
    (_llama_layer(768, 2048), 8, True),  # the norms' 96-element pieces padded to 128 (GPU alignment)
])
def test_layouts_that_are_not_the_kernels_order_keep_the_per_parameter_copies(shapes, dp, per_parameter):
    layout = build_layout(shapes, dp, 64, per_parameter=per_parameter)
    assert layout.chunk_cat_chunks == 0
