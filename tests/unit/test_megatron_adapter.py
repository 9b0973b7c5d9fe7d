"""megatron_fsdp_v2.megatron on a tiny Megatron-Core GPTModel: CPU, gloo, 2 and 4 real ranks.

Every strategy trains 5 iterations of k=2 micro-batches through Megatron's own
``get_forward_backward_func()`` schedule and ``finalize_model_grads`` and must match the same model
under Megatron's own ``DistributedDataParallel`` (fp32; every tensor elementwise within rtol 1e-5,
atol 1e-6, and norm-wise within 1e-5; losses and grad norms within rtol 1e-5):

* a plain loop: ``torch.optim.SGD`` on ``wrapper.parameters()`` (``overlap_grad_reduce=True``, so
  the schedule runs the first micro-batch inside ``wrapper.no_sync()``);
* Megatron's optimizer through ``get_optimizer`` (Adam: ``DistributedOptimizer`` on its
  ``use_megatron_fsdp`` path) with grad clipping and weight decay, against Megatron DDP +
  ``FP32Optimizer`` (``overlap_grad_reduce=False``: reduce in ``finish_grad_sync``). Grad norms
  must match too (no sqrt(dp) inflation for replicated grads).

Summation order differs (reduce-scatter vs all-reduce over 4 ranks, shard-wise grad norms), so
results agree to fp32 rounding, not bitwise. Adam uses ``adam_eps=1e-6``: with the default 1e-8
it turns rounding noise into lr-sized steps on elements whose true gradient is exactly zero (the
key part of the QKV bias: softmax is shift-invariant), which would test fp32 noise, not the wrapper.

2 ranks add: the SGD path of ``get_optimizer`` (``FP32Optimizer``: clipping changes the update
linearly), plain ``get_megatron_optimizer`` with ``with_original_shapes`` overrides, the weight
decay decision by original shape (and the 1-D-shard pitfall it avoids), ``calculate_per_token_loss``
(``scale_gradients``), the remaining DDP members (``broadcast_params``, ...), checkpoint round
trip, bf16/fp16 dtypes and a bf16 step, construction errors, and the ``pretrain_gpt`` launcher's
argument mapping.

Everything of one world size runs inside one spawned job (Megatron's import costs seconds per
process); Megatron's CUDA-only spots are patched by ``patch_megatron_for_cpu()`` inside the
workers only.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:  # find_spec: no 6 s import in the parent
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ITERS, NMB, MBS, SEQ, VOCAB = 5, 2, 2, 16, 64
MODEL_SEED, DATA_SEED = 1234, 100
LR_SGD, LR_ADAM, CLIP, WD, ADAM_EPS = 0.5, 1e-2, 0.3, 0.1, 1e-6
RTOL, ATOL = 1e-5, 1e-6

LAUNCHER_ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "5", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
    "--transformer-impl", "local",
]


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


def _build(strategy, overlap_grad_reduce=False, config_overrides=None, **ddp_kwargs):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel
    from tests.megatron_cpu import build_tiny_gpt

    model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ, **(config_overrides or {}))
    ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy,
                                               overlap_grad_reduce=overlap_grad_reduce, **ddp_kwargs)
    return FullyShardedDataParallel(config, ddp_config, model), config


def _opt_config(name, lr, **kwargs):
    from megatron.core.optimizer import OptimizerConfig

    base = dict(optimizer=name, lr=lr, weight_decay=WD, clip_grad=CLIP, adam_eps=ADAM_EPS, bf16=False, fp16=False,
                params_dtype=torch.float32, sgd_momentum=0.0, use_distributed_optimizer=False)
    base.update(kwargs)
    return OptimizerConfig(**base)


def _train(wrapped, config, batches, optimizer, megatron_optimizer):
    """train_reference's loop on our wrapper: zero_grad_buffer, schedule, (Megatron) step."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.megatron_cpu import _reduce_lm_loss, forward_step_func

    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    losses, grad_norms = [], []
    for it in range(ITERS):
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        store = forward_backward(forward_step_func=forward_step_func,
                                 data_iterator=iter(batches[it * NMB:(it + 1) * NMB]), model=[wrapped],
                                 num_microbatches=NMB, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        losses.append(_reduce_lm_loss(store, ps.get_data_parallel_group())[0])
        if megatron_optimizer:
            ok, grad_norm, _ = optimizer.step()
            assert ok
            grad_norms.append(float(grad_norm))
        else:
            optimizer.step()
    config.no_sync_func = config.finalize_model_grads_func = None
    comm = wrapped.comm_stats()  # before state_dict(), which all-gathers the shards
    return dict(losses=losses, grad_norms=grad_norms, comm=comm, state=wrapped.state_dict())


def _wd_mults(wrapped, optimizer):
    """{name: wd_mult} from the optimizer's param groups, and the expected value by original shape."""
    from megatron_fsdp_v2.megatron import ORIGINAL_SHAPE_ATTR

    mult_of = {id(p): g["wd_mult"] for g in optimizer.param_groups for p in g["params"]}
    got, want = {}, {}
    for name, param in wrapped.named_parameters():
        got[name] = mult_of[id(param)]
        shape = getattr(param, ORIGINAL_SHAPE_ATTR)
        want[name] = 0.0 if (len(shape) == 1 or name.endswith(".bias")) else 1.0
    return got, want


def _megatron_optimizer_run(strategy, batches, name, lr, *, use_helper=True):
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

    from megatron_fsdp_v2.megatron import get_optimizer, with_original_shapes
    from tests.megatron_cpu import constant_param_scheduler

    wrapped, config = _build(strategy, overlap_grad_reduce=False)
    if use_helper:
        optimizer = get_optimizer(_opt_config(name, lr), [wrapped])
    else:  # Megatron's own entry point, FSDP path (what --use-megatron-fsdp forces)
        cfg = _opt_config(name, lr, use_distributed_optimizer=True)
        optimizer = get_megatron_optimizer(
            cfg, [wrapped], config_overrides=with_original_shapes(get_standard_config_overrides(cfg)))
    constant_param_scheduler(optimizer, lr, WD)
    wd = _wd_mults(wrapped, optimizer)
    result = _train(wrapped, config, batches, optimizer, megatron_optimizer=True)
    result.update(wd=wd, optimizer_class=type(optimizer).__name__,
                  main_param_dims=sorted({p.dim() for p in wrapped.parameters()}))
    return result


def _plain_sgd_run(strategy, batches, config_overrides=None):
    wrapped, config = _build(strategy, overlap_grad_reduce=True, config_overrides=config_overrides)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR_SGD)
    wrapped.reset_comm_stats()
    return _train(wrapped, config, batches, optimizer, megatron_optimizer=False)


def _expect_error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return f"{type(exc).__name__}: {exc}"
    return None


def _member_checks(rank):
    """The rest of the DDP surface training.py / the optimizer call, on no_shard and ZeRO-3."""
    from megatron.core.utils import get_model_config

    out = {}
    wrapped, config = _build("no_shard")
    initial = wrapped.state_dict()
    if rank == 1:  # ranks disagree (think --data-parallel-random-init) until broadcast_params
        with torch.no_grad():
            for param in wrapped.parameters():
                param.add_(1.0)
    wrapped.broadcast_params()
    out["broadcast"] = max((wrapped.state_dict()[k] - initial[k]).abs().max().item() for k in initial)
    out["config"] = get_model_config(wrapped) is config
    # as torch lists a wrapper's parameters: none of its own, its module's under "module."
    out["parameter_lists"] = (len(list(wrapped.parameters(recurse=False))),
                              [n for n, _ in wrapped.named_parameters(remove_duplicate=False)]
                              == ["module." + n for n, _ in wrapped.module.named_parameters(remove_duplicate=False)])
    for strategy in ("no_shard", "optim_grads_params"):
        wrapped, _ = _build(strategy)
        wrapped.start_grad_sync()
        wrapped.finish_grad_sync(force_all_reduce=True)
        wrapped.scale_gradients(0.5)
        wrapped.stop_communication()
        wrapped.synchronize_param_gather()
        wrapped.start_param_sync(force_sync=True)
        wrapped.disable_forward_pre_hook()
        wrapped.enable_forward_pre_hook()
        wrapped.free_overlap_buffers()
        out[strategy] = (wrapped.buffers, wrapped.bucket_groups, wrapped.ddp_config.use_megatron_fsdp,
                         hasattr(wrapped.param_and_grad_buffer, "copy_main_weights_to_model_weights"))
    return out


def _error_cases(world_size):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from tests.megatron_cpu import build_tiny_gpt

    out = {}
    out["unknown_strategy"] = _expect_error(lambda: _build("zero4"))
    out["grad_accum_fusion"] = _expect_error(
        lambda: _build("optim", config_overrides=dict(gradient_accumulation_fusion=True)))
    out["fp8_param_gather"] = _expect_error(lambda: _build("optim_grads_params", fp8_param_gather=True))
    out["outer_sharding"] = _expect_error(lambda: _build("no_shard", num_distributed_optimizer_instances=2,
                                                         outer_dp_sharding_strategy="optim"))

    tp_group = dist.new_group(list(range(world_size)))   # a real 2-rank "tensor-parallel" group
    own_group = [dist.new_group([r]) for r in range(world_size)][dist.get_rank()]

    def tensor_parallel_peers_of_other_shapes():
        pgs = ProcessGroupCollection()
        pgs.dp, pgs.tp = own_group, tp_group
        model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB + 8 * dist.get_rank(), seq=SEQ)
        FullyShardedDataParallel(config, DistributedDataParallelConfig(data_parallel_sharding_strategy="optim"),
                                 model, pg_collection=pgs)

    out["tp_peer_shapes"] = _expect_error(tensor_parallel_peers_of_other_shapes)
    from megatron_fsdp_v2.megatron.adapter import _unsupported_settings
    from testing.megatron_gpt import tiny_cpu_config

    expert_config = tiny_cpu_config(2, 32, 4, num_moe_experts=4, expert_model_parallel_size=2)
    out["expert_parallel"] = _unsupported_settings(expert_config, DistributedDataParallelConfig(), None, {})
    expert_tp_config = tiny_cpu_config(2, 32, 4, num_moe_experts=4, expert_tensor_parallel_size=2, add_bias_linear=False)
    out["expert_tensor_parallel"] = _unsupported_settings(expert_tp_config, DistributedDataParallelConfig(), None, {})
    model_parallel = tiny_cpu_config(2, 32, 4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                     context_parallel_size=2, sequence_parallel=True)
    out["model_parallel"] = _unsupported_settings(model_parallel, DistributedDataParallelConfig(), None, {})
    wrapped, _ = _build("optim")
    out["sgd_fp16"] = _expect_error(lambda: get_optimizer(_opt_config("sgd", LR_SGD, fp16=True), [wrapped]))
    return out


def _launcher_checks(world_size):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.utils import unwrap_model
    from megatron.training import training

    from examples import pretrain_gpt
    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from tests.megatron_cpu import build_tiny_gpt

    out = {"mapped": {}}
    original_wrap, original_get_optimizer = training.wrap_model_chunks_with_ddp, training.get_megatron_optimizer
    for strategy in STRATEGIES:
        args = pretrain_gpt.parse_args(LAUNCHER_ARGS + ["--data-parallel-sharding-strategy", strategy])
        ddp_config = training.get_megatron_ddp_config(args)
        model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ)
        with pretrain_gpt.use_fully_sharded_data_parallel():
            hooked = (training.get_megatron_optimizer is get_optimizer,
                      training.wrap_model_chunks_with_ddp is not original_wrap)
            # exactly get_model's call (training.py): DP=DDP, no pg_collection without --use-megatron-fsdp
            (chunk,) = training.wrap_model_chunks_with_ddp([model], config, ddp_config, DP=training.DDP,
                                                          pg_collection=None, bucket_sizes=[None],
                                                          disable_bucketing_per_chunk=[False])
        out["mapped"][strategy] = (
            type(chunk) is FullyShardedDataParallel,
            isinstance(chunk, DistributedDataParallel) and unwrap_model(chunk) is model,
            chunk.strategy.name,
            pretrain_gpt.data_parallel_class(args) is FullyShardedDataParallel,
            hooked,
        )
    out["restored"] = (training.wrap_model_chunks_with_ddp is original_wrap
                       and training.get_megatron_optimizer is original_get_optimizer)
    out["default_strategy"] = pretrain_gpt.parse_args(LAUNCHER_ARGS).data_parallel_sharding_strategy
    out["no_grad_accum_fusion"] = pretrain_gpt.parse_args(LAUNCHER_ARGS).gradient_accumulation_fusion is False
    out["use_torch_fsdp2"] = _expect_error(lambda: pretrain_gpt.parse_args(LAUNCHER_ARGS + ["--use-torch-fsdp2"]))
    return out


def _two_rank_extras(rank, world_size, batches, out):
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    from megatron_fsdp_v2.megatron import get_optimizer
    from tests.megatron_cpu import build_tiny_gpt, train_reference

    # get_optimizer's SGD path (FP32Optimizer): clipping scales the update linearly.
    model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ)
    out["ref_msgd"] = train_reference(model, config, batches, NMB, ITERS, LR_SGD, optimizer="megatron_sgd",
                                      clip_grad=CLIP, weight_decay=WD)._asdict()
    for strategy in ("no_shard", "optim_grads"):
        out[("msgd", strategy)] = _megatron_optimizer_run(strategy, batches, "sgd", LR_SGD)
    # calculate_per_token_loss: Megatron DDP sums over DP, finalize_model_grads scales by 1/tokens.
    model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ, calculate_per_token_loss=True)
    out["ref_per_token"] = train_reference(model, config, batches, NMB, ITERS, LR_SGD)._asdict()
    for strategy in ("no_shard", "optim_grads_params"):
        out[("per_token", strategy)] = _plain_sgd_run(strategy, batches, dict(calculate_per_token_loss=True))
    # Megatron's get_megatron_optimizer directly (DistributedOptimizer, use_megatron_fsdp path).
    for strategy in ("no_shard", "optim_grads_params"):
        out[("direct_adam", strategy)] = _megatron_optimizer_run(strategy, batches, "adam", LR_ADAM,
                                                                 use_helper=False)
    # The pitfall with_original_shapes avoids: standard overrides on 1-D shards skip weight decay
    # for every matrix.
    wrapped, _ = _build("optim")
    cfg = _opt_config("adam", LR_ADAM)
    groups = _get_param_groups([wrapped], cfg, get_standard_config_overrides(cfg))
    name_of = {id(p): n for n, p in wrapped.named_parameters()}
    out["untranslated_wd"] = {name_of[id(p)]: g["wd_mult"] for g in groups for p in g["params"]}
    # Checkpoint round trip: state_dict() of a trained ZeRO-3 model loads into a fresh one.
    trained = out[("plain_sgd", "optim_grads_params")]["state"]
    fresh, _ = _build("optim_grads_params")
    fresh.load_state_dict(trained)
    out["reloaded"] = fresh.state_dict()
    # bf16 / fp16 compute weights, fp32 main weights and grads; grad comm dtype.
    dtypes = {}
    for flag, reduce_fp32 in (("bf16", False), ("bf16", True), ("fp16", False)):
        wrapped, _ = _build("optim_grads", config_overrides={flag: True}, grad_reduce_in_fp32=reduce_fp32)
        g = wrapped.module._fsdp_engine.groups[0].dtypes
        dtypes[(flag, reduce_fp32)] = (g.compute, g.main, g.grad, g.grad_comm,
                                       {p.dtype for p in wrapped.parameters()})
    out["dtypes"] = dtypes
    # bf16 smoke: ZeRO-3 training steps through Megatron's optimizer, finite loss, moved weights.
    wrapped, config = _build("optim_grads_params", config_overrides={"bf16": True})
    before = wrapped.state_dict()
    optimizer = get_optimizer(_opt_config("adam", LR_ADAM, bf16=True), [wrapped])
    smoke = _train(wrapped, config, batches, optimizer, megatron_optimizer=True)
    out["bf16_smoke"] = (smoke["losses"], smoke["grad_norms"],
                         max((smoke["state"][k] - before[k]).abs().max().item() for k in before))
    out["members"] = _member_checks(rank)
    out["errors"] = _error_cases(world_size)
    out["launcher"] = _launcher_checks(world_size)


def suite_worker(rank, world_size, extended):
    from tests.megatron_cpu import (
        build_tiny_gpt,
        destroy_megatron_parallel_state,
        init_megatron_parallel_state,
        patch_megatron_for_cpu,
        synthetic_batches,
        train_reference,
    )

    out = {}
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            batches = synthetic_batches(DATA_SEED + rank, ITERS * NMB, MBS, SEQ, VOCAB)
            model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ)
            out["ref_sgd"] = train_reference(model, config, batches, NMB, ITERS, LR_SGD)._asdict()
            model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ)
            out["ref_adam"] = train_reference(model, config, batches, NMB, ITERS, LR_ADAM,
                                              optimizer="megatron_adam", clip_grad=CLIP, weight_decay=WD,
                                              adam_eps=ADAM_EPS)._asdict()
            for strategy in STRATEGIES:
                out[("plain_sgd", strategy)] = _plain_sgd_run(strategy, batches)
                out[("adam", strategy)] = _megatron_optimizer_run(strategy, batches, "adam", LR_ADAM)
            if extended:
                _two_rank_extras(rank, world_size, batches, out)
        finally:
            destroy_megatron_parallel_state()
    return out


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(suite_worker, 2, True, timeout=240)


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(suite_worker, 4, False, timeout=240)


def _assert_states_close(got, want, what):
    """Per tensor: elementwise ``rtol=1e-5, atol=1e-6`` and norm-wise ``|got-want| <= 1e-5 |want|``."""
    assert sorted(got) == sorted(want), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {key}: {m}")
        error = (got[key] - want[key]).norm().item()
        assert error <= RTOL * want[key].norm().item(), (what, key, error)


def _assert_close_lists(got, want, what):
    assert len(got) == len(want) == ITERS, what
    for a, b in zip(got, want):
        assert math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL), (what, got, want)


def _check_parity(results, strategy):
    for rank, out in enumerate(results):
        ref_sgd, ref_adam = out["ref_sgd"], out["ref_adam"]
        plain = out[("plain_sgd", strategy)]
        _assert_states_close(plain["state"], ref_sgd["state_dict"], f"plain SGD {strategy} rank {rank}")
        _assert_close_lists(plain["losses"], ref_sgd["losses"], f"plain SGD losses {strategy}")
        adam = out[("adam", strategy)]
        _assert_states_close(adam["state"], ref_adam["state_dict"], f"get_optimizer adam {strategy} rank {rank}")
        _assert_close_lists(adam["losses"], ref_adam["losses"], f"adam losses {strategy}")
        _assert_close_lists(adam["grad_norms"], ref_adam["grad_norms"], f"adam grad norms {strategy}")
        assert adam["optimizer_class"] == "DistributedOptimizer"
        got_wd, want_wd = adam["wd"]
        assert got_wd == want_wd, (strategy, got_wd, want_wd)
    # clipping was active in every step, training made progress, ranks agree
    assert all(g > CLIP for g in results[0]["ref_adam"]["grad_norms"])
    losses = results[0][("adam", strategy)]["losses"]
    assert losses[-1] < losses[0], losses
    for out in results[1:]:
        _assert_states_close(out[("adam", strategy)]["state"], results[0][("adam", strategy)]["state"], "ranks")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_megatron_ddp_two_ranks(two_ranks, strategy):
    _check_parity(two_ranks, strategy)
    adam = two_ranks[0][("adam", strategy)]
    assert adam["main_param_dims"] == [1, 2]      # every strategy: pieces keep their dimensions (whole rows)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_megatron_ddp_four_ranks(four_ranks, strategy):
    _check_parity(four_ranks, strategy)


def test_comm_follows_the_strategy(two_ranks):
    """Bytes of each collective over the plain loop's 5 steps of k=2 micro-batches, in units of
    one pass over every parameter group (psi): the strategy table under Megatron's schedule."""
    comm = {s: two_ranks[0][("plain_sgd", s)]["comm"] for s in STRATEGIES}
    psi = comm["optim"]["reduce_scatter"]["bytes"] / ITERS       # ZeRO-1: one reduce-scatter per step

    # ZeRO-3 pads each parameter to dp torch.chunk pieces (group/layout.py, [Note: per-parameter shards]),
    # the others one row-snapped buffer: its psi is its own, within a fraction of a percent
    psi3 = comm["optim_grads_params"]["reduce_scatter"]["bytes"] / (ITERS * NMB)
    assert abs(psi3 - psi) / psi < 0.01, (psi3, psi)

    def moved(strategy, unit=psi):
        return {name: comm[strategy][name]["bytes"] / (ITERS * unit)
                for name in ("all_reduce", "reduce_scatter", "all_gather")}

    psi_unsharded = comm["no_shard"]["all_reduce"]["bytes"] / ITERS      # no_shard: the unpadded buffer
    assert moved("no_shard", psi_unsharded) == {"all_reduce": 1, "reduce_scatter": 0, "all_gather": 0}
    # the two layouts (row-snapped for no_shard, torch.chunk pieces for the others) pad differently, < 1% here
    assert abs(psi - psi_unsharded) < 0.01 * psi_unsharded
    assert moved("optim") == {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 1}
    assert moved("optim_grads") == {"all_reduce": 0, "reduce_scatter": NMB, "all_gather": 1}
    assert moved("optim_grads_params", psi3) == {"all_reduce": 0, "reduce_scatter": NMB, "all_gather": 2 * NMB}


def test_sgd_path_clips_and_decays_like_megatron(two_ranks):
    for out in two_ranks:
        ref = out["ref_msgd"]
        assert all(g > CLIP for g in ref["grad_norms"])
        for strategy in ("no_shard", "optim_grads"):
            run = out[("msgd", strategy)]
            assert run["optimizer_class"] == "FP32Optimizer"
            _assert_states_close(run["state"], ref["state_dict"], f"get_optimizer sgd {strategy}")
            _assert_close_lists(run["grad_norms"], ref["grad_norms"], f"sgd grad norms {strategy}")
            assert run["wd"][0] == run["wd"][1]


def test_per_token_loss_scaling(two_ranks):
    """finalize_model_grads(num_tokens) -> scale_gradients: same result as Megatron DDP's DP sum."""
    for out in two_ranks:
        for strategy in ("no_shard", "optim_grads_params"):
            run = out[("per_token", strategy)]
            _assert_states_close(run["state"], out["ref_per_token"]["state_dict"], f"per-token {strategy}")


def test_get_megatron_optimizer_directly(two_ranks):
    for out in two_ranks:
        for strategy in ("no_shard", "optim_grads_params"):
            run = out[("direct_adam", strategy)]
            assert run["optimizer_class"] == "DistributedOptimizer"
            _assert_states_close(run["state"], out["ref_adam"]["state_dict"], f"direct adam {strategy}")
            _assert_close_lists(run["grad_norms"], out["ref_adam"]["grad_norms"], f"direct grad norms {strategy}")


def test_weight_decay_follows_original_shapes(two_ranks):
    got, want = two_ranks[0][("adam", "optim")]["wd"]
    assert got == want
    matrices = [n for n, m in want.items() if m == 1.0]
    assert "module.decoder.layers.0.mlp.linear_fc1.weight" in matrices
    assert "module.embedding.word_embeddings.weight" in matrices
    assert "module.decoder.final_layernorm.weight" not in matrices
    # Pieces keep their dimensions (whole rows): Megatron's standard overrides alone decide as on
    # the whole parameters (on the former 1-D shards no matrix decayed).
    untranslated = two_ranks[0]["untranslated_wd"]
    assert untranslated == want


def test_state_dict_round_trip(two_ranks):
    trained = two_ranks[0][("plain_sgd", "optim_grads_params")]["state"]
    _assert_states_close(two_ranks[0]["reloaded"], trained, "reloaded")
    assert all(not k.startswith("module.") for k in trained)


def test_mixed_precision_from_config(two_ranks):
    dtypes = two_ranks[0]["dtypes"]
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert dtypes[("bf16", False)] == (bf16, fp32, fp32, bf16, {fp32})
    assert dtypes[("bf16", True)] == (bf16, fp32, fp32, fp32, {fp32})
    assert dtypes[("fp16", False)] == (fp16, fp32, fp32, fp16, {fp32})
    losses, grad_norms, moved = two_ranks[0]["bf16_smoke"]
    assert all(math.isfinite(x) for x in losses + grad_norms) and moved > 0


def test_remaining_ddp_members(two_ranks):
    for out in two_ranks:
        members = out["members"]
        assert members["broadcast"] == 0.0 and members["config"]
        assert members["parameter_lists"] == (0, True)
        for strategy in ("no_shard", "optim_grads_params"):
            assert members[strategy] == ([], [], True, True)


def test_errors_name_the_setting(two_ranks):
    errors = two_ranks[0]["errors"]
    assert errors["unknown_strategy"].startswith("ValueError")
    assert "data_parallel_sharding_strategy" in errors["unknown_strategy"]
    for name in STRATEGIES:
        assert repr(name) in errors["unknown_strategy"]
    assert "'zero4'" in errors["unknown_strategy"]
    assert errors["tp_peer_shapes"].startswith("ValueError: module: tensor-parallel peers hold parameters of "
                                               "different shapes")
    assert "embedding.word_embeddings.weight" in errors["tp_peer_shapes"]
    assert errors["expert_parallel"] == []       # expert parallelism is accepted (tests/unit/test_megatron_moe.py)
    assert errors["expert_tensor_parallel"] == [
        "expert_tensor_parallel_size=2 (--expert-tensor-parallel-size) with tensor_model_parallel_size=1: expert "
        "parameters are sharded over Megatron's expert-data-parallel group, which must lie inside the data-parallel "
        "group; use the same size (Megatron's default)"]
    assert errors["model_parallel"] == []        # TP, PP, CP and sequence parallel are accepted
    assert "gradient_accumulation_fusion" in errors["grad_accum_fusion"]
    assert "fp8_param_gather" in errors["fp8_param_gather"]
    if importlib.util.find_spec("transformer_engine") is None:     # with TE the flag is honoured
        assert "--fp8-param-gather" in errors["fp8_param_gather"]
        assert "Transformer Engine is not installed" in errors["fp8_param_gather"], errors["fp8_param_gather"]
    assert "outer_dp_sharding_strategy='optim'" in errors["outer_sharding"]
    assert "fp16" in errors["sgd_fp16"] and errors["sgd_fp16"].startswith("ValueError")
    assert errors == two_ranks[1]["errors"]


def test_launcher_maps_strategy_flag_to_our_class(two_ranks):
    launcher = two_ranks[0]["launcher"]
    for strategy in STRATEGIES:
        assert launcher["mapped"][strategy] == (True, True, strategy, True, (True, True)), strategy
    assert launcher["restored"]
    assert launcher["default_strategy"] == "optim_grads_params"    # Megatron's parser default
    assert launcher["no_grad_accum_fusion"]
    # --use-megatron-fsdp selects this package: tests/unit/test_megatron_fsdp_command_line.py
    assert "--use-torch-fsdp2" in launcher["use_torch_fsdp2"]


def test_lower_precision_main_grads_are_rejected_naming_the_setting():
    import types

    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron.adapter import _mixed_precision
    from megatron_fsdp_v2.megatron.settings import check_ddp_config

    config = types.SimpleNamespace(bf16=True, fp16=False)
    ddp_config = DistributedDataParallelConfig(megatron_fsdp_main_grads_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"megatron_fsdp_main_grads_dtype=torch.bfloat16 "
                                         r"\(--megatron-fsdp-main-grads-dtype\): it must equal "
                                         r"megatron_fsdp_main_params_dtype \(torch.float32\)"):
        check_ddp_config(ddp_config, config)
    policy = _mixed_precision(config, DistributedDataParallelConfig(grad_reduce_in_fp32=False))
    assert (policy.param_dtype, policy.main_grads_dtype, policy.grad_comm_dtype) == \
        (torch.bfloat16, torch.float32, torch.bfloat16)
    policy = _mixed_precision(config, DistributedDataParallelConfig(megatron_fsdp_main_params_dtype=None))
    assert (policy.main_params_dtype, policy.main_grads_dtype) == (torch.bfloat16, torch.bfloat16)
