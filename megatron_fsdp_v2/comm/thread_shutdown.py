"""Our background threads end before the process group or the interpreter they use goes.

[Note: threads at exit]
A daemon thread still alive when the interpreter finalizes is killed the moment it next takes the
GIL (CPython calls ``pthread_exit``, which unwinds the thread's stack). If it is then inside torch's
C++ code, in a destructor that takes the GIL (pybind11's ``gil_scoped_release``, a thread-local
holding a Python object), the unwinding meets a ``noexcept`` frame: ``std::terminate``, "terminate
called without an active exception", SIGABRT (pytorch/pytorch#38228). The offloaded-step thread
(backward_steps.py) did exactly that about once in 16 CPU runs, after training had ended: the model's
finalizer woke it at exit, racing the interpreter's teardown. So each of our threads registers here
and is stopped and joined

* at interpreter exit, by an ``atexit`` callback: it runs before finalization begins, when a
  thread can still finish normally;
* at ``torch.distributed.destroy_process_group`` (wrapped once, the first time a thread registers;
  names bound before that, ``from torch.distributed import destroy_process_group``, skip it and
  rely on the ``atexit`` callback), since a thread may use the group's store or collectives.

Joining waits for the operating-system thread itself (on Linux, until ``/proc/self/task/<id>``
is gone), not only for its Python part: the C++ thread-local destructors run after
``Thread.join()`` returns and may need the GIL too. A stopped thread is started again by its owner
when it has work again.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
import weakref

import torch.distributed as dist

__all__ = ["join_thread", "shut_down_all", "shut_down_at_exit"]

JOIN_TIMEOUT_S = 30.0

_OWNERS: "weakref.WeakSet" = weakref.WeakSet()      # objects with a shut_down() ending their thread
_LOCK = threading.Lock()


def shut_down_at_exit(owner) -> None:
    """Call ``owner.shut_down()`` at ``destroy_process_group`` and at interpreter exit (while
    ``owner`` lives)."""
    with _LOCK:
        _OWNERS.add(owner)
    _wrap_destroy_process_group()


def shut_down_all() -> None:
    """Stop and join every registered owner's thread."""
    with _LOCK:
        owners = list(_OWNERS)
    for owner in owners:
        owner.shut_down()


def join_thread(thread: threading.Thread, timeout: float = JOIN_TIMEOUT_S) -> None:
    """Join ``thread`` and wait until its operating-system thread has exited ([Note: threads at
    exit]); give up after ``timeout`` seconds."""
    if thread is threading.current_thread():
        return
    deadline = time.monotonic() + timeout
    thread.join(timeout)
    native = getattr(thread, "native_id", None)
    task = f"/proc/self/task/{native}"
    while native is not None and os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.001)


def _wrap_destroy_process_group() -> None:
    """Make ``torch.distributed.destroy_process_group`` shut our threads down first (once)."""
    current = dist.destroy_process_group
    if getattr(current, "_megatron_fsdp_v2_original", None) is not None:
        return

    @functools.wraps(current)
    def destroy_process_group(*args, **kwargs):
        shut_down_all()
        return current(*args, **kwargs)

    destroy_process_group._megatron_fsdp_v2_original = current
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


atexit.register(shut_down_all)
