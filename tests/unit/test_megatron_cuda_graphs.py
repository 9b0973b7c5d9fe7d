"""Megatron's full-iteration CUDA graph (``--cuda-graph-impl full_iteration``) with our wrapper, on
CPU, where no CUDA graph exists (adapter.py, [Note: Megatron's full-iteration CUDA graph]).

In the parent: the settings accept ``full_iteration`` for every strategy with what Megatron-LM's
``get_megatron_ddp_config`` adds to it (``megatron_fsdp_cuda_graph_mode=True``,
``fsdp_all_gather_in_start_param_sync=False``) and say nothing; they refuse, naming the flag, what was
got and what is allowed, Megatron's per-layer graphs (``local``, ``transformer_engine``),
``check_for_nan_in_grad``, CPU offload and ``--optimizer-cuda-graph``.

On 2 gloo ranks, a tiny ``GPTModel`` for 3 iterations of 2 micro-batches, each strategy through
Megatron's ``FullCudaGraphWrapper`` left in its eager warm-up (``cuda_graph_warmup_steps`` above the
iterations run, so it never captures) and Megatron's ``DistributedOptimizer`` (Adam, clipping,
weight decay):

* the wrapper is built capture-safe, and trains bitwise like the same run without the graph;
* it trains like Megatron DDP under the same wrapper (fp32 rounding: rtol 1e-5);
* no weight all-gather is in flight when ``optimizer.step()`` returns (without the graph ZeRO-1/2
  leave it to overlap the next forward), and every main parameter keeps its ``.grad`` tensor (the
  one a replay writes) at one address through the run;
* the SGD path (``FP32Optimizer``) keeps ``.grad`` attached through Megatron's ``optimizer.zero_grad()``;
* Megatron-LM's own training loop (examples/pretrain_gpt.py, testing/pretrain_gpt_cpu.py) with
  ``--cuda-graph-impl full_iteration`` trains bitwise like without it.

Replay against eager, bit for bit, runs on the GPU: tests/functional/test_megatron_cuda_graph.py.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:  # find_spec: no 6 s import in the parent
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402
from tests.unit.test_megatron_adapter import (LR_ADAM, LR_SGD, WD, _assert_states_close, _expect_error,  # noqa: E402
                                              _opt_config)

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ITERS, NMB, MBS, SEQ, VOCAB = 3, 2, 2, 16, 64
MODEL_SEED, DATA_SEED = 1234, 100
#: What Megatron-LM's get_megatron_ddp_config adds for --use-megatron-fsdp --cuda-graph-impl full_iteration
GRAPH_DDP = dict(megatron_fsdp_cuda_graph_mode=True, fsdp_all_gather_in_start_param_sync=False)


# ---------------------------------------------------------------- settings, in the parent
def _config(impl: str):
    from testing.megatron_gpt import tiny_cpu_config

    return tiny_cpu_config(2, 32, 4, cuda_graph_impl=impl, cuda_graph_modules=[])


def _ddp(**kwargs):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**kwargs)


def test_full_iteration_passes_the_settings_quietly_for_every_strategy():
    from megatron_fsdp_v2.megatron import settings
    from megatron_fsdp_v2.megatron.wrap_settings import _unsupported_settings

    graph, plain = _config("full_iteration"), _config("none")
    settings._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for strategy in STRATEGIES:
            ddp = _ddp(data_parallel_sharding_strategy=strategy, **GRAPH_DDP)
            assert _unsupported_settings(graph, ddp, None, {}) == []
            settings.check_ddp_config(ddp, graph)
        settings.check_optimizer_config({"cuda_graph_impl": "full_iteration", "optimizer": "adam"}, "optim")
        assert [str(w.message) for w in caught] == []
        # outside a graph, leaving the all-gather out of start_param_sync changes nothing here: it warns
        settings.check_ddp_config(_ddp(fsdp_all_gather_in_start_param_sync=False), plain)
    assert [str(w.message)[:88] for w in caught] == [
        "megatron_fsdp_v2: ddp_config.fsdp_all_gather_in_start_param_sync=False: start_param_sync"]
    assert settings.cuda_graph_mode(graph, _ddp()) is True
    assert settings.cuda_graph_mode(plain, _ddp()) is False
    assert settings.cuda_graph_mode(plain, _ddp(megatron_fsdp_cuda_graph_mode=True)) is True


def test_per_layer_graphs_are_refused_naming_the_flag_and_what_is_allowed():
    from megatron_fsdp_v2.megatron.wrap_settings import _unsupported_settings

    (local,) = _unsupported_settings(_config("local"), _ddp(), None, {})
    assert local.startswith("cuda_graph_impl='local' (--cuda-graph-impl): Megatron's per-layer graphs add each "
                            "layer's weight gradients to param.main_grad inside the graph")
    (te,) = _unsupported_settings(_config("transformer_engine"), _ddp(), None, {})
    assert te.startswith("cuda_graph_impl='transformer_engine' (--cuda-graph-impl): ")
    if importlib.util.find_spec("transformer_engine") is None:
        assert "Transformer Engine is not installed" in te
    else:
        assert "refuses modules with hooks registered" in te
    for text in (local, te):
        assert text.endswith("allowed: 'none' or 'full_iteration' (--cuda-graph-impl full_iteration: the whole "
                             "forward-backward as one graph)")


def test_host_reads_and_the_optimizer_graph_are_refused_with_the_graph():
    from megatron_fsdp_v2.megatron import settings

    for ddp in (_ddp(check_for_nan_in_grad=True), _ddp(check_for_nan_in_grad=True, megatron_fsdp_cuda_graph_mode=True)):
        config = _config("full_iteration" if not ddp.megatron_fsdp_cuda_graph_mode else "none")
        with pytest.raises(ValueError, match=r"check_for_nan_in_grad=True \(--no-check-for-nan-in-loss-and-grad\): "
                                             r"honoured, but not with CUDA graphs .* pass "
                                             r"--no-check-for-nan-in-loss-and-grad"):
            settings.check_ddp_config(ddp, config)
    settings.check_ddp_config(_ddp(check_for_nan_in_grad=True), _config("none"))      # honoured without graphs
    offload = {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True, "optimizer_offload_fraction": 0.5}
    with pytest.raises(ValueError, match=r"optimizer_cpu_offload=True \(--optimizer-cpu-offload\): offloaded groups "
                                         r"copy their gradients to the host"):
        settings.check_optimizer_config({**offload, "cuda_graph_impl": "full_iteration"}, "optim")
    settings.check_optimizer_config(offload, "optim")                                   # honoured without graphs
    with pytest.raises(ValueError, match=r"optimizer_cuda_graph=True \(--optimizer-cuda-graph\): a graph of "
                                         r"optimizer.step\(\).*--cuda-graph-impl full_iteration captures forward "
                                         r"and backward"):
        settings.check_optimizer_config({"optimizer_cuda_graph": True}, "optim")


# ---------------------------------------------------------------- 2 ranks: Megatron's eager warm-up
def _wrap(strategy, graphed: bool, optimizer: str, reference: bool):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from tests.megatron_cpu import build_tiny_gpt, constant_param_scheduler

    model, config = build_tiny_gpt(MODEL_SEED, vocab=VOCAB, seq=SEQ,
                                   cuda_graph_impl="full_iteration" if graphed else "none")
    lr = LR_ADAM if optimizer == "adam" else LR_SGD
    if reference:                     # Megatron DDP + FP32Optimizer, as test_megatron_adapter's reference
        wrapped = DistributedDataParallel(config=config, ddp_config=_ddp(), module=model)
        opt = get_megatron_optimizer(_opt_config(optimizer, lr), [wrapped])
    else:
        ddp = _ddp(data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, **(GRAPH_DDP if graphed else {}))
        wrapped = FullyShardedDataParallel(config, ddp, model)
        config.no_sync_func = wrapped.no_sync
        opt = get_optimizer(_opt_config(optimizer, lr), [wrapped])
    constant_param_scheduler(opt, lr, WD)
    return wrapped, config, opt


def _train(strategy, batches, graphed: bool, optimizer: str = "adam", reference: bool = False) -> dict:
    """Megatron-LM's train_step, ``ITERS`` times; with ``graphed`` through ``FullCudaGraphWrapper``
    left in its warm-up. Per iteration after the step: is a weight all-gather in flight, and (after
    Megatron's ``optimizer.zero_grad()``) the address of every main parameter's ``.grad``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from testing.megatron_gpt import megatron_train_step
    from tests.megatron_cpu import _reduce_lm_loss

    wrapped, config, opt = _wrap(strategy, graphed, optimizer, reference)
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    if graphed:
        forward_backward = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=ITERS + 1)
        forward_backward.reset_cuda_graph("training")          # its iteration count is class-wide
    out = dict(losses=[], norms=[], in_flight=[], grads=[])
    for it in range(ITERS):
        store, ok, norm = megatron_train_step(wrapped, opt, batches[it * NMB:(it + 1) * NMB], SEQ, MBS,
                                              forward_backward)
        assert ok
        out["losses"].append(_reduce_lm_loss(store, ps.get_data_parallel_group())[0])
        out["norms"].append(float(norm))
        if not reference:
            out["in_flight"].append(any(g.pending_refresh is not None for g in wrapped.module._fsdp_engine.groups))
            opt.zero_grad()
            out["grads"].append([None if p.grad is None else p.grad.data_ptr() for p in wrapped.parameters()])
    config.no_sync_func = config.finalize_model_grads_func = None
    if not reference:
        out["capture_safe"] = wrapped.module._fsdp_engine.capture_safe
    out["state"] = wrapped.state_dict() if not reference else {
        k: v.detach().clone() for k, v in wrapped.module.state_dict().items() if isinstance(v, torch.Tensor)}
    return out


def _offload_refusal():
    from megatron_fsdp_v2.megatron import get_optimizer

    wrapped, _, _ = _wrap("optim", True, "adam", False)
    return _expect_error(lambda: get_optimizer(_opt_config("adam", LR_ADAM, optimizer_cpu_offload=True,
                                                           use_precision_aware_optimizer=True,
                                                           use_distributed_optimizer=True), [wrapped]))


def graph_worker(rank, world_size):
    from tests.megatron_cpu import megatron_on_cpu, synthetic_batches

    out = {}
    with megatron_on_cpu(world_size):
        batches = synthetic_batches(DATA_SEED + rank, ITERS * NMB, MBS, SEQ, VOCAB)
        out["reference"] = _train(None, batches, graphed=True, reference=True)
        for strategy in STRATEGIES:
            for graphed in (True, False):
                out[(strategy, graphed)] = _train(strategy, batches, graphed)
        for graphed in (True, False):
            out[("sgd", graphed)] = _train("optim_grads", batches, graphed, optimizer="sgd")
        out["offload"] = _offload_refusal()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(graph_worker, 2, timeout=300)


def test_full_iteration_builds_every_strategy_capture_safe(two_ranks):
    for out in two_ranks:
        assert [out[(s, True)]["capture_safe"] for s in STRATEGIES] == [True] * 4
        assert [out[(s, False)]["capture_safe"] for s in STRATEGIES] == [False] * 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eager_warmup_of_the_graph_trains_bitwise_like_without_it(two_ranks, strategy):
    for out in two_ranks:
        graphed, plain = out[(strategy, True)], out[(strategy, False)]
        assert graphed["losses"] == plain["losses"] and graphed["norms"] == plain["norms"]
        assert graphed["state"].keys() == plain["state"].keys()
        assert all(torch.equal(graphed["state"][k], v) for k, v in plain["state"].items())
        assert graphed["losses"][-1] < graphed["losses"][0], graphed["losses"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eager_warmup_of_the_graph_trains_like_megatron_ddp(two_ranks, strategy):
    for out in two_ranks:
        graphed, reference = out[(strategy, True)], out["reference"]
        for got, want in ((graphed["losses"], reference["losses"]), (graphed["norms"], reference["norms"])):
            assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(got, want)), (got, want)
        _assert_states_close(graphed["state"], reference["state"], f"{strategy} under FullCudaGraphWrapper")


def test_no_weight_all_gather_is_in_flight_after_the_step(two_ranks):
    """Capture-safe: ZeRO-1/2's refresh lands before ``optimizer.step()`` returns. Without the graph
    it stays in flight to overlap the next forward (which, captured, could not wait for it)."""
    for out in two_ranks:
        assert {s: any(out[(s, True)]["in_flight"]) for s in STRATEGIES} == dict.fromkeys(STRATEGIES, False)
        assert {s: all(out[(s, False)]["in_flight"]) for s in STRATEGIES} == {
            "no_shard": False, "optim": True, "optim_grads": True, "optim_grads_params": False}


def test_gradients_keep_their_tensors_through_the_run(two_ranks):
    """Every main parameter's ``.grad`` after Megatron's ``optimizer.zero_grad()``: present, at the
    address of the first iteration (what the replayed backward writes); also for the SGD path, whose
    ``FP32Optimizer`` sets them to None without the graph."""
    for out in two_ranks:
        for run in [out[(s, True)] for s in STRATEGIES] + [out[("sgd", True)]]:
            first = run["grads"][0]
            assert None not in first and all(grads == first for grads in run["grads"])
        assert set(out[("sgd", False)]["grads"][0]) == {None}
        assert out[("sgd", True)]["losses"] == out[("sgd", False)]["losses"]
        assert all(torch.equal(out[("sgd", True)]["state"][k], v) for k, v in out[("sgd", False)]["state"].items())


def test_cpu_offload_is_refused_with_the_graph_on_every_rank(two_ranks):
    errors = [out["offload"] for out in two_ranks]
    assert errors[0] == errors[1]
    assert errors[0].startswith("ValueError: get_optimizer: FullyShardedDataParallel does not support "
                                "optimizer_cpu_offload=True (--optimizer-cpu-offload)"), errors[0]


# ---------------------------------------------------------------- 2 ranks: Megatron-LM's own loop
GRAPH_FLAGS = ("--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "100")


def launcher_graph_worker(rank, world_size, argv):
    """examples/pretrain_gpt.py's ``main(argv)`` on CPU (test_megatron_fsdp_command_line's worker), and
    what Megatron-LM's loop handed ``FullCudaGraphWrapper``: per call, is the chunk capture-safe."""
    from megatron.core import full_cuda_graph

    from tests.unit.test_megatron_fsdp_command_line import launcher_worker

    seen, call = [], full_cuda_graph.FullCudaGraphWrapper.__call__

    def recording_call(self, *args, **kwargs):
        seen.append(kwargs["model"][0].module._fsdp_engine.capture_safe)
        return call(self, *args, **kwargs)

    full_cuda_graph.FullCudaGraphWrapper.__call__ = recording_call
    try:
        out = launcher_worker(rank, world_size, argv)
    finally:
        full_cuda_graph.FullCudaGraphWrapper.__call__ = call
    out["graph_calls"] = seen
    return out


def test_megatron_lm_loop_with_full_iteration_trains_bitwise_like_without_it():
    """A Megatron-FSDP command line (ZeRO-1: whose capture failed before ``capture_safe``) with
    ``--cuda-graph-impl full_iteration``: Megatron-LM's validation accepts it, its loop runs every
    iteration through ``FullCudaGraphWrapper`` (warm-up above the run) on a capture-safe chunk, and
    losses and weights equal the same command line's without the graph, bit for bit."""
    from tests.unit.test_megatron_fsdp_command_line import ITERS as LAUNCHER_ITERS
    from tests.unit.test_megatron_fsdp_command_line import command_line

    common = ("--no-check-for-nan-in-loss-and-grad",)
    graphed = run_distributed(launcher_graph_worker, 2, command_line("optim", *common, *GRAPH_FLAGS), timeout=300)
    plain = run_distributed(launcher_graph_worker, 2, command_line("optim", *common), timeout=300)
    assert [out["graph_calls"] for out in graphed] == [[True] * LAUNCHER_ITERS] * 2
    assert [out["graph_calls"] for out in plain] == [[]] * 2
    assert sorted(graphed[1]["losses"]) == list(range(1, LAUNCHER_ITERS + 1))
    assert graphed[1]["losses"] == plain[1]["losses"]
    for got, want in zip(graphed, plain):
        assert got["weights"].keys() == want["weights"].keys()
        assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items())
