"""A whole training step replayed as one CUDA graph (``make_graphed_step``) against the same steps
run eagerly, bit for bit, on the GPU (issue 62, item 4).

Model: Hugging Face ``LlamaForCausalLM`` from a small config (SDPA's math kernel: deterministic), fp32
main weights, each decoder layer a unit. A step: 2 micro-batches (the first under ``no_sync()``),
``torch.nn.utils.clip_grad_norm_``, ``AdamW(capturable=True)``, ``zero_grad(set_to_none=False)``.
20 steps; the graphed run's first 3 are its eager warm-up, the 4th is captured and replayed, the
rest replayed. Checked for every strategy, both allocators, bf16 and fp32 compute: the 20 losses
and the final full weights equal the eager run's exactly, and ``comm_stats()`` counts what eager
counts. Written for any world size (each rank its own batches); at N=1 today (one GPU lent).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_fsdp_v2 import MixedPrecisionPolicy, fully_shard, make_graphed_step

from .harness import STRATEGIES

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[test]')")

STEPS, WARMUP, MICRO = 20, 3, 2
VOCAB, SEQ, BATCH = 256, 64, 2


def _llama(world):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, use_cache=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"   # "eager" builds its mask from a host scalar: not capturable
    torch.manual_seed(1234)
    with torch.device(world.device):
        return LlamaForCausalLM(config).float().train()


def _wrap(world, strategy: str, compute: str, allocator: str):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if compute == "bf16" else None
    model = fully_shard(_llama(world), sharding_strategy=strategy, unit_modules=[LlamaDecoderLayer],
                        allocator=allocator, mixed_precision=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, capturable=True)
    return model, optimizer


def _step_fn(model, optimizer):
    def step(tokens):
        total = torch.zeros((), device=tokens.device)
        for k in range(MICRO):
            sync = model.no_sync() if k < MICRO - 1 else contextlib.nullcontext()
            with sync, sdpa_kernel(SDPBackend.MATH):      # deterministic, as eager attention
                loss = model(input_ids=tokens[k], labels=tokens[k]).loss / MICRO
                loss.backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return total
    return step


def _batches(world):
    g = torch.Generator().manual_seed(7 + world.rank)
    return [torch.randint(0, VOCAB, (MICRO, BATCH, SEQ), generator=g).to(world.device) for _ in range(STEPS)]


def _train(world, strategy, compute, allocator, graphed: bool):
    model, optimizer = _wrap(world, strategy, compute, allocator)
    step = _step_fn(model, optimizer)
    runner = make_graphed_step(step, model, optimizer, warmup_steps=WARMUP) if graphed else step
    losses = []
    for index, tokens in enumerate(_batches(world)):
        if index == WARMUP + 1:
            model.reset_comm_stats()         # counted from the first pure replay on
        losses.append(float(runner(tokens)))
    weights = [p.full_tensor().cpu() if hasattr(p, "full_tensor") else p.detach().cpu()
               for p in model.parameters()]
    stats = model.comm_stats()
    captures = runner.captures if graphed else 0
    if graphed:
        runner.close()
    return losses, weights, stats, captures


@pytest.mark.parametrize("allocator", ["storage_freeing", "trace_pool"])
@pytest.mark.parametrize("compute", ["bf16", "fp32"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replayed_steps_equal_eager_steps_bitwise(world, strategy, compute, allocator):
    eager_losses, eager_weights, eager_stats, _ = _train(world, strategy, compute, allocator, graphed=False)
    losses, weights, stats, captures = _train(world, strategy, compute, allocator, graphed=True)
    assert captures == 1
    assert losses == eager_losses, [a - b for a, b in zip(losses, eager_losses)]
    assert eager_losses[-1] < eager_losses[0]
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights))
    assert stats == eager_stats


def test_a_float_lr_change_recaptures_and_stays_exact(world):
    """A Python-number lr changed between steps: the step runs eagerly once and is captured again,
    and training equals eager steps with the same schedule."""
    def run(graphed: bool):
        model, optimizer = _wrap(world, "optim_grads_params", "bf16", "storage_freeing")
        step = _step_fn(model, optimizer)
        runner = make_graphed_step(step, model, optimizer, warmup_steps=WARMUP) if graphed else step
        losses = []
        for index, tokens in enumerate(_batches(world)[:12]):
            if index == 8:
                optimizer.param_groups[0]["lr"] = 1e-3
            losses.append(float(runner(tokens)))
        return losses, (runner.captures if graphed else 0)
    eager, _ = run(False)
    with pytest.warns(UserWarning, match="hyperparameter held as a Python number changed"):
        graphed, captures = run(True)
    assert graphed == eager and captures == 2


def test_graph_reserves_no_more_than_eager(world):
    """Reserved memory of a replayed run <= the eager run's (the warm-up's cached blocks are given
    back before capture)."""
    reserved = []
    for graphed in (False, True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model, optimizer = _wrap(world, "optim_grads_params", "bf16", "storage_freeing")
        step = _step_fn(model, optimizer)
        runner = make_graphed_step(step, model, optimizer, warmup_steps=WARMUP) if graphed else step
        for tokens in _batches(world)[:8]:
            runner(tokens)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
        if graphed:
            runner.close()
        del model, optimizer, step, runner
    assert reserved[1] <= reserved[0], reserved


# ----------------------------------------------------------------------------- torchao float8
FLOAT8_RECIPES = ("tensorwise", "rowwise")


def _float8_train(world, strategy: str, recipe: str, graphed: bool) -> list:
    """The float8 functional test's model (3 blocks, a bf16 head), torchao's ``recipe`` (tensorwise:
    float8 all-gather and the scale precomputed inside the step), 12 steps; the losses."""
    torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed")
    from tests.unit.test_float8 import WIDTH, Block, Net

    torch.manual_seed(0)
    model = Net().to(world.device)
    if recipe == "tensorwise":
        config = torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    torchao_float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "head")
    model = fully_shard(model, sharding_strategy=strategy, unit_modules=[Block],
                        mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)

    def step(x, y):
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if recipe == "tensorwise":
            torchao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
        return loss.detach()
    runner = make_graphed_step(step, model, optimizer, warmup_steps=WARMUP) if graphed else step
    g = torch.Generator(device=world.device).manual_seed(world.rank)
    x = torch.randn(64, WIDTH, device=world.device, generator=g).bfloat16()
    y = torch.randn(64, 1, device=world.device, generator=g)
    losses = [float(runner(x, y)) for _ in range(12)]
    if graphed:
        assert runner.captures == 1
        runner.close()
    return losses


@pytest.mark.parametrize("recipe", FLOAT8_RECIPES)
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_float8_replayed_steps_equal_eager_steps_bitwise(world, strategy, recipe):
    if not world.is_cuda or torch.cuda.get_device_capability(world.device) < (8, 9):
        pytest.skip("real float8 matmuls need a GPU of compute capability 8.9 or above")
    eager = _float8_train(world, strategy, recipe, graphed=False)
    graphed = _float8_train(world, strategy, recipe, graphed=True)
    assert graphed == eager, [a - b for a, b in zip(graphed, eager)]
    assert eager[-1] < 0.7 * eager[0], eager
