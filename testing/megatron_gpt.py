"""The tiny Megatron GPT the demo, the CPU tests, the functional suite and the benchmarks train,
and Megatron-LM's loss and forward-step convention for it: written once, used by all of them.

Outside the installed package (``testing/`` of the checkout), like ``cpu_compat.py``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from testing.cpu_compat import UNFUSED_KERNELS


def tiny_cpu_config(layers: int, hidden: int, heads: int, **overrides):
    """fp32 ``TransformerConfig`` built on the CPU, no dropout, plain-PyTorch kernels: training is
    deterministic and identical on every rank."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, use_cpu_initialization=True,
                  params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False, fp16=False,
                  hidden_dropout=0.0, attention_dropout=0.0, **UNFUSED_KERNELS)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def mlp_only_layer_spec():
    """The local layer spec without attention (each layer: identity, then its MLP with the
    residual): a GPT whose layers need no context-parallel attention, which Megatron offers only
    through Transformer Engine."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = IdentityOp
    spec.submodules.self_attention = IdentityOp
    spec.submodules.self_attn_bda = IdentityFuncOp
    return spec


def local_gpt(config, vocab: int, seq: int, seed: Optional[int] = None, share_embeddings: bool = True,
              layer_spec=None, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None):
    """Megatron's ``GPTModel`` with the local (non-Transformer-Engine) layer spec (or
    ``layer_spec``) and learned absolute positions. With ``seed`` it is built under
    ``torch.manual_seed(seed)`` and the caller's CPU RNG state is restored afterwards."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    state = torch.get_rng_state() if seed is not None else None
    if seed is not None:
        torch.manual_seed(seed)
    try:
        return GPTModel(config=config, transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(), vocab_size=vocab,
                        max_sequence_length=seq, pre_process=pre_process, post_process=post_process,
                        parallel_output=True, vp_stage=vp_stage,
                        share_embeddings_and_output_weights=share_embeddings,
                        position_embedding_type="learned_absolute")
    finally:
        if state is not None:
            torch.set_rng_state(state)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM 0.19 ``pretrain_gpt.loss_func`` convention (3-tuple):
    ``(sum of masked token losses, num_tokens, {"lm loss": [loss_sum, num_tokens]})``. The schedule
    divides by ``num_tokens`` and by the number of micro-batches before backward."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """``forward_step_func`` for ``get_forward_backward_func()``: ``(per-token losses, loss_fn)``.
    ``model`` may be the bare GPTModel or any wrapper forwarding ``__call__`` to it."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def megatron_train_step(wrapped, optimizer, micro_batches: list, seq: int, micro_batch_size: int,
                        forward_backward=None):
    """Megatron-LM's ``train_step`` for one model chunk: zero the grad buffers, run
    ``forward_backward`` (default ``get_forward_backward_func()``; Megatron-LM wraps it in
    ``FullCudaGraphWrapper`` with ``--cuda-graph-impl full_iteration``) over the micro-batches
    (``config.finalize_model_grads_func`` reduces), step. Returns ``(losses reported by the schedule,
    step succeeded, grad norm)``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    wrapped.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = forward_backward or get_forward_backward_func()
    store = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[wrapped],
                             num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=micro_batch_size,
                             forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    return store, ok, grad_norm
