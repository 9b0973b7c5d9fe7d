"""Threads end before the process group or the interpreter goes (comm/thread_shutdown.py): the
offloaded-step thread is joined at ``destroy_process_group`` and by an ``atexit`` callback ([Note:
threads at exit]), and gloo's worker threads are joined inside ``destroy_process_group`` because our
meshes let the group go ([Note: gloo's threads at exit]). Either, killed inside torch's C++ code
during finalization, ends a finished run with SIGABRT, "terminate called without an active
exception". benchmarks/exit_stress.py counts abnormal exits over many 2-rank runs of the README loop."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading

import torch
import torch.distributed as dist

from megatron_fsdp_v2 import OffloadPolicy, fully_shard
from megatron_fsdp_v2.comm.thread_shutdown import release_group_references
from megatron_fsdp_v2.row_sharded import mesh_of_group
from testing.thread_steps import observe_thread_steps

from .dist_utils import run_distributed
from .models import Block, UnevenNet, make_batches
from .scenarios import loss_fn

THREAD_NAME = "megatron_fsdp_v2 offloaded steps"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_offloaded(rank, group=None, steps=3):
    """(model, optimizer, the thread's GroupStepRecords so far and to come) after ``steps`` steps."""
    torch.manual_seed(0)
    model = fully_shard(UnevenNet(), sharding_strategy="optim_grads_params", unit_modules=[Block],
                        process_group=group,
                        offload=OffloadPolicy(fraction=1.0, step_in_backward=True, release_after_gather=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    stepped = observe_thread_steps(model)
    for step in range(steps):
        x, y = make_batches(step, rank, 1)[0]
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, stepped


def _stepping_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def destroy_worker(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    model, _, stepped = _train_offloaded(rank, group)
    threads = _stepping_threads()
    native = [t.native_id for t in threads]
    dist.destroy_process_group(group)
    return (len(stepped), len(threads), len(_stepping_threads()),
            [n for n in native if os.path.exists(f"/proc/self/task/{n}")])


def test_destroy_process_group_joins_the_offloaded_step_thread():
    for stepped, before, after, tasks_left in run_distributed(destroy_worker, 2):
        assert stepped > 0 and before == 1          # the thread ran
        assert after == 0 and tasks_left == []      # gone, the operating-system thread too


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time

    NATIVE = []

    def check():
        # registered before the package is imported, so it runs after the package's own atexit callbacks
        alive = [t for t in threading.enumerate() if t.name == {name!r}]
        tasks = [n for n in NATIVE if os.path.exists(f"/proc/self/task/{{n}}")]
        print(f"at exit: {{len(alive)}} stepping threads, {{len(tasks)}} os threads, {{len(stepped)}} group steps",
              flush=True)
        if alive or tasks:
            os._exit(3)

    atexit.register(check)
    sys.path.insert(0, {root!r})
    import torch.distributed as dist
    import megatron_fsdp_v2.offload.backward_steps as offload_steps
    from tests.unit.models import make_batches
    from tests.unit.scenarios import loss_fn
    from tests.unit.test_clean_exit import _stepping_threads, _train_offloaded

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    model, optimizer, stepped = _train_offloaded(0)
    NATIVE.extend(t.native_id for t in _stepping_threads())
    print(f"groups stepped on the thread: {{len(stepped)}}", flush=True)
    step_subset = offload_steps._step_subset

    def slow_step(optimizer, params):     # each group's step takes 0.3 s: the thread is busy at exit
        time.sleep(0.3)
        step_subset(optimizer, params)

    offload_steps._step_subset = slow_step
    x, y = make_batches(5, 0, 1)[0]
    loss_fn(model(x), y).backward()       # hands the 4 groups to the thread
    # the program ends here, before optimizer.step() and with no destroy_process_group (an exception
    # after backward would end it the same way): the interpreter exits while the thread steps
""")


def test_interpreter_exit_joins_the_offloaded_step_thread(tmp_path):
    script = tmp_path / "exit_with_thread.py"
    script.write_text(EXIT_SCRIPT.format(name=THREAD_NAME, root=ROOT))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = done.stdout + done.stderr
    assert "groups stepped on the thread: 8" in done.stdout, output        # 2 steps x 4 groups
    # joined at exit, after stepping the 4 groups handed over by the last backward
    assert "at exit: 0 stepping threads, 0 os threads, 12 group steps" in done.stdout, output
    assert done.returncode == 0, output


def test_destroy_process_group_joins_gloos_worker_threads_after_the_readme_loop(tmp_path):
    """The README loop (benchmarks/exit_stress.py's worker, one rank) under ZeRO-3: gloo's 2 worker
    threads are gone once ``destroy_process_group`` returns. While our meshes kept the group (the
    script's --unfixed), both lived on into interpreter finalization, where the abort happens."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "exit_stress.py"), "--world-size", "1", "--worker",
         "optim_grads_params", "0", str(tmp_path / "init"), str(tmp_path)], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = done.stdout + done.stderr
    assert "rank 0 done, gloo worker threads 2 -> 0 at destroy_process_group" in done.stdout, output
    assert done.returncode == 0, output


def release_worker(rank, world_size):
    """The registries of a mesh of ours over a subgroup, of its unpickled copy (what ``torch.load``
    of a parameter makes) and of a mesh over the default group, before and after the subgroup's
    references are released."""
    sub = dist.new_group(list(range(world_size)))
    mesh, world_mesh = mesh_of_group(sub, torch.device("cpu")), mesh_of_group(None, torch.device("cpu"))
    copy = pickle.loads(pickle.dumps(mesh))
    names = lambda: [sorted(m._pg_registry) for m in (mesh, copy, world_mesh)]     # noqa: E731
    before = names()
    release_group_references(sub, copies=False)         # destroy_process_group(sub)
    ours_only = names()
    release_group_references(sub, copies=True)          # destroy_process_group(): copies too
    after = names()
    dist.destroy_process_group(sub)
    return sub.group_name, dist.group.WORLD.group_name, before, ours_only, after


def test_destroying_a_group_releases_our_meshes_and_at_the_end_their_copies_only_of_it():
    for sub, world, before, ours_only, after in run_distributed(release_worker, 2):
        assert before == [[sub], [sub], [world]]
        assert ours_only == [[], [sub], [world]]
        assert after == [[], [], [world]]
