"""A Megatron GPT on the meta device, from Megatron-LM's model flags, for ``python -m
megatron_fsdp_v2.plan``: the module, unit classes and mixed-precision policy that
``FullyShardedDataParallel`` would wrap it with (its own ``_mixed_precision`` and default units).

Megatron's modules read the model-parallel groups while they are built, so a one-rank gloo group
and ``initialize_model_parallel(1, 1)`` are set up around the build when none exists (and torn
down after). Nothing is allocated: parameters are on the meta device.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Optional

import torch
import torch.distributed as dist

from .adapter import _default_unit_classes
from .wrap_settings import _mixed_precision

__all__ = ["megatron_gpt_on_meta", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: rounded up to ``divisible_by * TP``."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _model_parallel_state():
    from megatron.core import parallel_state as ps

    created_world = not dist.is_initialized()
    if created_world:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    created_mp = not ps.model_parallel_is_initialized()
    if created_mp:
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        yield
    finally:
        if created_mp:
            ps.destroy_model_parallel()
        if created_world:
            dist.destroy_process_group()


def megatron_gpt_on_meta(num_layers: int, hidden_size: int, num_attention_heads: int, seq_length: int,
                         vocab_size: int, ffn_hidden_size: Optional[int] = None, num_query_groups: Optional[int] = None,
                         max_position_embeddings: Optional[int] = None, untie_embeddings_and_output_weights: bool = False,
                         bf16: bool = False, fp16: bool = False, grad_reduce_in_fp32: bool = False,
                         make_vocab_size_divisible_by: int = 128):
    """``(model, unit classes, MixedPrecisionPolicy)`` as ``FullyShardedDataParallel`` would see them
    (local layer spec, learned absolute positions; ``--bf16`` builds bf16 parameters, as Megatron's
    ``Float16Module`` holds them)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    params_dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size or 4 * hidden_size, num_query_groups=num_query_groups,
        use_cpu_initialization=True, perform_initialization=False, init_model_with_meta_device=True,
        params_dtype=params_dtype, bf16=bf16, fp16=fp16)
    with _model_parallel_state(), torch.device("meta"):
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=padded_vocab_size(vocab_size, make_vocab_size_divisible_by),
                         max_sequence_length=max_position_embeddings or seq_length,
                         share_embeddings_and_output_weights=not untie_embeddings_and_output_weights,
                         position_embedding_type="learned_absolute")
    policy = _mixed_precision(config, DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32))
    units = [cls for cls in _default_unit_classes() if any(isinstance(m, cls) for m in model.modules())]
    return model, units, policy
