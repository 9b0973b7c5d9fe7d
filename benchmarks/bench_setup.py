"""The process side of bench_gpt.py: the process group (real, or torch's fake one for per-rank
memory), Megatron's parallel state, the token batch, the GPT every system trains, and reading the
device's memory and clock. Nothing here knows about the systems being compared (bench_systems.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from tests.dist_pool import free_port


# =============================================================================================
# Distributed setup
# =============================================================================================


@dataclass
class Ctx:
    args: argparse.Namespace
    device: torch.device
    rank: int
    world: int          # data-parallel size the systems see (fake or real)
    real_world: int     # processes actually running
    fake: bool
    tokens: Optional[torch.Tensor] = None
    labels: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    num_params: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, *a, **k) -> None:
        if self.rank == 0:
            print(*a, **k, flush=True)


def init_distributed(args) -> Ctx:
    device_type = args.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible (use --device cpu for a CPU dry run).")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    if args.fake_world_size and args.fake_world_size > 0:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise SystemExit("--fake-world-size cannot be combined with --nproc/torchrun.")
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
        return Ctx(args, device, 0, args.fake_world_size, 1, True)

    backend = "nccl" if device_type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:          # torchrun
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return Ctx(args, device, dist.get_rank(), dist.get_world_size(), dist.get_world_size(), False)


def init_megatron(ctx: Ctx, stack: contextlib.ExitStack) -> None:
    """``initialize_model_parallel(1, 1)`` (TP = PP = 1: the whole world is data parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ctx.is_cuda:
        # Megatron hard-codes CUDA in a few places a GPTModel forward runs through (RNG tracker,
        # attention's global buffer): the test harness patches exactly those, CPU runs only.
        from testing.cpu_compat import patch_megatron_for_cpu   # the checkout's testing/ (bench_gpt.py's sys.path)

        stack.enter_context(patch_megatron_for_cpu())
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 create_gloo_process_groups=False)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def make_batch(ctx: Ctx) -> None:
    a = ctx.args
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    seq_tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g)
    ctx.tokens = seq_tokens[:, :-1].contiguous().to(ctx.device)
    ctx.labels = seq_tokens[:, 1:].contiguous().to(ctx.device)
    ctx.position_ids = torch.arange(a.seq, device=ctx.device).unsqueeze(0).expand(a.micro_batch, a.seq).contiguous()
    if ctx.is_cuda:
        ctx.attention_mask = None   # local spec, causal: Megatron builds the mask on CUDA itself
    else:
        # get_default_causal_mask() is CUDA-only; pass the same mask explicitly (True = masked).
        ctx.attention_mask = torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), diagonal=1).view(1, 1, a.seq, a.seq)


def prewarm_global_buffer(ctx: Ctx) -> None:
    """Local-spec attention writes its scores into Megatron's process-wide GlobalMemoryBuffer
    (b*heads x s x s, compute dtype), which lives until exit. Allocate it once up front so the
    first system is not charged for it; it is excluded from every memory number below."""
    from megatron.core import parallel_state as ps

    a = ctx.args
    ps.get_global_memory_buffer().get_tensor((a.micro_batch * a.heads, a.seq, a.seq), torch.bfloat16, "mpu")


def prepare_process(ctx: Ctx, stack: contextlib.ExitStack) -> None:
    """What every benchmark process does before its first system: Megatron's parallel state, the
    token batch, and (GPUs) the shared attention buffer allocated up front."""
    init_megatron(ctx, stack)
    make_batch(ctx)
    if ctx.is_cuda:
        prewarm_global_buffer(ctx)


def finish_process() -> None:
    """Megatron's parallel state and the process group, torn down at the end of a benchmark."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def global_buffer_bytes() -> int:
    try:
        from megatron.core import parallel_state as ps

        buf = ps.get_global_memory_buffer()
    except Exception:
        return 0
    total = 0
    for t in buf.buffer.values():
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            total += t.numel() * t.element_size()
    return total

# =============================================================================================
# Model
# =============================================================================================


def build_gpt(ctx: Ctx, params_dtype: torch.dtype, bf16: bool = True):
    """The GPT of ``ctx.args``, on the device, from one seed (every system from the same weights)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from testing.cpu_compat import UNFUSED_KERNELS
    from testing.megatron_gpt import local_gpt

    a = ctx.args
    config = TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        ffn_hidden_size=a.ffn or 4 * a.hidden,
        # Build straight on the GPU: CPU initialisation of ~1B parameters takes minutes.
        use_cpu_initialization=not ctx.is_cuda,
        perform_initialization=not a.skip_init,
        params_dtype=params_dtype,
        bf16=bf16,                      # same attention-softmax precision for every system
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # No TE/apex on the benchmark box: keep every kernel plain PyTorch, for every system alike.
        **UNFUSED_KERNELS,
    )
    # every system from the same weights (Megatron draws its linear layers' from the tracker's
    # CUDA generator, which an earlier system's build consumed): losses compare across systems
    from megatron.core import tensor_parallel

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = local_gpt(config, a.vocab, a.seq, share_embeddings=False)
    # A few torch.nn modules (position embedding, norms) are created on CPU whatever the flag.
    return model.to(ctx.device), config


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())



# =============================================================================================
# Device memory and clock
# =============================================================================================


def sync(ctx: Ctx) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def allocated(ctx: Ctx) -> Optional[int]:
    """Bytes allocated by tensors, without Megatron's process-wide attention buffer."""
    if not ctx.is_cuda:
        return None
    return torch.cuda.memory_allocated(ctx.device) - global_buffer_bytes()


def cleanup(ctx: Ctx) -> None:
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
        empty_host_cache = (getattr(torch._C, "_host_emptyCache", None)
                            or getattr(torch._C, "_accelerator_emptyHostCache", None))
        if empty_host_cache is not None:       # pinned host blocks a finished system (offload) left cached
            empty_host_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
