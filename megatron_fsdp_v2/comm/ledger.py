"""Which collectives this rank issued on a process group, and the check that every rank issues the same.

[Note: ranks that issue different collectives]
Ranks whose control flow differs (a unit skipped on one rank, ``save_checkpoint`` called on rank 0
only) issue different collectives. gloo then aborts the process (SIGABRT) or reads garbage, NCCL
hangs until its timeout: no Python error names the cause. So every collective of ours (collectives.py's,
and the save / load functions' exchanges) is first written into its process group's ledger: a
sequence number and what it is for (kind, element count, dtype, label naming the unit and group).
What the ledger then does depends on the backend, chosen by cost:

  gloo (CPU)   before each collective, a blocking all-gather of 2 int64 (sequence number, crc32 of
               the call) over the group; where they differ every rank raises
               ``CollectiveMismatchError`` naming each rank's call (one small all_gather_object,
               on that error path only). A gloo collective costs tens of microseconds already.
  NCCL, other  record only (a tuple into a ring of the last ``RING`` calls: a few microseconds,
               host only, no sync), plus a watchdog thread (watchdog.py): when a
               group's ledger has not moved for ``MEGATRON_FSDP_V2_STALL_SECONDS`` (60 s by
               default) it compares the ranks' rings through the c10d store and reports the first
               call where they differ, and arms the error for this rank's next collective of ours.
               A blocking check before every NCCL collective would add a host sync per
               collective, more than the 1% of a step allowed (docs/benchmarks_history.md, "The
               rank-divergence check's cost").
  fake         record only (one process plays one rank: nothing to compare).

``MEGATRON_FSDP_V2_CHECK_COLLECTIVES=1`` checks every collective on every backend (NCCL included: a
host sync per collective, for debugging); ``=0`` turns the ledger off (no record, no check, no
watchdog). The variable is read when a Communicator is made (``fully_shard``).

It covers our collectives only: a rank in a collective of its own (a loss all-reduce, DCP's
internal exchanges) while another is in one of ours is still gloo's abort or NCCL's hang.
"""

from __future__ import annotations

import enum
import os
import weakref
import zlib
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from .flat_names import all_gather_single

__all__ = ["CHECK_ENV", "CollectiveLedger", "CollectiveMismatchError", "LedgerMode", "mode_for"]

CHECK_ENV = "MEGATRON_FSDP_V2_CHECK_COLLECTIVES"
RING = 4096                 # calls kept per group (a power of two) for the watchdog's comparison


class CollectiveMismatchError(RuntimeError):
    """Ranks of a process group issued different collectives (their control flow differs).

    Raised on every rank of the group, before any of the differing collectives runs.
    ``calls``: each group rank's call, as "#sequence description", in group-rank order."""

    def __init__(self, message: str, calls: tuple = ()) -> None:
        super().__init__(message)
        self.calls = list(calls)


class LedgerMode(enum.Enum):
    """What a group's ledger does before a collective ([Note: ranks that issue different collectives])."""

    OFF = "off"          # nothing
    RECORD = "record"    # write the call into the ring (the watchdog compares rings after a stall)
    CHECK = "check"      # record, then compare the call with every rank's before issuing it


def mode_for(group: Optional[dist.ProcessGroup]) -> LedgerMode:
    """The mode for collectives on ``group``: the environment variable's, else its backend's."""
    setting = os.environ.get(CHECK_ENV, "")
    if setting == "0":
        return LedgerMode.OFF
    if setting not in ("", "1"):
        raise ValueError(f"{CHECK_ENV} must be unset, 0 (off) or 1 (check every collective on every backend), "
                         f"got {setting!r}.")
    if dist.get_world_size(group) == 1:
        return LedgerMode.RECORD
    if setting == "1" or dist.get_backend(group) == "gloo":
        return LedgerMode.CHECK
    return LedgerMode.RECORD


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    return "" if dtype is None else str(dtype).replace("torch.", "")


def describe(call: Optional[tuple]) -> str:
    """A ring entry ``(kind, numel, dtype, label)`` as text (the same text on every rank)."""
    if call is None:
        return "nothing (no collective of ours yet)"
    kind, numel, dtype, label = call
    size = f" of {numel} x {_dtype_name(dtype)}" if numel is not None else ""
    return f"{kind}{size} for {label or '?'}"


class CollectiveLedger:
    """One process group's record of the collectives this rank issued on it, and the check."""

    _group: Optional["weakref.ref"]      # the group (weakly: ledger_registry.py's key); None: the default group
    group_name: str                      # torch's name of the group (keys in the c10d store)
    rank: int                            # this process's rank in the group
    size: int
    count: int                           # collectives recorded so far (the last one's sequence number)
    ring: list                           # call ``seq`` at ``ring[seq % RING]``: (kind, numel, dtype, label)
    armed: Optional[CollectiveMismatchError]   # found by the watchdog; raised at this rank's next call

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self._group = None if group is None else weakref.ref(group)
        resolved = group if group is not None else dist.distributed_c10d._get_default_group()
        self.group_name = resolved.group_name
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.count = 0
        self.ring = [None] * RING
        self.armed = None

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return None if self._group is None else self._group()

    def call(self, seq: int) -> Optional[tuple]:
        """Call number ``seq`` if the ring still holds it."""
        if seq < 1 or seq > self.count or seq <= self.count - RING:
            return None
        return self.ring[seq % RING]

    def before(self, kind: str, tensor: Optional[torch.Tensor], label: str, mode: LedgerMode) -> None:
        """Record the collective about to be issued; in CHECK mode raise on every rank unless every
        rank is about to issue the same one."""
        if mode is LedgerMode.OFF:
            return
        if self.armed is not None:
            error, self.armed = self.armed, None
            raise error
        self.count += 1
        call = (kind, None if tensor is None else tensor.numel(), None if tensor is None else tensor.dtype, label)
        self.ring[self.count % RING] = call
        if mode is LedgerMode.CHECK and self.size > 1:
            device = tensor.device if tensor is not None and tensor.device.type != "meta" else _object_device(self)
            self._check(call, device)

    def _check(self, call: tuple, device: torch.device) -> None:
        """[Note: ranks that issue different collectives]: one 2 x int64 all-gather; on a difference,
        every rank's call and the call before it, then the error on every rank. Python dispatch
        modes (a user's collective counter, a fake-tensor mode) do not see this bookkeeping: it is
        no collective of the model's."""
        with _disable_current_modes():
            mine = torch.tensor([self.count, zlib.crc32(describe(call).encode())], dtype=torch.int64, device=device)
            everyone = torch.empty(2 * self.size, dtype=torch.int64, device=device)
            all_gather_single(everyone, mine, group=self.group)
            values = everyone.tolist()
            if all(values[2 * r:2 * r + 2] == values[:2] for r in range(1, self.size)):
                return
            described: list = [None] * self.size
            dist.all_gather_object(described, (self.count, describe(call), describe(self.call(self.count - 1))),
                                   group=self.group)
        raise mismatch_error(self.group_name, described, "before issuing them")


def mismatch_error(group_name: str, described: list, when: str) -> CollectiveMismatchError:
    """The error naming every rank's call: ``described`` holds (sequence, call, call before) per rank."""
    calls = [f"#{seq} {what}" for seq, what, _ in described]
    per_rank = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
    befores = {(seq - 1, before) for seq, _, before in described}
    before = (f" The call before, #{next(iter(befores))[0]}, was the same on every rank: {next(iter(befores))[1]}."
              if len(befores) == 1 else "")
    return CollectiveMismatchError(
        f"ranks of process group {group_name!r} issue different collectives, found {when} ({per_rank}).{before} "
        f"Their control flow differs: every rank must run the same units in the same order (no unit skipped "
        f"on some ranks) and call collective functions such as save_checkpoint, load_checkpoint and "
        f"export_full_state_dict together (on every rank, not on rank 0 only). Unset {CHECK_ENV} checks this "
        f"before every collective on gloo and after a stall on NCCL; {CHECK_ENV}=1 before every collective on "
        f"every backend; {CHECK_ENV}=0 turns it off.", calls)


def _object_device(ledger: CollectiveLedger) -> torch.device:
    """Where an exchange of Python objects (all_gather_object) puts its tensors: NCCL's current GPU."""
    backend = dist.get_backend(ledger.group)
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
