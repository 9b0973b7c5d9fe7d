"""Megatron's own initialization for a model built on the meta device
(``--init-model-with-meta-device``, ``TransformerConfig.init_model_with_meta_device``).

Megatron-LM builds the model under ``torch.device("meta")`` when the flag is set and hands it to the
data-parallel wrapper. Transformer Engine layers then have ``reset_parameters()`` (Megatron-FSDP
calls it); the local spec's layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``) initialize their weights inside ``__init__`` from ``init_method``
arguments they do not keep, and have no ``reset_parameters``, so Megatron-FSDP v1 refuses them.
``megatron_init_fn(config)`` gives the core's ``init_fn`` what those constructors would have done,
from the config, as in megatron-core 0.19.2's GPT and local spec:

* ``RowParallelLinear`` weights (attention output ``linear_proj``, MLP ``linear_fc2``):
  ``config.output_layer_init_method``; ``ColumnParallelLinear`` weights (``linear_qkv``,
  ``linear_fc1``, an untied ``output_layer``): ``config.init_method``; their biases: zero.
* ``VocabParallelEmbedding``: ``config.embedding_init_method`` (0.19's default: ``init_method``).
* Learned absolute position embeddings (``torch.nn.Embedding`` inside ``LanguageModelEmbedding``):
  ``config.init_method``, as ``LanguageModelEmbedding.__init__`` does.
* Anything else with ``reset_parameters()`` (layer norms, Transformer Engine layers): that.

With tensor parallelism each rank initializes its partition with the init method (Megatron's
GPU-initialization path does the same under its RNG tracker); values then match eager
initialization in distribution, not bitwise (Megatron's CPU path draws the full matrix and splits it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["megatron_init_fn"]


def megatron_init_fn(config):
    """The ``init_fn`` for ``fully_shard`` that initializes Megatron's layers as their constructors do."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    embedding_init = getattr(config, "embedding_init_method", None) or config.init_method

    def init(module: nn.Module) -> None:
        with torch.no_grad():
            if isinstance(module, RowParallelLinear):
                _linear(module, config.output_layer_init_method)
            elif isinstance(module, ColumnParallelLinear):
                _linear(module, config.init_method)
            elif isinstance(module, VocabParallelEmbedding):
                embedding_init(module.weight)
            elif isinstance(module, nn.Embedding):
                config.init_method(module.weight)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()

    return init


def _linear(module: nn.Module, weight_init) -> None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        weight_init(weight)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.zero_()
