"""The watchdog that compares the ranks' ledgers once a group stalls (backends checked by record only).

[Note: comparing ledgers after a stall]
On NCCL a rank that issued a different collective does not fail: it queues more work and the job
hangs at the next host sync, until NCCL's own timeout aborts it with no word of the cause. The
ledgers (ledger.py) know the cause. One daemon thread per process looks at every
recorded group's ledger every ``poll`` seconds (an integer read). When a ledger has not moved for
``stall_s`` (``MEGATRON_FSDP_V2_STALL_SECONDS``, default 60), the thread publishes its ring
(sequence numbers and call descriptions, JSON) under
``megatron_fsdp_v2/ledger/<group name>/<group rank>`` in the default c10d store, and reads the
other ranks' whenever they are all there. The first sequence number, among those every rank still
holds, at which the calls differ is reported on stderr and armed as this rank's
``CollectiveMismatchError`` for its next collective of ours. Every rank reads the same published
rings, so every stalled rank reports the same difference. A ring that is only shorter than
another's (a rank that has not issued the next call yet: slow, not different) reports nothing.

Between steps a ledger may stand still for minutes (evaluation, a long save): the rings then agree
and the thread stays quiet; it never issues a collective and never blocks on the store (it checks
that keys exist before reading them). It is stopped and joined at ``destroy_process_group`` and at
interpreter exit (comm/thread_shutdown.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .ledger import RING, CollectiveLedger, describe, mismatch_error
from .thread_shutdown import join_thread, shut_down_at_exit

__all__ = ["STALL_ENV", "LedgerWatchdog", "first_difference", "watch"]

STALL_ENV = "MEGATRON_FSDP_V2_STALL_SECONDS"
DEFAULT_STALL_S = 60.0
KEY_PREFIX = "megatron_fsdp_v2/ledger"


def stall_seconds() -> float:
    """The stall after which ledgers are compared: the environment variable's, else 60 s."""
    text = os.environ.get(STALL_ENV, "")
    try:
        value = float(text) if text else DEFAULT_STALL_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{STALL_ENV} must be a positive number of seconds, got {text!r}.")
    return value


def first_difference(rings: list) -> Optional[int]:
    """The first sequence number every rank holds at which their calls differ, or None.

    ``rings``: per group rank ``{sequence: description}`` (consecutive sequence numbers)."""
    if any(not ring for ring in rings):
        return None
    low = max(min(ring) for ring in rings)
    high = min(max(ring) for ring in rings)
    for seq in range(low, high + 1):
        if len({ring[seq] for ring in rings}) > 1:
            return seq
    return None


@dataclass
class _Watch:
    """What the thread knows of one ledger."""

    stall_s: float
    count: int = -1              # the ledger's count at the last look
    since: float = 0.0           # when it last moved
    published: int = -1          # the count this rank published
    compared: tuple = ()         # the counts of the rings compared last


class LedgerWatchdog:
    """The one thread of a process that watches every recorded ledger ([Note: comparing ledgers
    after a stall])."""

    _watched: "weakref.WeakKeyDictionary"    # CollectiveLedger -> _Watch
    _stop: threading.Event
    _thread: Optional[threading.Thread]
    _lock: threading.Lock
    reports: list                              # the errors reported (for tests)

    def __init__(self) -> None:
        self._watched = weakref.WeakKeyDictionary()
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()
        self.reports = []

    def watch(self, ledger: CollectiveLedger, stall_s: Optional[float] = None) -> None:
        """Watch ``ledger`` (once; ``stall_s`` given: from now on, with that stall); start the thread
        if it is not running."""
        with self._lock:
            if ledger not in self._watched or stall_s is not None:
                self._watched[ledger] = _Watch(stall_s if stall_s is not None else stall_seconds(),
                                               since=time.monotonic())
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="megatron_fsdp_v2 ledger watchdog",
                                                daemon=True)
                self._thread.start()
                shut_down_at_exit(self)

    def shut_down(self) -> None:
        """Stop and join the thread (destroy_process_group, interpreter exit); ``watch`` restarts it."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._watched = weakref.WeakKeyDictionary()
        if thread is not None:
            self._stop.set()
            join_thread(thread)

    def _poll_s(self) -> float:
        stalls = [w.stall_s for w in list(self._watched.values())]
        return min([1.0] + [s / 4 for s in stalls])

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s()):
            for ledger, state in list(self._watched.items()):
                try:
                    self._look(ledger, state, time.monotonic())
                except Exception as exc:  # noqa: BLE001 -- a watchdog must not kill the job; say why it stops
                    self._watched.pop(ledger, None)
                    sys.stderr.write(f"megatron_fsdp_v2: stopped comparing the collectives of process group "
                                     f"{ledger.group_name!r} after a stall: {type(exc).__name__}: {exc}\n")

    def _look(self, ledger: CollectiveLedger, state: _Watch, now: float) -> None:
        count = ledger.count
        if count != state.count:
            state.count, state.since = count, now
            return
        if now - state.since < state.stall_s or ledger.armed is not None:
            return
        store = dist.distributed_c10d._get_default_store()
        if state.published != count:
            store.set(_key(ledger, ledger.rank), json.dumps(_ring_of(ledger)))
            state.published = count
        keys = [_key(ledger, r) for r in range(ledger.size)]
        if not store.check(keys):
            return
        rings = [{int(seq): what for seq, what in json.loads(store.get(k))} for k in keys]
        counts = tuple(max(ring, default=0) for ring in rings)
        if counts == state.compared:
            return
        state.compared = counts
        seq = first_difference(rings)
        if seq is not None:
            self._report(ledger, rings, seq, now - state.since)

    def _report(self, ledger: CollectiveLedger, rings: list, seq: int, stalled_s: float) -> None:
        described = [(seq, ring[seq], ring.get(seq - 1, describe(None) if seq == 1 else "?")) for ring in rings]
        error = mismatch_error(ledger.group_name, described,
                               f"by the watchdog after {stalled_s:.0f} s without a new collective")
        ledger.armed = error
        self.reports.append(error)
        sys.stderr.write(f"megatron_fsdp_v2 (group rank {ledger.rank}): CollectiveMismatchError: {error}\n")
        sys.stderr.flush()


def _key(ledger: CollectiveLedger, rank: int) -> str:
    return f"{KEY_PREFIX}/{ledger.group_name}/{rank}"


def _ring_of(ledger: CollectiveLedger) -> list:
    """``[[sequence, description], ...]`` of every call the ring holds."""
    count = ledger.count
    return [[seq, describe(ledger.call(seq))] for seq in range(max(1, count - RING + 1), count + 1)]


WATCHDOG = LedgerWatchdog()


def watch(ledger: CollectiveLedger, stall_s: Optional[float] = None) -> None:
    """Watch ``ledger`` with the process's watchdog."""
    WATCHDOG.watch(ledger, stall_s)
