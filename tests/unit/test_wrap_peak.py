"""ZeRO-3's wrap-time peak is no higher than torch FSDP2's on the same model (issue 63, item 2).

Read on CPU from the allocator's events, from building the model to the end of the wrap
(tests/wrap_peak.py: an Embedding(4096, 256) at the root, 8 blocks of two Linear(256 x 1024) layers
and a LayerNorm, 20.04 MiB of fp32 parameters), at dp 1 (a 1-rank gloo group) and as rank 0 of a
fake 8-way group, bf16 compute and torchao float8 (emulated), the model built on the device and on
meta. Before the fix, on the stack alone at width 512: dp 1 bf16 128.16 against FSDP2's 72.09 MiB
(``compact`` held the model twice), float8 192.16 (the float8 weights were kept until the end of
the wrap as well), fake 8 float8 80.02 against 65.08 MiB; on HF Llama (hidden 512, 4 layers, vocab
8192) at fake 8, 82.02 against 79.46 MiB (the root's embeddings were built first).

What is allowed above FSDP2 and why (each a number of bytes computed from the model):

* ``SLACK``: 0-d placeholders and the RNG state a meta initialization forks (under 16 KiB here);
* float8 at dp 1 (from the device or meta): the wrap makes each float8 weight's compute tensor
  once (install_extension_params), and on CPU torchao's eager cast holds its float32 product and
  clamp of one weight while it does (2 x 4 B x the largest float8 weight); on a GPU that cast is
  one kernel without them (extensions/float8_cast.py). FSDP2 casts at the first forward;
* from meta at fake 8 (and float8 from meta): the largest module's parameters in fp32 (the
  embedding). FSDP2 initializes each rank's shards in place through DTensor; ours materializes a
  module's parameters whole while its initializer runs so the values are those of eager
  construction (wrap/meta_init.py), and makes a float8 unit's compute tensors once.
"""

from __future__ import annotations

import pytest

from tests.wrap_peak import VOCAB_PER_WIDTH, run_in_subprocess

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install '.[float8]')")

WIDTH, BLOCKS = 256, 8
MIB = 2 ** 20
SLACK = 64 * 1024
CASES = [f"{system}:{precision}:{where}" for where in ("device", "meta") for precision in ("bf16", "float8")
         for system in ("fsdp2", "ours-zero3")]
EMBED_BYTES = 4 * VOCAB_PER_WIDTH * WIDTH * WIDTH
MODEL_BYTES = EMBED_BYTES + 4 * (BLOCKS * (2 * 4 * WIDTH * WIDTH + 5 * WIDTH) + 2 * WIDTH)
LARGEST_MODULE_BYTES = max(EMBED_BYTES, 4 * (4 * WIDTH * WIDTH + 4 * WIDTH))
CAST_TEMPORARIES = 2 * 4 * (4 * WIDTH * WIDTH)


@pytest.fixture(scope="module")
def peaks():
    return run_in_subprocess([1, 8], CASES, WIDTH, BLOCKS)


def _compare(peaks, world: int, precision: str, where: str, allowance: int) -> tuple:
    ours, fsdp2 = (peaks[world][f"{system}:{precision}:{where}"] for system in ("ours-zero3", "fsdp2"))
    print(f"dp {world} {precision} built on {where}: ours {ours['peak']} B ({ours['peak'] / MIB:.2f} MiB), FSDP2 "
          f"{fsdp2['peak']} B ({fsdp2['peak'] / MIB:.2f} MiB), allowed above FSDP2 {allowance} B; live at ours' "
          f"peak: {ours['at_peak'][:3]}")
    # both keep the same bytes once wrapped: this rank's fp32 shards
    assert ours["held_after"] == fsdp2["held_after"] == pytest.approx(MODEL_BYTES / world, rel=0.01)
    return ours["peak"], fsdp2["peak"]


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("precision", ["bf16", "float8"])
def test_zero3_wrap_of_a_model_built_on_the_device_peaks_no_higher_than_fsdp2(peaks, world, precision):
    allowance = SLACK + (CAST_TEMPORARIES if precision == "float8" and world == 1 else 0)
    ours, fsdp2 = _compare(peaks, world, precision, "device", allowance)
    assert fsdp2 >= MODEL_BYTES                     # the model itself was measured
    assert ours <= fsdp2 + allowance


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("precision", ["bf16", "float8"])
def test_zero3_wrap_of_a_model_built_on_meta_peaks_no_higher_than_fsdp2_but_one_block(peaks, world, precision):
    strict = world == 1 and precision == "bf16"
    allowance = SLACK + (0 if strict else LARGEST_MODULE_BYTES) + (CAST_TEMPORARIES if precision == "float8"
                                                                   and world == 1 else 0)
    ours, fsdp2 = _compare(peaks, world, precision, "meta", allowance)
    assert fsdp2 <= MODEL_BYTES / world + SLACK      # FSDP2 materializes its shards only
    assert ours <= fsdp2 + allowance
