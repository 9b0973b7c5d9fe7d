"""The boundary between the core and the Megatron adapter, and the core's checked phases.

* the adapter (``megatron_fsdp_v2/megatron/``) reads no underscore attribute of a core object;
* the core speaks torch's words: no Megatron method names on a wrapped module or in core sources;
* the core's verbs the adapter relies on do what they say (divide factor, scaling, unshard);
* each pending collective has one owner; hooks firing out of order raise naming the phase.
"""

from __future__ import annotations

import ast
import contextlib
import pathlib

import pytest
import torch

import megatron_fsdp_v2
from megatron_fsdp_v2 import STRATEGY_NAMES, FullyShardedModule, fully_shard
from megatron_fsdp_v2.row_sharded import local_piece
from megatron_fsdp_v2.runtime.phase import Phase, PhaseMachine

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn

PACKAGE = pathlib.Path(megatron_fsdp_v2.__file__).parent
ADAPTER = PACKAGE / "megatron"

# Underscore names the adapter may touch: namedtuple API, and attributes the adapter itself puts
# on Megatron's (not the core's) objects (``_get_filesystem_reader``: Megatron's reader factory,
# which dist_checkpoint.safe_dcp_reading replaces while it loads; ``_local_tensor``: the name
# Megatron's finalize_model_grads reads on gradients, which the adapter sets on its plain ones;
# ``_filter_grads_for_norm``: Megatron's optimizer method the adapter wraps for no_shard with experts).
_NOT_CORE = {"_replace", "_asdict", "_fields", "_fsdp_v2_model", "_fsdp_v2_dp_rank", "_fsdp_v2_tp_rank",
             "_fsdp_v2_slices", "_fsdp_v2_format", "_fsdp_v2_chunk_count", "_fsdp_v2_shard_replica",
             "_fsdp_v2_expert_names", "_fsdp_v2_expert_dp_rank", "_get_filesystem_reader", "_local_tensor",
             "_filter_grads_for_norm", "_fsdp_v2_dp_size", "_fsdp_v2_mp_rank", "_fsdp_v2_buckets",
             "_fsdp_v2_bucket_dtype", "_fsdp_v2_source", "_fsdp_v2_shapes",
             "_replica_rank",                       # ShardedOptimizerCheckpoint's own method
                                                    # (megatron/checkpoint/dist_checkpoint.py)
             "_compute_per_buffer_param_layout"}   # Megatron's bucket layout (megatron/checkpoint/distopt_format.py)


def _underscore_reads(path: pathlib.Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is not a dunder."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if node.attr in _NOT_CORE:
                continue
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_the_adapter_reads_no_underscore_attribute_of_a_core_object():
    offenders = [hit for path in sorted(ADAPTER.rglob("*.py")) for hit in _underscore_reads(path)]
    assert offenders == []


def test_the_underscore_check_finds_a_private_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(module):\n    return module._fsdp_engine.groups\n")
    assert _underscore_reads(probe) == ["probe.py:2: ._fsdp_engine"]


MEGATRON_VERBS = ("finish_grad_sync", "start_grad_sync", "start_param_sync", "zero_grad_buffer",
                  "force_all_reduce", "copy_main_weights_to_model_weights")


def test_the_core_speaks_torch_words():
    for verb in MEGATRON_VERBS:
        assert not hasattr(FullyShardedModule, verb), verb
    for verb in ("no_sync", "set_requires_gradient_sync", "set_gradient_divide_factor", "unshard", "reshard",
                 "reduce_gradients", "wait_gradient_reduction", "scale_gradients", "zero_grad"):
        assert callable(getattr(FullyShardedModule, verb)), verb
    core_files = [p for p in PACKAGE.rglob("*.py") if "megatron" not in p.relative_to(PACKAGE).parts[:-1]]
    offenders = [f"{p.name}: {verb}" for p in core_files for verb in MEGATRON_VERBS if verb in p.read_text()]
    assert offenders == []


def test_phase_machine_rejects_moves_the_diagram_does_not_have():
    machine = PhaseMachine()
    machine.enter(Phase.FORWARD)
    machine.enter(Phase.AWAITING_BACKWARD_NO_SYNC)
    with pytest.raises(RuntimeError, match=r"no_sync\(\).*found phase 'awaiting backward \(no_sync\)', "
                                           r"asked for 'forward'"):
        machine.enter(Phase.FORWARD)
    machine.enter(Phase.BACKWARD)
    with pytest.raises(RuntimeError, match=r"out of order \(found phase 'backward', asked for 'awaiting backward'\)"):
        machine.enter(Phase.AWAITING_BACKWARD)
    machine.reset()
    assert machine.phase is Phase.IDLE


def verbs_worker(rank, world_size):
    out = {}
    for strategy in STRATEGY_NAMES:
        torch.manual_seed(0)
        model = fully_shard(UnevenNet(), sharding_strategy=strategy, unit_modules=[Block])
        x, y = make_batches(0, rank, 1)[0]
        loss_fn(model(x), y).backward()
        mean = [local_piece(p.grad).clone() for p in model.parameters()]
        model.zero_grad()
        model.set_gradient_divide_factor(1.0)                      # sums, as Megatron's per-token loss
        loss_fn(model(x), y).backward()
        total = [local_piece(p.grad).clone() for p in model.parameters()]
        model.scale_gradients(0.25)
        quarter = [local_piece(p.grad).clone() for p in model.parameters()]
        out[(strategy, "sum")] = max(float((t - world_size * m).abs().max()) for t, m in zip(total, mean) if m.numel())
        out[(strategy, "scale")] = max(float((q - 0.25 * t).abs().max()) for q, t in zip(quarter, total) if t.numel())
        # explicit reduction after no_sync, asynchronously then waited
        model.zero_grad()
        model.set_gradient_divide_factor(None)
        with model.no_sync():
            loss_fn(model(x), y).backward()
        model.reduce_gradients(async_op=True)
        model.wait_gradient_reduction()
        again = [local_piece(p.grad).clone() for p in model.parameters()]
        out[(strategy, "reduce_gradients")] = max(float((a - m).abs().max()) for a, m in zip(again, mean) if m.numel())
        # one owner per pending collective: a ZeRO-1/2 refresh is not a ZeRO-3 unshard
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.step()
        groups = model._fsdp_engine.groups
        out[(strategy, "owners")] = (any(g.pending_refresh is not None for g in groups),
                                     any(g._pending_unshard is not None for g in groups),
                                     hasattr(groups[0], "_pending_reduce"))
        model.unshard()
        out[(strategy, "after_unshard")] = any(g.pending_refresh is not None for g in groups)
        with torch.no_grad():
            before = model(x)
            model.reshard()
            out[(strategy, "reshard_keeps_forward")] = float((model(x) - before).abs().max())
    return out


def test_core_verbs_for_the_adapter():
    for out in run_distributed(verbs_worker, 2):
        for strategy in STRATEGY_NAMES:
            assert out[(strategy, "sum")] < 1e-6, strategy
            assert out[(strategy, "scale")] == 0.0, strategy
            assert out[(strategy, "reduce_gradients")] < 1e-6, strategy
            refresh_pending = strategy in ("optim", "optim_grads")
            assert out[(strategy, "owners")] == (refresh_pending, False, False), strategy
            assert out[(strategy, "after_unshard")] is False
            assert out[(strategy, "reshard_keeps_forward")] == 0.0


def misordered_worker(rank, world_size):
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim", unit_modules=[Block])
    x, y = make_batches(0, rank, 1)[0]
    with model.no_sync():
        out = model(x)
    try:
        model(x)
        return None
    except RuntimeError as err:
        message = str(err)
    loss_fn(out, y).backward()      # the pending backward still works after the refused forward
    model.wait_gradient_reduction()
    return message, all(p.grad is not None for p in model.parameters() if local_piece(p).numel())


def test_a_misordered_forward_names_the_phase_it_found():
    for message, grads in run_distributed(misordered_worker, 2):
        assert "forward called again before the backward of the previous forward" in message
        assert "found phase 'awaiting backward (no_sync)'" in message
        assert grads
