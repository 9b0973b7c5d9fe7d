"""Our background threads, and gloo's for the groups we hold, end before the interpreter finalizes.

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
* at ``torch.distributed.destroy_process_group`` (wrapped once, the first time a thread or a mesh
  registers; names bound before that, ``from torch.distributed import destroy_process_group``, skip
  it and rely on the ``atexit`` callback), since a thread may use the group's store or collectives.

Joining waits for the operating-system thread itself (on Linux, until ``/proc/self/task/<id>``
is gone), not only for its Python part: the C++ thread-local destructors run after
``Thread.join()`` returns and may need the GIL too. A stopped thread is started again by its owner
when it has work again.

[Note: gloo's threads at exit]
gloo's worker threads (``ProcessGroupGloo::runLoop``, 2 per group) die the same way. A worker drops
its references to a finished collective after the caller's ``wait()`` has returned; if it drops the
last one, the collective's tensors go with it, and on torch 2.13 dropping a C++ reference to a
tensor that has a Python object takes the GIL (``TensorImpl::decref_pyobject``). A ``dist.barrier()``
holds weak references to the collectives a worker still held when it was issued, whose tensors
then go only with the barrier's own work: export_full_state_dict's closing barrier, freed by a
worker once the main thread was in ``Py_FinalizeEx``, was the core files' stack (``runLoop`` ->
``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
``pthread_exit`` -> ``std::terminate``): 3 runs in 40 of the README loop under ZeRO-3 on a
loaded 2-core machine, torch FSDP2's loop 4 in 40 (benchmarks/results/2026-12-08-exit). gloo joins
its threads only when the ``ProcessGroupGloo`` is destroyed; ``destroy_process_group`` drops torch's
references, but a ``DeviceMesh`` keeps its groups (torch 2.13's ``_pg_registry``) and every DTensor
parameter holds its mesh. So the meshes we make register here, and ``destroy_process_group`` first
drops their references to the groups it destroys (destroying every group: after collecting cyclic
garbage, which may hold one, and for the copies of our meshes too, as an unpickled mesh refills its
registry from the group names): torch then destroys the group inside it, and its destructor (run
with the GIL released) joins the workers after their last release. A group
referenced elsewhere keeps its threads and the race, which is torch's (pytorch/pytorch#190489; the
abandoned pytorch/pytorch#179291 would destroy groups at exit): a user's variable or mesh, a group
passed as ``process_group`` (the model holds it), or the default group once
``torch.distributed.nn.functional`` is first imported after ``init_process_group`` (its default
arguments hold it).
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import threading
import time
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["join_thread", "release_group_references", "release_groups_at_destroy", "shut_down_all",
           "shut_down_at_exit"]

JOIN_TIMEOUT_S = 30.0

_OWNERS: "weakref.WeakSet" = weakref.WeakSet()      # objects with a shut_down() ending their thread
_MESHES: "weakref.WeakSet" = weakref.WeakSet()      # our DeviceMeshes (group references end at destroy)
_LOCK = threading.Lock()


def shut_down_at_exit(owner) -> None:
    """Call ``owner.shut_down()`` at ``destroy_process_group`` and at interpreter exit (while
    ``owner`` lives)."""
    with _LOCK:
        _OWNERS.add(owner)
    _wrap_destroy_process_group()


def release_groups_at_destroy(mesh) -> None:
    """Drop ``mesh``'s references to its process groups when ``destroy_process_group`` destroys
    them ([Note: gloo's threads at exit])."""
    with _LOCK:
        _MESHES.add(mesh)
    _wrap_destroy_process_group()


def release_group_references(group, copies: bool) -> None:
    """Forget the references our meshes hold to ``group`` (None or the default group: to every
    group); with ``copies``, also those of their copies, found among all live objects (unpickling a
    mesh, as ``torch.load`` of a parameter or ``deepcopy`` does, refills its registry from the group
    names; a copy equals its original)."""
    everything = group is None or group is dist.GroupMember.WORLD
    with _LOCK:
        # type(), not isinstance(): isinstance reads __class__, which some objects answer with a
        # warning (torch.distributed's deprecated reduce_op)
        meshes = ([o for o in gc.get_objects() if issubclass(type(o), DeviceMesh) and o in _MESHES] if copies
                  else list(_MESHES))
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)     # (a torch whose mesh has none: nothing to drop)
        for name, held in list((registry or {}).items()):
            if everything or held is group:
                del registry[name]


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
    """Make ``torch.distributed.destroy_process_group`` first shut our threads down and drop our
    meshes' references to the groups it destroys (once). Destroying every group (the end of a
    program) also collects garbage in reference cycles that may hold them (a model left by a failed
    call, an exception's frames) and releases copies of our meshes; one subgroup (Megatron's
    teardown, the test pool's after every case) only our meshes, cheaply."""
    current = dist.destroy_process_group
    if getattr(current, "_megatron_fsdp_v2_original", None) is not None:
        return

    @functools.wraps(current)
    def destroy_process_group(group=None):
        shut_down_all()
        everything = group is None or group is dist.GroupMember.WORLD
        if everything:                   # the end: a collection and a scan, ~0.3 s at 430k objects
            gc.collect()
        release_group_references(group, copies=everything)
        return current(group)

    destroy_process_group._megatron_fsdp_v2_original = current
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


atexit.register(shut_down_all)
