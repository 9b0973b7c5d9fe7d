"""Helpers shared by the checkpoint tests (test_checkpoint.py, test_checkpoint_guarantees.py,
test_checkpoint_safety.py)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from megatron_fsdp_v2.row_sharded import local_piece

from .dist_utils import run_distributed


def failure(fn) -> str:
    """What ``fn()`` raised, as ``"Type: message"``, or ``"no error"``."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def run_parts(rank, world, root, parts) -> dict:
    """{name: fn(rank, world, f"{root}/{name}")} for the (name, fn) pairs of ``parts`` in order, each
    in a directory of its own that rank 0 makes before any rank starts the part."""
    results = {}
    for name, fn in parts:
        if rank == 0:
            os.makedirs(f"{root}/{name}", exist_ok=True)
        dist.barrier()
        results[name] = fn(rank, world, f"{root}/{name}")
    return results


def distributed_fixture(worker, label: str, world_size: int = 2):
    """A module-scoped fixture: the per-rank results of ``worker(rank, world_size, root)``, ``root``
    a fresh directory named after ``label``. Assign it to the fixture's name in the test module."""

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        return run_distributed(worker, world_size, str(tmp_path_factory.mktemp(label)))

    return results


def snapshot(model, opt):
    """Full weights, and this rank's optimizer state by parameter name (local pieces, plain tensors)."""
    return model.full_state_dict(), {n: {k: local_piece(v).clone() for k, v in opt.state[p].items()}
                                     for n, p in model.named_parameters()}
