"""Saves killed for real (issue item 4): a rank ends with ``os._exit`` in the middle of
``save_checkpoint``, the way a crashed node ends, at three points: while rank 1 writes its shard
file, between rank 0's two renames, and while rank 0 deletes ``ckpt.old`` (which used to break
every later save with ``OSError: [Errno 39] Directory not empty: 'ckpt' -> 'ckpt.old'``); and
rank 1 is SIGKILLed while the writer thread of ``async_save_checkpoint`` writes its shard (issue
64). Then a new job loads the newest complete checkpoint, saves again and loads that. The rank
that survived a kill must stop with an error, long before the process-group timeout.

Two processes (one per rank) are started once; each forks one child per crash point, and the two
children of a point form that point's process group, so the test pays for importing torch once.
test_checkpoint_guarantees.py covers every crash point from the state it leaves on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_fsdp_v2 import ChecksummedFileSystemWriter, async_save_checkpoint, load_checkpoint, save_checkpoint

from .dist_utils import run_distributed
from .checkpoint_helpers import snapshot
from .test_checkpoint_guarantees import build, same, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILLED = 17                                        # the victim's exit status (os._exit)
TIMEOUT_S = 60                                     # the crashed job's process-group timeout
VICTIM = {"writing": 1, "between_renames": 0, "deleting_old": 0, "async_writing": 1}
NEWEST_COMPLETE = {"writing": "A", "between_renames": "B", "deleting_old": "B", "async_writing": "A"}
EXIT_STATUS = {"async_writing": -signal.SIGKILL}   # else KILLED


def _die(root, point=""):
    with open(f"{root}/killed_at", "w") as f:
        f.write(repr(time.time()))
    if point in EXIT_STATUS:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(KILLED)


def _arm(point, root):
    """Make this (victim) process end at ``point`` of the next save."""
    if point in ("writing", "async_writing"):      # after half of its shard file is on disk
        write = ChecksummedFileSystemWriter.write_data

        def write_half_then_die(self, plan, planner):
            write(self, plan, planner)
            directory = os.fspath(self.path)
            for name in os.listdir(directory):
                if name.startswith(f"__{dist.get_rank()}_"):
                    with open(os.path.join(directory, name), "r+b") as f:
                        f.truncate(os.path.getsize(f.name) // 2)
            _die(root, point)
        ChecksummedFileSystemWriter.write_data = write_half_then_die
    elif point == "between_renames":               # ckpt is ckpt.old now, ckpt.tmp not yet ckpt
        rename = os.rename

        def rename_then_die(src, dst, *args, **kwargs):
            rename(src, dst, *args, **kwargs)
            if os.fspath(dst).endswith("ckpt.old"):
                _die(root)
        os.rename = rename_then_die
    elif point == "deleting_old":                  # some of ckpt.old deleted
        rmtree = shutil.rmtree

        def delete_some_then_die(path, *args, **kwargs):
            if not os.fspath(path).endswith("ckpt.old"):
                return rmtree(path, *args, **kwargs)
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
            _die(root)
        shutil.rmtree = delete_some_then_die


def _crashing_job(rank, world, root, point, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    path = f"{root}/ckpt"
    model, opt = build()
    train(model, opt, range(1), rank, world)
    save_checkpoint(path, model, opt)
    torch.save(snapshot(model, opt), f"{root}/A_{rank}.pt")
    train(model, opt, range(1, 2), rank, world)
    torch.save(snapshot(model, opt), f"{root}/B_{rank}.pt")
    dist.barrier()
    if rank == VICTIM[point]:
        _arm(point, root)
    if point == "async_writing":
        async_save_checkpoint(path, model, opt).result()
    else:
        save_checkpoint(path, model, opt)


def crash_main(rank: int, world: int, base: str, points: list) -> None:
    """One rank of the crashing jobs (run with ``python -c``): for each point, a forked child runs
    the save that is killed; ``report_<rank>.json`` records how each child ended."""
    report = {}
    for point in points:
        root = f"{base}/{point}"
        os.makedirs(root, exist_ok=True)
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                _crashing_job(rank, world, root, point, f"{base}/{point}.init")
            except BaseException:  # noqa: BLE001 - the survivor's error, reported
                with open(f"{root}/error_{rank}.txt", "w") as f:
                    f.write(traceback.format_exc())
                status = 1
            with open(f"{root}/ended_{rank}", "w") as f:
                f.write(repr(time.time()))
            os._exit(status)
        _, status = os.waitpid(pid, 0)
        report[point] = os.waitstatus_to_exitcode(status)
    with open(f"{base}/report_{rank}.json", "w") as f:
        json.dump(report, f)


def _next_job(rank, world, base, points):
    """Load, save and load again at every crash point; which snapshot the first load equals."""
    out = {}
    for point in points:
        root = f"{base}/{point}"
        saved = {label: torch.load(f"{root}/{label}_{rank}.pt", weights_only=True) for label in ("A", "B")}
        model, opt = build(seed=1)
        load_checkpoint(f"{root}/ckpt", model, opt)
        loaded = next((label for label, state in saved.items() if same(snapshot(model, opt), state)), "neither")
        left = sorted(name for name in os.listdir(root) if name.startswith("ckpt"))
        train(model, opt, range(2, 3), rank, world)
        save_checkpoint(f"{root}/ckpt", model, opt)
        again, again_opt = build(seed=2)
        load_checkpoint(f"{root}/ckpt", again, again_opt)
        final = sorted(name for name in os.listdir(root) if name.startswith("ckpt"))
        out[point] = {"loaded": loaded, "left": left, "final": final,
                      "next_save_loads": same(snapshot(again, again_opt), snapshot(model, opt))}
        dist.barrier()
    return out


def test_a_killed_save_leaves_the_newest_complete_checkpoint_and_the_next_save_works(tmp_path):
    points = list(VICTIM)
    code = ("from tests.unit.test_checkpoint_crash import crash_main; "
            f"crash_main({{}}, 2, {str(tmp_path)!r}, {points!r})")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ranks = [subprocess.Popen([sys.executable, "-c", code.format(rank)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    logs = [rank.communicate(timeout=len(points) * (TIMEOUT_S + 60))[0].decode(errors="replace") for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], logs
    reports = [json.load(open(tmp_path / f"report_{rank}.json")) for rank in range(2)]
    for point, victim in VICTIM.items():
        root = tmp_path / point
        assert reports[victim][point] == EXIT_STATUS.get(point, KILLED), (point, reports, logs)
        survivor = 1 - victim
        assert reports[survivor][point] == 1, (point, reports)       # it raised; it did not hang or succeed
        waited = float((root / f"ended_{survivor}").read_text()) - float((root / "killed_at").read_text())
        assert waited < TIMEOUT_S / 2, f"{point}: rank {survivor} stopped {waited:.1f} s after rank {victim} died"

    results = run_distributed(_next_job, 2, str(tmp_path), points)
    for rank, out in enumerate(results):
        for point in points:
            assert out[point]["loaded"] == NEWEST_COMPLETE[point], (rank, point, out[point])
            assert out[point]["final"] == ["ckpt"] and out[point]["next_save_loads"], (rank, point, out[point])
    assert results[0]["deleting_old"]["left"] == ["ckpt", "ckpt.old"]      # what broke every later save before
    assert results[0]["between_renames"]["left"] == ["ckpt.old", "ckpt.tmp"]
