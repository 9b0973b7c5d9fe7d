"""bench_llama.py with ours' gradient buffers allocated on the compute stream's pool: an ablation.

On an accelerator ours allocates gradient buffers while a stream of their own is current, so that
freed activation blocks never split under them (group/grad_buffer.py, [Note: gradient buffers from
their own pool]). The price is that the two pools cannot lend each other blocks, which shows in
``max_memory_reserved``. This script runs bench_llama.py with the pool switched off (the pool's
stream reported as absent, as on CPU) so that the reserved memory the pool costs can be read next
to a normal run of the same system. It is a diagnosis, not a setting: the library has no switch.

    python3 benchmarks/llama_without_gradient_pool.py --systems ours-bf16 --out $OUT/no_pool.md --json $OUT/no_pool.json
    python3 benchmarks/bench_llama.py --systems ours-bf16 --out $OUT/pool.md --json $OUT/pool.json

Results: benchmarks/results/2026-12-07c/README.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_llama  # noqa: E402

import megatron_fsdp_v2.group.grad_buffer as grad_buffer  # noqa: E402


def _no_pool(device):
    return None


if __name__ == "__main__":
    grad_buffer.gradient_pool_stream = _no_pool
    sys.exit(bench_llama.main(sys.argv[1:]))
