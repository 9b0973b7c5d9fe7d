"""FullyShardedDataParallel with Megatron's mixture-of-experts and expert parallelism: CPU, gloo,
4 real ranks, a tiny MoE GPT (4 experts, top-2 router with the auxiliary load-balancing loss,
alltoall token dispatcher, local spec, SequentialMLP experts) trained next to Megatron DDP.

* EP2 x DP2 and EP2 x TP2, every strategy: 5 iterations of k=3 micro-batches through Megatron's
  schedule and ``finalize_model_grads``, Adam (wd 0.1, clip 1.0): losses, the auxiliary loss, grad
  norms and every weight of this rank (its experts, its tensor-parallel slice) equal Megatron DDP +
  Megatron's optimizer at the same layout within rtol/atol 1e-5 (Megatron's ``DistributedOptimizer``
  hard-codes CUDA off its FSDP path, so the reference steps ``FP32Optimizer``s: the same Adam on the
  same reduced gradients, chained dense + experts as Megatron builds them).
* Expert parameters are sharded over the expert-data-parallel group, dense ones over the
  data-parallel group: ``comm_stats()["experts"]`` carries the experts' collectives.
* A ``dist_checkpointing`` checkpoint saved at EP2 x DP2 loads at EP1 x DP4 bitwise (weights and
  Adam state, each global expert where the new layout puts it).
* The launcher accepts ``--num-experts`` / ``--expert-model-parallel-size``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

from tests.unit.test_megatron_model_parallel import (ADAM_EPS, CLIP, DATA_SEED, ITERS, LR, MBS,  # noqa: E402
                                                     MODEL_SEED, NMB, SEQ, STRATEGIES, TOL, VOCAB, WD)

EXPERTS = 4


def _moe_model(tp: int, ep: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.megatron_cpu import build_tiny_gpt

    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    return build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ, layer_spec=spec, num_moe_experts=EXPERTS,
                          moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                          moe_router_load_balancing_type="aux_loss", moe_ffn_hidden_size=48,
                          tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                          sequence_parallel=tp > 1, add_bias_linear=tp == 1)   # MoE biases need ETP 1


def _optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD, clip_grad=CLIP, adam_eps=ADAM_EPS, bf16=False,
                           fp16=False, params_dtype=torch.float32, use_distributed_optimizer=False)


def _aux_loss_tracker():
    """Megatron's per-layer auxiliary-loss values of the last iteration (then cleared)."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    values = {name: entry["values"].detach().clone() for name, entry in tracker.items() if "values" in entry}
    moe_utils.clear_aux_losses_tracker()
    return values


def _batches():
    from megatron.core import parallel_state as ps

    from tests.megatron_cpu import synthetic_batches

    return synthetic_batches(DATA_SEED + ps.get_data_parallel_rank(), ITERS * NMB, MBS, SEQ, VOCAB)


def _train_ours(strategy, tp, ep, batches, iters=ITERS):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from testing.megatron_gpt import megatron_train_step
    from tests.megatron_cpu import _reduce_lm_loss, constant_param_scheduler

    model, config = _moe_model(tp, ep)
    wrapped = FullyShardedDataParallel(config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy),
                                       model)
    optimizer = get_optimizer(_optimizer_config(), [wrapped])
    constant_param_scheduler(optimizer, LR, WD)
    config.finalize_model_grads_func = finalize_model_grads
    losses, norms, aux = [], [], []
    _aux_loss_tracker()
    wrapped.reset_comm_stats()
    for it in range(iters):
        store, ok, norm = megatron_train_step(wrapped, optimizer, batches[it * NMB:(it + 1) * NMB], SEQ, MBS)
        assert ok
        losses.append(_reduce_lm_loss(store, ps.get_data_parallel_group())[0])
        norms.append(float(norm))
        aux.append(_aux_loss_tracker())
    config.finalize_model_grads_func = None
    return losses, norms, aux, wrapped.state_dict(), wrapped.comm_stats(), wrapped, optimizer


def _reference(tp, ep, batches):
    """Megatron DDP + FP32Optimizer at the same layout, recording the auxiliary loss per iteration."""
    from tests import megatron_cpu

    model, config = _moe_model(tp, ep)
    aux = []
    original = megatron_cpu.train_reference
    _aux_loss_tracker()
    ref = original(model, config, batches, NMB, ITERS, LR, optimizer="megatron_adam", clip_grad=CLIP,
                   weight_decay=WD, adam_eps=ADAM_EPS, seq_length=SEQ, after_step=lambda: aux.append(_aux_loss_tracker()))
    return ref.losses, ref.grad_norms, aux, ref.state_dict


def parity_worker(rank, world, tp, ep, strategies):
    import contextlib

    from tests.megatron_cpu import init_megatron_parallel_state, patch_megatron_for_cpu, sequence_parallel_torch_norms

    norms = sequence_parallel_torch_norms() if tp > 1 else contextlib.nullcontext()
    with patch_megatron_for_cpu("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers"), norms:
        init_megatron_parallel_state(world, tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        batches = _batches()
        out = {"megatron_ddp": _reference(tp, ep, batches)}
        for strategy in strategies:
            losses, grad_norms, aux, weights, stats, _, _ = _train_ours(strategy, tp, ep, batches)
            out[strategy] = (losses, grad_norms, aux, weights, stats)
        return out


def _assert_parity(results, what):
    for rank, out in enumerate(results):
        losses, norms, aux, weights = out.pop("megatron_ddp")
        assert losses[-1] < losses[0] * 0.97, (what, rank, losses)      # the curves compared really move
        assert aux and all(aux) and float(aux[0]["load_balancing_loss"].sum()) > 0, (what, rank, aux)
        for strategy, (got_losses, got_norms, got_aux, got_weights, stats) in out.items():
            where = (what, rank, strategy)
            assert got_losses == pytest.approx(losses, rel=TOL, abs=TOL), where
            assert got_norms == pytest.approx(norms, rel=TOL, abs=TOL), where
            for want_it, got_it in zip(aux, got_aux):
                for name, value in want_it.items():
                    torch.testing.assert_close(got_it[name], value, rtol=TOL, atol=TOL, msg=f"{where} aux {name}")
            assert sorted(got_weights) == sorted(weights), where
            for name, want in weights.items():
                torch.testing.assert_close(got_weights[name], want, rtol=TOL, atol=TOL, msg=f"{where} {name}")
            # experts are reduced over their own group: their collectives are counted there
            moved = stats["experts"]["reduce_scatter" if strategy != "no_shard" else "all_reduce"]
            assert moved["count"] > 0 and moved["bytes"] > 0, (where, stats["experts"])


def test_expert_parallel_ep2_dp2_matches_megatron_ddp():
    results = run_distributed(parity_worker, 4, 1, 2, STRATEGIES, timeout=900)
    _assert_parity(results, "EP2xDP2")
    # expert-parallel peers (ranks 0 and 1) hold different experts after training
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert not torch.equal(results[0]["no_shard"][3][name], results[1]["no_shard"][3][name])


def test_expert_parallel_ep2_tp2_matches_megatron_ddp():
    results = run_distributed(parity_worker, 4, 2, 2, STRATEGIES, timeout=900)
    _assert_parity(results, "EP2xTP2")


# ---------------------------------------------------------------- checkpoints
def checkpoint_worker(rank, world, root, ep, strategy, save):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import (FullyShardedDataParallel, get_optimizer, load_dist_checkpoint,
                                           save_dist_checkpoint)
    from tests.megatron_cpu import constant_param_scheduler, init_megatron_parallel_state, patch_megatron_for_cpu
    from tests.state_gather import full_optimizer_state

    with patch_megatron_for_cpu("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers"):
        init_megatron_parallel_state(world, expert_model_parallel_size=ep)
        if save:
            _, _, _, _, _, wrapped, optimizer = _train_ours(strategy, 1, ep, _batches(), iters=2)
            save_dist_checkpoint(f"{root}/saved", wrapped, optimizer)
        else:
            model, config = _moe_model(1, ep)
            with torch.no_grad():           # other weights than the saved ones: all must come from the file
                for p in model.parameters():
                    p.add_(1.0)
            wrapped = FullyShardedDataParallel(
                config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy), model)
            optimizer = get_optimizer(_optimizer_config(), [wrapped])
            constant_param_scheduler(optimizer, LR, WD)
            load_dist_checkpoint(f"{root}/saved", wrapped, optimizer)
        expert_names, _ = wrapped.expert_checkpoint_replicas()
        state = full_optimizer_state(wrapped, optimizer, wrapped.dp_group,
                                     group_of=lambda key: wrapped.expt_dp_group
                                     if key[len("state."):].rsplit(".", 1)[0] in expert_names else None)
        return ps.get_expert_model_parallel_rank(), wrapped.state_dict(), state


def _global_expert_name(name: str, ep_rank: int, local_count: int) -> str:
    """A local expert's name under its global index (``local_experts.<i>`` of expert-parallel rank r
    is global expert r * local_count + i)."""
    marker = ".local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    index, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * local_count + int(index)}.{rest}"


@pytest.mark.parametrize("save_strategy,load_strategy", [("optim_grads_params", "optim"), ("no_shard", "optim_grads")])
def test_checkpoint_saved_at_ep2_dp2_loads_at_ep1_dp4(tmp_path, save_strategy, load_strategy):
    """ZeRO-3 at EP2 x DP2 into ZeRO-1 at EP1 x DP4, and no_shard (replicated experts: written by
    expert-data-parallel rank 0 of each expert) into ZeRO-2 (other strategy pairs:
    test_megatron_checkpoint.py)."""
    saved = run_distributed(checkpoint_worker, 4, str(tmp_path), 2, save_strategy, True, timeout=900)
    loaded = run_distributed(checkpoint_worker, 4, str(tmp_path), 1, load_strategy, False, timeout=900)
    want_weights, want_state = {}, {}
    for ep_rank, weights, state in saved:
        for name, value in weights.items():
            want_weights[_global_expert_name(name, ep_rank, EXPERTS // 2)] = value
        for key, value in state.items():
            want_state[_global_expert_name(key, ep_rank, EXPERTS // 2)] = value
    for rank, (_, weights, state) in enumerate(loaded):
        assert sorted(weights) == sorted(want_weights), rank
        for name, value in weights.items():
            assert torch.equal(value, want_weights[name]), (rank, name)
        assert sorted(state) == sorted(want_state), rank
        for key, value in state.items():
            assert torch.equal(value, want_state[key]), (rank, key)


# ---------------------------------------------------------------- launcher
def launcher_worker(rank, world, flags):
    from tests.megatron_cpu import wrap_through_the_launcher

    args, chunk = wrap_through_the_launcher(
        world, flags, lambda a: dict(expert_model_parallel_size=a.expert_model_parallel_size),
        lambda a: _moe_model(1, a.expert_model_parallel_size))
    return args.num_experts, args.expert_model_parallel_size, chunk.dp_group.size(), chunk.expt_dp_group.size()


def test_launcher_accepts_expert_parallel_flags():
    flags = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    for parsed in run_distributed(launcher_worker, 4, flags, timeout=900):
        assert parsed == (4, 2, 4, 2)
