"""Run a function on N gloo ranks (CPU) in a pool of worker processes reused across tests.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every rank of a
gloo group and returns the per-rank results. Starting a process that imports torch (and Megatron)
costs seconds, so the processes are kept: one pool per world size, spawned (not forked) at its
first use, its default process group initialised once and kept for the whole pytest session (shut
down at interpreter exit). Every test path (``tests/unit/dist_utils.py``, ``tests/megatron_cpu.py``)
goes through this module.

Contract for ``fn`` and its arguments / results:

* ``fn`` is a module-level function (pickled by reference and imported in the worker); ``args`` and
  the results are serialised with ``torch.save`` / ``torch.load(weights_only=False)``: anything
  picklable, tensors included.
* On entry ``torch.distributed`` is initialised (gloo, ``world_size`` ranks, this process's rank),
  and per-process state a previous case could have changed is reset (``_ProcessState.reset``):
  seeds 0 (torch, random, numpy; a fresh process has random seeds, so seed explicitly anyway),
  default dtype float32, default device CPU, grad mode on, anomaly mode off, deterministic
  algorithms off, 1 thread, float32 matmul precision "highest", and the environment, working
  directory, warning filters and SIGINT/SIGTERM handlers of the worker's start. Process groups
  created by a previous case (``dist.new_group``) stay alive.
* After a case that succeeded, Megatron state it left set is torn down (``_megatron_cleanup``):
  the parallel state, Megatron-LM's global variables and micro-batch calculator (which
  ``destroy_global_vars()`` does not reset), the rerun state machine (``initialize_megatron``), the
  checkpoint version seen by ``load_checkpoint``.
* A case must leave the default process group alone. If it destroys or replaces it, or leaves
  Megatron's CPU patches applied (``patch_megatron_for_cpu`` outside its ``with``), its result is
  still returned but the pool is retired (with a warning) and respawned at the next call.
  ``fresh=True`` runs ``fn`` in newly spawned processes that are shut down afterwards (the
  behaviour before the pool): for tests whose claim is about new processes (e.g. resuming from a
  checkpoint) or that change process-wide state the resets above do not cover.
* A result's DTensors arrive as their local pieces (``to_local()``): the parent has no process group.
* Workers are process-group leaders: killing a pool also kills what its workers started (e.g. the
  ``multiprocessing.Manager`` Megatron's checkpoint writer keeps), and a worker whose parent died
  (pytest killed) kills its group within a second instead of waiting in a collective.

Faults: an exception on any rank, a rank that dies, or a timeout retires the pool (the other ranks
may be stuck in a collective waiting for the failed one); the next call spawns a new one. A worker
exception is re-raised in the parent as ``DistributedWorkerError`` (a ``RuntimeError``) naming the
rank and carrying its traceback; a hang becomes ``DistributedTimeoutError`` (``RuntimeError`` and
``TimeoutError``) "timed out after N s" with the Python stacks of the ranks that did not finish.
``timeout`` counts from the moment ``fn`` is handed to the workers; starting a pool has its own
limit (``DIST_POOL_START_TIMEOUT_S``, default 300 s).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["run_distributed", "free_port", "shutdown_pools", "worker_pids", "DistributedWorkerError",
           "DistributedTimeoutError"]

START_TIMEOUT_S = float(os.environ.get("DIST_POOL_START_TIMEOUT_S", "300"))
ERROR_GRACE_S = 2.0      # after a rank fails: how long the others get to report before the pool is killed
STACK_DUMP_WAIT_S = 0.5  # after a timeout: how long the stuck ranks get to write their Python stacks


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for env:// / tcp:// rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistributedWorkerError(RuntimeError):
    """A rank raised (or died). ``failures``: {rank: traceback text}; ``unfinished``: ranks that had
    not reported when the pool was killed (usually waiting in a collective for the failed rank)."""

    def __init__(self, message: str, failures: Dict[int, str], unfinished: List[int]):
        super().__init__(message)
        self.failures = failures
        self.unfinished = unfinished


class DistributedTimeoutError(RuntimeError, TimeoutError):
    """No result from every rank within the timeout; ``unfinished``: the ranks still running."""

    def __init__(self, message: str, unfinished: List[int]):
        super().__init__(message)
        self.unfinished = unfinished


# ---------------------------------------------------------------------------------------------
# Serialisation (both directions): torch.save keeps tensors compact and shares storages.
# ---------------------------------------------------------------------------------------------


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


class _ProcessState:
    """What a worker restores before every case (captured when the worker starts)."""

    def __init__(self):
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.warning_filters = list(warnings.filters)
        self.signal_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def reset(self):
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        if warnings.filters != self.warning_filters:
            warnings.filters[:] = self.warning_filters
            if hasattr(warnings, "_filters_mutated"):   # invalidates the "already warned" registries
                warnings._filters_mutated()
        for sig, handler in self.signal_handlers.items():   # e.g. Megatron-LM's exit-signal handlers
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        _reset_process_state()


def _reset_process_state():
    torch.manual_seed(0)
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")
    torch.set_flush_denormal(False)
    _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """DTensor caches op shardings by spec, and two DeviceMeshes over the same ranks compare equal
    whatever their process group: a case could get an output spec cached by an earlier case, whose
    group the pool has destroyed since (torch 2.11: "Could not resolve the process group registered
    under the name 1" in FSDP2's full state dict)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (getattr(propagator, "propagate_op_sharding", None),
                   getattr(propagator, "_propagate_tensor_meta_cached", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


# Functions ``patch_megatron_for_cpu`` (tests/megatron_cpu.py) replaces, as (module, attribute path).
_PATCHED_MEGATRON_FUNCTIONS = (
    ("megatron.core.utils", "GlobalMemoryBuffer.get_tensor"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
)


def _megatron_patches_left() -> List[str]:
    """Megatron globals that are not Megatron's own: CPU patches still applied after a case."""
    left = []
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            shim = getattr(module, "__dict__", {}).get("torch")
            if shim is not None and shim is not torch and getattr(shim, "__name__", None) == "torch":
                left.append(f"{name}.torch")
    for name, path in _PATCHED_MEGATRON_FUNCTIONS:
        obj = sys.modules.get(name)
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        owner = getattr(obj, "__module__", None) or ""
        if obj is not None and not owner.startswith("megatron."):
            left.append(f"{name}.{path} (from {owner})")
    return left


def _megatron_cleanup() -> Optional[str]:
    """Tear down Megatron state a case left behind; a reason the worker can't be reused, or None."""
    if "megatron.core" not in sys.modules:
        return None
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    # Megatron-LM's per-run globals (what its own tests reset between runs). destroy_global_vars()
    # leaves the micro-batch calculator set: the next set_global_variables() would assert.
    gv = sys.modules.get("megatron.training.global_vars")
    if gv is not None:
        gv.unset_global_variables()
    microbatches = sys.modules.get("megatron.core.num_microbatches_calculator")
    if microbatches is not None:
        microbatches.unset_num_microbatches_calculator()
    rerun = sys.modules.get("megatron.core.rerun_state_machine")
    if rerun is not None:              # set by initialize_megatron (a whole pretrain() run)
        rerun.destroy_rerun_state_machine()
    checkpointing = sys.modules.get("megatron.training.checkpointing")
    if checkpointing is not None:      # set by load_checkpoint; a later load of another version would assert
        checkpointing._CHECKPOINT_VERSION = checkpointing._LOADED_ITERATION = None
    left = _megatron_patches_left()
    if left:
        return f"Megatron's CPU patches are still applied ({', '.join(left)})"
    return None


def _destroy_subgroups(world) -> None:
    """Destroy the process groups a case left registered besides the world (Megatron's
    ``destroy_model_parallel`` only forgets its groups). Each gloo group keeps its own threads, so a
    worker that ran many model-parallel cases would otherwise carry thousands of idle threads, and
    a 2-core machine spends its time scheduling them."""
    import torch.distributed as dist

    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


def _local_pieces(obj):
    """A result with every DTensor replaced by this rank's local piece: a DTensor names its process
    group, which the parent does not have (ranks return what they hold, as plain tensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return type(obj)((k, _local_pieces(v)) for k, v in obj.items()) if type(obj) is not dict \
            else {k: _local_pieces(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_local_pieces(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local_pieces(v) for v in obj)
    return obj


def _send(conn, message) -> None:
    try:
        payload = _dumps(_local_pieces(message))
    except BaseException:  # noqa: BLE001 - an unpicklable result is this rank's error
        payload = _dumps(("error", "the result could not be serialised:\n" + traceback.format_exc(), None))
    conn.send_bytes(payload)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose parent is gone (pytest killed) may be stuck in a collective: end its group."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def _worker_main(rank: int, world_size: int, init_file: str, conn, stack_file: str) -> None:
    import torch.distributed as dist

    try:
        os.setpgrp()          # the parent kills this process group: the worker and whatever it started
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's (it kills the pool)
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True,
                         name="dist_pool-parent-watch").start()
        stacks = open(stack_file, "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        # a fatal signal (gloo's std::terminate is SIGABRT) writes every thread's Python stack to the
        # same file, which the parent's death note quotes
        faulthandler.enable(file=stacks, all_threads=True)
        torch.set_num_threads(1)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        world = dist.group.WORLD
    except BaseException:  # noqa: BLE001 - reported to the parent
        _send(conn, ("error", traceback.format_exc(), None))
        return
    state = _ProcessState()
    _send(conn, ("ready", os.getpid(), None))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):        # the parent is gone
            break
        result = None
        try:
            task = _loads(data)
            if task is None:               # shutdown
                break
            fn, args = task
            state.reset()
            result = ("ok", fn(rank, world_size, *args))
        except BaseException:  # noqa: BLE001 - reported to the parent
            result = ("error", traceback.format_exc())
        finally:
            task = fn = args = None
        retire = None
        if not dist.is_initialized() or dist.group.WORLD is not world:
            retire = "the case destroyed or replaced the default process group"
        elif result[0] == "ok":            # after an error the parent kills the pool: report it at once
            try:
                retire = _megatron_cleanup()
                _destroy_subgroups(world)
            except BaseException:  # noqa: BLE001
                retire = "cleaning up Megatron's state failed:\n" + traceback.format_exc()
        try:
            _send(conn, (*result, retire))
        except (BrokenPipeError, OSError):
            break
        result = None
        gc.collect()
        if retire:
            break
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - exiting anyway
        pass


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


def _describe(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class _Pool:
    """``world_size`` spawned workers joined by one gloo group; one case at a time."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"dist_pool_ws{world_size}_")
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs, self.stack_files = [], [], []
        self.pids: List[int] = []
        self.alive = True
        self.exit_requested = False
        init_file = os.path.join(self.tmp, "init")
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                stack_file = os.path.join(self.tmp, f"stacks_rank{rank}.txt")
                proc = ctx.Process(target=_worker_main, name=f"dist_pool-ws{world_size}-rank{rank}",
                                   args=(rank, world_size, init_file, child_end, stack_file))
                proc.start()
                child_end.close()
                self.conns.append(parent_end)
                self.procs.append(proc)
                self.stack_files.append(stack_file)
            replies, unfinished = self._collect(time.monotonic() + START_TIMEOUT_S, stop_on_error=True)
            failures = {r: v for r, (kind, v, _) in replies.items() if kind != "ready"}
            if failures or unfinished:
                detail = "".join(f"\nrank {r}:\n{failures[r]}" for r in sorted(failures))
                raise RuntimeError(f"starting {world_size} gloo workers failed: ranks {sorted(failures)} failed, "
                                   f"ranks {unfinished} were not ready (limit {START_TIMEOUT_S:g} s){detail}")
            self.pids = [replies[r][1] for r in range(world_size)]
        except BaseException:
            self.kill()
            raise

    def _collect(self, deadline: float, stop_on_error: bool):
        """Read one reply per rank until ``deadline``; after a failure (when ``stop_on_error``) wait
        at most ``ERROR_GRACE_S`` more. Returns ({rank: reply}, unfinished ranks)."""
        replies: Dict[int, tuple] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while waiting:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            ready = multiprocessing.connection.wait(
                list(waiting) + [s for s, r in sentinels.items() if r not in replies], timeout)
            for obj in ready:
                if obj in waiting:
                    rank = waiting.pop(obj)
                    try:
                        replies[rank] = _loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        replies[rank] = ("error", self._death_note(rank), None)
                    except BaseException:  # noqa: BLE001 - e.g. a result class the parent can't import
                        replies[rank] = ("error", "the result could not be loaded in the parent:\n"
                                         + traceback.format_exc(), None)
                elif sentinels.get(obj) is not None:
                    rank = sentinels[obj]
                    conn = self.conns[rank]
                    if conn in waiting and not conn.poll():   # died without a reply
                        waiting.pop(conn)
                        replies[rank] = ("error", self._death_note(rank), None)
            if stop_on_error and any(reply[0] == "error" for reply in replies.values()):
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        return replies, sorted(waiting.values())

    def _death_note(self, rank: int) -> str:
        """How the worker of ``rank`` died, with the Python stacks faulthandler wrote at a fatal signal."""
        proc = self.procs[rank]
        proc.join(1.0)
        note = f"the worker process (pid {proc.pid}) died without a result, exit code {proc.exitcode}"
        try:
            with open(self.stack_files[rank]) as f:
                stacks = f.read().strip()
        except OSError:
            stacks = ""
        return f"{note}\nits Python stacks at the fatal signal:\n{stacks}" if stacks else note

    def _stacks(self, ranks: List[int]) -> str:
        """Python stacks of ``ranks`` (faulthandler on SIGUSR1), best effort."""
        for rank in ranks:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(STACK_DUMP_WAIT_S)
        out = []
        for rank in ranks:
            try:
                with open(self.stack_files[rank]) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            out.append(f"rank {rank} stacks:\n{text or '(none written)'}")
        return "\n".join(out)

    def run(self, fn: Callable, args: tuple, timeout: float) -> List[Any]:
        payload = _dumps((fn, args))      # fails here, before any rank starts, if not picklable
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as exc:
            self.kill()
            raise RuntimeError(f"could not hand {_describe(fn)} to the {self.world_size} workers: {exc}") from exc
        try:
            replies, unfinished = self._collect(time.monotonic() + timeout, stop_on_error=True)
        except BaseException:              # e.g. Ctrl-C: the workers are still running the case
            self.kill()
            raise
        failures = {r: reply[1] for r, reply in sorted(replies.items()) if reply[0] != "ok"}
        if failures:
            self.kill()
            message = f"distributed worker failed: {_describe(fn)} on {self.world_size} ranks\n" + "\n".join(
                f"rank {r}:\n{text}" for r, text in failures.items())
            if unfinished:
                message += (f"\nranks {unfinished} had not finished {ERROR_GRACE_S:.0f} s later (probably waiting "
                            "in a collective for the failed rank); the pool was restarted")
            raise DistributedWorkerError(message, failures, unfinished)
        if unfinished:
            stacks = self._stacks(unfinished)
            self.kill()
            raise DistributedTimeoutError(
                f"{_describe(fn)} on {self.world_size} ranks timed out after {timeout:g} s: ranks {unfinished} "
                f"did not finish (ranks {sorted(replies)} did); the pool was restarted.\n{stacks}", unfinished)
        reasons = {reply[2] for reply in replies.values() if reply[2]}
        if reasons:
            self.close()
            warnings.warn(f"{_describe(fn)}: worker pool of {self.world_size} retired after the case: "
                          f"{'; '.join(sorted(reasons))}", RuntimeWarning, stacklevel=3)
        return [replies[r][1] for r in range(self.world_size)]

    def healthy(self) -> bool:
        return self.alive and all(proc.is_alive() for proc in self.procs)

    def request_exit(self) -> None:
        """Ask the workers to leave their loop (they destroy the group and exit normally)."""
        if not self.alive or self.exit_requested:
            return
        self.exit_requested = True
        payload = _dumps(None)
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except OSError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Ask the workers to exit; kill what is still running after ``timeout``."""
        if not self.alive:
            return
        self.request_exit()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every worker's process group (the worker and anything it started), then reap."""
        self.alive = False
        for proc in self.procs:
            if proc.pid is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # its own group (os.setpgrp in _worker_main)
            except OSError:                           # already gone, or not yet its own group
                if proc.is_alive():
                    proc.kill()
        for proc in self.procs:
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


_POOLS: Dict[int, _Pool] = {}
_LOCK = threading.Lock()


def shutdown_pools(world_size: Optional[int] = None) -> None:
    """Shut the pool of ``world_size`` ranks (default: every pool) down; a later call spawns a new
    one. Registered with atexit."""
    with _LOCK:
        sizes = list(_POOLS) if world_size is None else [world_size]
        pools = [_POOLS.pop(size) for size in sizes if size in _POOLS]
        for pool in pools:           # all pools wind down at once
            pool.request_exit()
        for pool in pools:
            pool.close()


atexit.register(shutdown_pools)


def worker_pids(world_size: int) -> Optional[List[int]]:
    """PIDs of the live pool of ``world_size`` ranks, or None (for tests of the pool)."""
    pool = _POOLS.get(world_size)
    return list(pool.pids) if pool is not None and pool.alive else None


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 300.0, fresh: bool = False) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    Reuses the pool of ``world_size`` workers (spawned at first use). ``fresh=True``: new processes,
    shut down afterwards. A worker exception is re-raised as ``DistributedWorkerError`` naming the
    rank, a hang as ``DistributedTimeoutError`` after ``timeout`` seconds; either restarts the pool.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with _LOCK:
        if fresh:
            pool = _Pool(world_size)
            try:
                return pool.run(fn, args, timeout)
            finally:
                pool.close()
        pool = _POOLS.get(world_size)
        if pool is not None and not pool.healthy():
            pool.kill()
            pool = None
        if pool is None:
            pool = _POOLS[world_size] = _Pool(world_size)
        return pool.run(fn, args, timeout)
