"""The persistent gloo worker pool behind ``run_distributed`` (tests/dist_pool.py): reuse, isolation
between cases, and faults (a worker exception names its rank, a hang times out, the pool respawns)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests import dist_pool

from .dist_utils import DistributedTimeoutError, DistributedWorkerError, run_distributed

WORLD = 2


def _pid_and_sum(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return os.getpid(), t.item(), dist.get_world_size()


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()          # rank 0 waits in a collective for the failed rank
    return rank


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    dist.barrier()
    return rank


def _abort_on_rank_1(rank, world_size):
    """Dies as gloo's std::terminate does (SIGABRT), inside a named function."""
    if rank == 1:
        os.abort()
    dist.barrier()
    return rank


def _dirty(rank, world_size):
    """Changes process-wide state the pool must reset before the next case."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.autograd.set_detect_anomaly(True)
    torch.manual_seed(1234 + rank)
    os.environ["DIST_POOL_TEST_LEAK"] = "1"
    os.chdir("/")
    return os.getpid()


def _observe(rank, world_size):
    return dict(pid=os.getpid(), dtype=torch.get_default_dtype(), grad=torch.is_grad_enabled(),
                threads=torch.get_num_threads(), anomaly=torch.is_anomaly_enabled(), rand=torch.rand(2),
                env="DIST_POOL_TEST_LEAK" in os.environ, cwd=os.getcwd())


def _destroy_default_group(rank, world_size):
    dist.barrier()
    dist.destroy_process_group()
    return os.getpid()


def _start_child_then_raise(rank, world_size):
    """Like Megatron's checkpoint writer (a multiprocessing Manager): a worker that starts a process."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    raise ValueError(f"child pid {child.pid} on rank {rank}")


def _tensors(rank, world_size, x):
    return {"x": x * (rank + 1), "view": x[1:], "rank": rank}


def _pids(world_size=WORLD, **kwargs):
    return [pid for pid, _, _ in run_distributed(_pid_and_sum, world_size, **kwargs)]


def test_consecutive_calls_reuse_the_same_workers():
    first = run_distributed(_pid_and_sum, WORLD)
    second = run_distributed(_pid_and_sum, WORLD)
    assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second]
    assert len({pid for pid, _, _ in first}) == WORLD and os.getpid() not in {pid for pid, _, _ in first}
    assert [(s, w) for _, s, w in second] == [(3.0, WORLD)] * WORLD       # the group is still initialised
    assert dist_pool.worker_pids(WORLD) == [pid for pid, _, _ in second]


def test_worker_exception_names_the_rank_and_respawns():
    before = _pids()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom from rank 1") as info:
        run_distributed(_raise_on_rank_1, WORLD, timeout=60)
    assert time.monotonic() - start < 30       # rank 0, stuck in the barrier, does not hold it up
    err = info.value
    assert isinstance(err, DistributedWorkerError)
    assert sorted(err.failures) == [1] and err.unfinished == [0]
    assert "rank 1:\nTraceback" in str(err) and "in _raise_on_rank_1" in str(err)
    assert dist_pool.worker_pids(WORLD) is None                      # that pool is gone
    after = _pids()
    assert not set(after) & set(before)


def test_a_rank_killed_by_a_signal_reports_its_python_stack():
    with pytest.raises(DistributedWorkerError, match="exit code -6") as info:
        run_distributed(_abort_on_rank_1, WORLD, timeout=60)
    note = info.value.failures[1]          # rank 0 may also fail, its peer gone, before the pool is killed
    assert "died without a result" in note and "Fatal Python error: Aborted" in note
    assert "in _abort_on_rank_1" in note
    assert [s for _, s, _ in run_distributed(_pid_and_sum, WORLD)] == [3.0, 3.0]


def test_a_hang_times_out_and_the_next_call_gets_a_fresh_pool():
    before = _pids()                           # the pool is started: the timeout counts the case only
    timeout = 5.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 5 s") as info:
        run_distributed(_hang_on_rank_1, WORLD, timeout=timeout)
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 5, elapsed
    err = info.value
    assert isinstance(err, DistributedTimeoutError) and isinstance(err, RuntimeError)
    assert err.unfinished == [0, 1]
    assert "in _hang_on_rank_1" in str(err)    # the stacks of the stuck ranks
    after = run_distributed(_pid_and_sum, WORLD)
    assert [s for _, s, _ in after] == [3.0, 3.0]
    assert not {pid for pid, _, _ in after} & set(before)


def test_process_state_is_reset_between_cases():
    pids = run_distributed(_dirty, WORLD)
    seen = run_distributed(_observe, WORLD)
    assert [s["pid"] for s in seen] == pids
    for s in seen:
        assert (s["dtype"], s["grad"], s["threads"], s["anomaly"], s["env"]) == (torch.float32, True, 1, False, False)
        assert s["cwd"] == os.getcwd()
        assert torch.equal(s["rand"], torch.rand(2, generator=torch.Generator().manual_seed(0)))


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")   # a zombie waiting for init counts as gone
    except FileNotFoundError:
        return True


def test_a_killed_pool_takes_the_processes_its_workers_started_along():
    with pytest.raises(DistributedWorkerError) as info:
        run_distributed(_start_child_then_raise, WORLD)
    children = [int(pid) for pid in re.findall(r"child pid (\d+) on rank", str(info.value))]
    assert len(set(children)) == WORLD
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in children), children


def test_destroying_the_default_group_retires_the_pool():
    with pytest.warns(RuntimeWarning, match="destroyed or replaced the default process group"):
        pids = run_distributed(_destroy_default_group, WORLD)
    assert dist_pool.worker_pids(WORLD) is None
    assert not set(_pids()) & set(pids)


def test_fresh_runs_in_new_processes_and_leaves_the_pool_alone():
    pool = _pids()
    fresh = _pids(fresh=True)
    assert not set(fresh) & set(pool)
    assert _pids() == pool


def test_tensor_results_round_trip():
    x = torch.arange(4.0)
    out = run_distributed(_tensors, WORLD, x)
    for rank, result in enumerate(out):
        assert torch.equal(result["x"], x * (rank + 1)) and torch.equal(result["view"], x[1:])
        assert result["rank"] == rank


def test_unpicklable_function_fails_in_the_parent():
    with pytest.raises(Exception, match="(?i)pickle|local object|lambda"):
        run_distributed(lambda rank, world_size: rank, WORLD)
