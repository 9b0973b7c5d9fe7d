from setuptools import find_packages, setup

setup(
    name="megatron_fsdp_v2",
    version="0.1.0",
    description="Fully sharded data parallelism (ZeRO-1/2/3) for Megatron-Core and plain PyTorch loops.",
    packages=find_packages(include=["megatron_fsdp_v2", "megatron_fsdp_v2.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11,<2.16", "numpy", "packaging"],
    extras_require={
        # psutil: megatron.core.dist_checkpointing's checkpoint writer (--ckpt-format torch_dist);
        # einops: parallel_state's groups for --num-distributed-optimizer-instances > 1
        "megatron": ["megatron-core==0.19.2", "psutil", "einops"],
        # torchao, transformers: the float8 tests (tests/unit/test_float8.py) and bench_llama's smoke test
        "test": ["pytest", "hypothesis", "torchao>=0.18", "transformers"],
        "te": ["transformer-engine"],
        # transformers: benchmarks/bench_llama.py's LlamaForCausalLM
        "bench": ["transformers"],
        # torchao float8 training (benchmarks/bench_llama.py's fp8 systems, issue 47)
        "float8": ["torchao>=0.18"],
        # Megatron's --optimizer muon (megatron_fsdp_v2/megatron/muon.py); megatron_fsdp_v2.optim.Muon needs torch only
        "muon": ["emerging-optimizers==0.3.0"],
    },
)
