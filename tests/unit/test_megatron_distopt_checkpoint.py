"""Switching from Megatron DDP + ``DistributedOptimizer`` to us with the optimizer state: its
``torch_dist`` checkpoints, both sharding types Megatron-LM writes (``dp_reshardable`` by default,
``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``), load into our wrapper and
``get_optimizer``'s Adam on a tiny GPT (CPU, gloo; Megatron's optimizer patched for CPU in
testing/cpu_compat.py).

* Megatron trains 2 iterations at dp 2 (and at TP2 x DP2), saves both types, trains 2 more.
* We load each at dp 2 (every strategy), dp 1 and dp 4 (dp 2 checkpoints) and at TP2 x DP2:
  the weights and Adam's exp_avg / exp_avg_sq equal Megatron's saved ones bitwise, the step count
  equals the saved one; 2 more iterations give Megatron's losses and weights (rtol 1e-5, atol 1e-6).
* A ``dp_reshardable`` checkpoint at another tensor-parallel layout is refused on every rank,
  naming the type and ``--dist-ckpt-optim-fully-reshardable``.
* The way back: ``save_dist_checkpoint``'s default (``fully_reshardable``, every strategy at dp 2)
  and ``dp_reshardable`` load into Megatron DDP + DistributedOptimizer with Megatron's own calls
  and no sharding type given (it reads the checkpoint's content metadata, as Megatron-LM's
  ``load_checkpoint`` does): weights and Adam state equal bitwise, and it continues with our losses
  (bitwise) and weights.
* The launcher's ``--load`` of Megatron-LM's own save resumes with the optimizer state.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.megatron_cpu import run_distributed  # noqa: E402

TYPES = ("dp_reshardable", "fully_reshardable")
DEFAULT = "default"      # save_dist_checkpoint(path, model, optimizer): no sharding_type
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SAVED_ITERS, MORE_ITERS, NMB, MBS, SEQ, VOCAB = 2, 2, 2, 2, 16, 64
DATA_SEED = 500


def _opt_config(strategy: str = "optim"):
    """Megatron's optimizer config as the source run used it, with the distributed optimizer (for
    our strategies as Megatron-FSDP means it: no_shard keeps the optimizer state replicated)."""
    from tests.unit.test_megatron_adapter import LR_ADAM, _opt_config

    del strategy
    return _opt_config("adam", LR_ADAM, use_distributed_optimizer=True)


def _megatron_save_fully_reshardable(model, optimizer, base: str, name: str, rank: int) -> str:
    """Megatron's own dist_checkpointing save of ``model`` and ``optimizer`` in model space, under
    ``base/name``; returns that directory."""
    from megatron.core import dist_checkpointing

    path = os.path.join(base, name)
    if rank == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"})}, path)
    return path


def _iterate(ddp, config, optimizer, batches):
    """One iteration per NMB batches; returns the data-parallel mean losses."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.megatron_cpu import _reduce_lm_loss, forward_step_func

    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    losses = []
    for it in range(len(batches) // NMB):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        store = get_forward_backward_func()(forward_step_func=forward_step_func,
                                            data_iterator=iter(batches[it * NMB:(it + 1) * NMB]), model=[ddp],
                                            num_microbatches=NMB, seq_length=SEQ, micro_batch_size=MBS,
                                            forward_only=False)
        losses.append(_reduce_lm_loss(store, ps.get_data_parallel_group())[0])
        ok, _, _ = optimizer.step()
        assert ok
    config.no_sync_func = config.finalize_model_grads_func = None
    return losses


def _batches(rank_in_dp, start, count):
    from tests.megatron_cpu import synthetic_batches

    # every data-parallel rank of the saving run has its own stream; a dp 1 / dp 4 run continues
    # with dp 2's streams (dp 1: both streams on one rank would change the mean; they stay at dp 2)
    return synthetic_batches(DATA_SEED + rank_in_dp, (SAVED_ITERS + MORE_ITERS) * NMB, MBS, SEQ, VOCAB)[start:start + count]


def megatron_save_worker(rank, world_size, base, tp):
    """Megatron DDP + DistributedOptimizer: train, save both types, train on. Returns the losses
    and weights after the save (rank 0) and the plain saved tensors."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import get_megatron_optimizer

    from testing.cpu_compat import distributed_optimizer_on_cpu
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, wrap_megatron_ddp)

    with patch_megatron_for_cpu(), distributed_optimizer_on_cpu():
        init_megatron_parallel_state(world_size, tensor_model_parallel_size=tp)
        try:
            dp_rank = ps.get_data_parallel_rank()
            model, config = build_tiny_gpt(1234, vocab=VOCAB, seq=SEQ, tensor_model_parallel_size=tp)
            ddp = wrap_megatron_ddp(model, config, use_distributed_optimizer=True)
            optimizer = get_megatron_optimizer(_opt_config(), [ddp])
            _iterate(ddp, config, optimizer, _batches(dp_rank, 0, SAVED_ITERS * NMB))
            for kind in TYPES:
                path = os.path.join(base, f"{kind}_tp{tp}")
                if rank == 0:
                    os.makedirs(path)
                torch.distributed.barrier()
                model_sd = model.sharded_state_dict()
                state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
                    model_sd, metadata={"distrib_optim_sharding_type": kind})}
                dist_checkpointing.save(state, path, content_metadata={"distrib_optim_sharding_type": kind})
            step = {float(s["step"]) for s in optimizer.chained_optimizers[0].optimizer.state.values()}
            losses = _iterate(ddp, config, optimizer, _batches(dp_rank, SAVED_ITERS * NMB, MORE_ITERS * NMB))
            return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()
                                                  if not k.endswith("_extra_state")}, "step": step}
        finally:
            destroy_megatron_parallel_state()


def _our_state_in_megatron_keys(wrapper, optimizer):
    """Our weights and Adam state gathered over dp (this tensor-parallel rank's slices), keyed
    like Megatron's fully_reshardable checkpoint (stacked layers) with the index into it."""
    from tests.state_gather import full_optimizer_state

    state = full_optimizer_state(wrapper, optimizer, wrapper.dp_group)
    slices = wrapper.tensor_parallel_slices()
    out, steps = {}, set()
    for key, value in state.items():
        if not key.startswith("state."):
            continue
        name, sub = key[len("state."):].rsplit(".", 1)
        if sub == "step":
            steps.add(float(value))
            continue
        placement, shape = slices[name]
        index = tuple(placement.prepend_offsets) + tuple(
            slice(o, o + n) for o, n in zip(placement.tensor_offsets, shape))
        out[(f"optimizer.state.{sub}.{placement.key}", index)] = value
    return out, steps


def load_worker(rank, world_size, base, tp, cases, saving_dp):
    """Load each (sharding type, strategy) into our wrapper; compare with the plain tensors of
    Megatron's fully_reshardable checkpoint; continue 2 iterations."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer, load_dist_checkpoint
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu)

    out = {}
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size, tensor_model_parallel_size=tp)
        try:
            dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            plain = dist_checkpointing.load_plain_tensors(os.path.join(base, f"fully_reshardable_tp{tp}"))
            for kind, strategy in cases:
                model, config = build_tiny_gpt(77, vocab=VOCAB, seq=SEQ, tensor_model_parallel_size=tp)
                wrapper = FullyShardedDataParallel(
                    config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy), model)
                optimizer = get_optimizer(_opt_config(wrapper.strategy.name), [wrapper])
                load_dist_checkpoint(os.path.join(base, f"{kind}_tp{tp}"), wrapper, optimizer)
                ours, steps = _our_state_in_megatron_keys(wrapper, optimizer)
                unequal = sorted(k for (k, index), v in ours.items() if not torch.equal(plain[k][index], v))
                compared = sum(v.numel() for v in ours.values())
                result = {"unequal": unequal, "compared": compared, "steps": steps}
                if dp == saving_dp:        # same data streams as Megatron's run: continue it
                    result["losses"] = _iterate(wrapper, config, optimizer,
                                                _batches(dp_rank, SAVED_ITERS * NMB, MORE_ITERS * NMB))
                    result["weights"] = {k: v.clone() for k, v in wrapper.state_dict().items()
                                         if not k.endswith("_extra_state")}
                out[(kind, strategy)] = result
        finally:
            destroy_megatron_parallel_state()
    return out


def refusal_worker(rank, world_size, base):
    """A TP2 dp_reshardable checkpoint at TP1: refused on every rank."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer, load_dist_checkpoint
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu)

    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            model, config = build_tiny_gpt(77, vocab=VOCAB, seq=SEQ)
            wrapper = FullyShardedDataParallel(
                config, DistributedDataParallelConfig(data_parallel_sharding_strategy="optim"), model)
            optimizer = get_optimizer(_opt_config(wrapper.strategy.name), [wrapper])
            try:
                load_dist_checkpoint(os.path.join(base, "dp_reshardable_tp2"), wrapper, optimizer)
            except ValueError as exc:
                return str(exc)
            return None
        finally:
            destroy_megatron_parallel_state()


@pytest.fixture(scope="module")
def megatron_checkpoints(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("megatron_distopt"))
    return base, {1: run_distributed(megatron_save_worker, 2, base, 1, timeout=300),
                  2: run_distributed(megatron_save_worker, 4, base, 2, timeout=300)}


def _check(results, megatron, cases, continued):
    for rank, out in enumerate(results):
        for case in cases:
            got = out[case]
            assert got["unequal"] == [] and got["compared"] > 20000, (case, rank, got["unequal"][:5])
            assert got["steps"] == {float(SAVED_ITERS)}, (case, got["steps"])
            if continued:
                want = megatron[rank]
                torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                           rtol=1e-5, atol=1e-6)
                for key, value in want["weights"].items():
                    torch.testing.assert_close(got["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_megatron_distributed_optimizer_checkpoints_load_at_dp2_and_continue(megatron_checkpoints):
    base, megatron = megatron_checkpoints
    assert megatron[1][0]["step"] == {float(SAVED_ITERS)}
    # every strategy from the default type; the model-space type into a replicated and a fully sharded one
    cases = [("dp_reshardable", s) for s in STRATEGIES] + [("fully_reshardable", s) for s in ("no_shard", "optim_grads")]
    _check(run_distributed(load_worker, 2, base, 1, cases, 2, timeout=300), megatron[1], cases, True)


@pytest.mark.parametrize("world_size", [1, 4])
def test_megatron_distributed_optimizer_checkpoints_load_at_other_dp(megatron_checkpoints, world_size):
    base, megatron = megatron_checkpoints
    cases = [(kind, s) for kind in TYPES for s in ("optim_grads_params", "no_shard")]
    _check(run_distributed(load_worker, world_size, base, 1, cases, 2, timeout=300), megatron[1], cases, False)


def test_megatron_distributed_optimizer_checkpoints_load_at_tp2_dp2(megatron_checkpoints):
    base, megatron = megatron_checkpoints
    cases = [(kind, s) for kind in TYPES for s in ("optim", "optim_grads_params")]
    _check(run_distributed(load_worker, 4, base, 2, cases, 2, timeout=300), megatron[2], cases, True)


def test_dp_reshardable_at_another_tensor_parallel_size_is_refused(megatron_checkpoints):
    base, _ = megatron_checkpoints
    for message in run_distributed(refusal_worker, 2, base, timeout=300):
        assert message is not None and "sharding type 'dp_reshardable'" in message, message
        assert "--dist-ckpt-optim-fully-reshardable" in message, message


# ---------------------------------------------------------------- the way back
def our_save_worker(rank, world_size, base, cases):
    """Ours: train 2 iterations, save each (type, strategy) in Megatron's layout (and a
    fully_reshardable copy, the reference of its plain tensors), train 2 more."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer, save_dist_checkpoint
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu)

    out = {}
    with patch_megatron_for_cpu():
        init_megatron_parallel_state(world_size)
        try:
            dp_rank = ps.get_data_parallel_rank()
            for kind, strategy in cases:
                model, config = build_tiny_gpt(1234, vocab=VOCAB, seq=SEQ)
                wrapper = FullyShardedDataParallel(
                    config, DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy), model)
                optimizer = get_optimizer(_opt_config(wrapper.strategy.name), [wrapper])
                _iterate(wrapper, config, optimizer, _batches(dp_rank, 0, SAVED_ITERS * NMB))
                path = os.path.join(base, f"ours_{kind}_{strategy}")
                if kind == DEFAULT:        # no keyword: what the way back must not depend on
                    save_dist_checkpoint(path, wrapper, optimizer)
                else:
                    save_dist_checkpoint(path, wrapper, optimizer, kind)
                save_dist_checkpoint(os.path.join(base, f"ours_ref_{kind}_{strategy}"), wrapper, optimizer,
                                     "fully_reshardable")
                losses = _iterate(wrapper, config, optimizer, _batches(dp_rank, SAVED_ITERS * NMB, MORE_ITERS * NMB))
                out[(kind, strategy)] = {"losses": losses, "weights": {k: v.clone() for k, v in wrapper.state_dict().items()
                                                                       if not k.endswith("_extra_state")}}
        finally:
            destroy_megatron_parallel_state()
    return out


def megatron_load_worker(rank, world_size, base, cases):
    """Megatron DDP + DistributedOptimizer loads our checkpoints as Megatron-LM's load_checkpoint
    does (sharded_state_dict(is_loading=True) with the checkpoint's sharding type,
    dist_checkpointing.load, load_state_dict), re-saves them fully_reshardable, trains on."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import get_megatron_optimizer

    from testing.cpu_compat import distributed_optimizer_on_cpu
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, wrap_megatron_ddp)

    out = {}
    with patch_megatron_for_cpu(), distributed_optimizer_on_cpu():
        init_megatron_parallel_state(world_size)
        try:
            dp_rank = ps.get_data_parallel_rank()
            for kind, strategy in cases:
                model, config = build_tiny_gpt(77, vocab=VOCAB, seq=SEQ)
                ddp = wrap_megatron_ddp(model, config, use_distributed_optimizer=True)
                optimizer = get_megatron_optimizer(_opt_config(), [ddp])
                # Megatron's own state_dict() needs Adam state to exist (torch's Adam without TE/apex)
                optimizer.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
                path = os.path.join(base, f"ours_{kind}_{strategy}")
                metadata = dist_checkpointing.load_content_metadata(path)
                model_sd = model.sharded_state_dict()
                state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
                    model_sd, is_loading=True, metadata=metadata)}
                loaded = dist_checkpointing.load(state, path)
                model.load_state_dict(loaded["model"])
                with torch.no_grad():       # fp32: Megatron copies into the model's parameters in place
                    optimizer.load_state_dict(loaded["optimizer"])
                steps = {float(s["step"]) for s in optimizer.chained_optimizers[0].optimizer.state.values()}
                again = _megatron_save_fully_reshardable(model, optimizer, base, f"megatron_{kind}_{strategy}", rank)
                want, got = ({k: v for k, v in dist_checkpointing.load_plain_tensors(d).items()
                              if isinstance(v, torch.Tensor)}
                             for d in (os.path.join(base, f"ours_ref_{kind}_{strategy}"), again))
                unequal = sorted(set(want) ^ set(got)) + [k for k in want if k in got and not torch.equal(got[k], want[k])]
                moments = sum(v.numel() for k, v in got.items() if k.startswith("optimizer.state.exp_avg_sq."))
                losses = _iterate(ddp, config, optimizer, _batches(dp_rank, SAVED_ITERS * NMB, MORE_ITERS * NMB))
                out[(kind, strategy)] = {"unequal": unequal, "moments": moments, "steps": steps, "losses": losses,
                                         "weights": {
                    k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}}
        finally:
            destroy_megatron_parallel_state()
    return out


def test_megatron_ddp_loads_our_checkpoints_and_continues(tmp_path):
    """save_dist_checkpoint's default for every strategy, and dp_reshardable, asked for; Megatron DDP
    reads the sharding type from the checkpoint's content metadata, as its load_checkpoint does."""
    base = str(tmp_path)
    cases = [(DEFAULT, s) for s in STRATEGIES] + [("dp_reshardable", "optim_grads_params"), ("dp_reshardable", "no_shard")]
    ours = run_distributed(our_save_worker, 2, base, cases, timeout=300)
    megatron = run_distributed(megatron_load_worker, 2, base, cases, timeout=300)
    for case in cases:
        for rank in range(2):
            assert megatron[rank][case]["unequal"] == [] and megatron[rank][case]["moments"] > 20000, case
            assert megatron[rank][case]["steps"] == {float(SAVED_ITERS)}, (case, megatron[rank][case]["steps"])
            # the continuation: the same losses and weights up to rounding. Megatron's distributed
            # optimizer reduce-scatters where ours (no_shard) all-reduces, so sums run in another order;
            # bitwise equal on the CPUs CI ran on before 2026-12-06, 3e-8 apart on an AVX-512 AMD EPYC.
            assert megatron[rank][case]["losses"] == pytest.approx(ours[rank][case]["losses"], rel=1e-6, abs=0), case
            for key, value in ours[rank][case]["weights"].items():
                torch.testing.assert_close(megatron[rank][case]["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------- the launcher
def launcher_resume_worker(rank, world_size, base, fully):
    """Megatron-LM's save_checkpoint of Megatron DDP + DistributedOptimizer (its default layout,
    or --dist-ckpt-optim-fully-reshardable), then the launcher's load_checkpoint (``--load``, no
    --no-load-optim) into our wrapper: Adam state as saved."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training import checkpointing, training
    from megatron.training.global_vars import destroy_global_vars, set_global_variables

    from examples.pretrain_gpt import parse_args, use_fully_sharded_data_parallel
    from megatron_fsdp_v2.megatron import FullyShardedDataParallel, get_optimizer
    from testing.cpu_compat import distributed_optimizer_on_cpu
    from tests.megatron_cpu import (build_tiny_gpt, destroy_megatron_parallel_state, init_megatron_parallel_state,
                                    patch_megatron_for_cpu, wrap_megatron_ddp)
    from tests.unit.test_megatron_adapter import LAUNCHER_ARGS

    from megatron.core.distributed import DistributedDataParallelConfig

    flags = ["--save", base, "--load", base, "--save-interval", "2", "--no-save-rng", "--no-load-rng",
             "--use-cpu-initialization", "--use-distributed-optimizer"] + (
        ["--dist-ckpt-optim-fully-reshardable"] if fully else [])
    with patch_megatron_for_cpu("megatron.training.checkpointing"), distributed_optimizer_on_cpu():
        init_megatron_parallel_state(world_size)
        args = parse_args(LAUNCHER_ARGS + flags)
        set_global_variables(args, build_tokenizer=False)
        original_rng, checkpointing.get_rng_state = checkpointing.get_rng_state, lambda *a, **k: None
        try:
            model, config = build_tiny_gpt(1234, vocab=VOCAB, seq=SEQ)
            ddp = wrap_megatron_ddp(model, config, use_distributed_optimizer=True)
            optimizer = get_megatron_optimizer(_opt_config(), [ddp])
            _iterate(ddp, config, optimizer, _batches(ps.get_data_parallel_rank(), 0, SAVED_ITERS * NMB))
            checkpointing.save_checkpoint(SAVED_ITERS, [ddp], optimizer, None, 0)
            reference = _megatron_save_fully_reshardable(model, optimizer, base, "reference", rank)
            plain = {k: v for k, v in dist_checkpointing.load_plain_tensors(reference).items()
                     if isinstance(v, torch.Tensor)}
            ours, config = build_tiny_gpt(77, vocab=VOCAB, seq=SEQ)
            wrapper = FullyShardedDataParallel(
                config, DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads"), ours)
            our_optimizer = get_optimizer(_opt_config(wrapper.strategy.name), [wrapper])
            with use_fully_sharded_data_parallel():
                iteration, _ = training.load_checkpoint([wrapper], our_optimizer, None)
            state, steps = _our_state_in_megatron_keys(wrapper, our_optimizer)
            return {"iteration": iteration, "steps": steps, "compared": sum(v.numel() for v in state.values()),
                    "unequal": sorted(k for (k, index), v in state.items() if not torch.equal(plain[k][index], v))}
        finally:
            checkpointing.get_rng_state = original_rng
            destroy_global_vars()
            destroy_megatron_parallel_state()


@pytest.mark.parametrize("fully", [False, True])
def test_launcher_load_resumes_megatron_distributed_optimizer_state(tmp_path, fully):
    for out in run_distributed(launcher_resume_worker, 2, str(tmp_path), fully, timeout=300):
        assert out["iteration"] == SAVED_ITERS
        assert out["unequal"] == [] and out["compared"] > 20000, out["unequal"][:5]
        assert out["steps"] == {float(SAVED_ITERS)}
