"""Each process group's one ledger in this process, and what its backend gets: the check before every
collective, the record with the watchdog behind it, or nothing ([Note: ranks that issue different
collectives], ledger.py). The ledger itself knows nothing of the watchdog; this module joins the two,
so ledger.py and watchdog.py each depend one way (watchdog.py reads the ledgers)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .ledger import CollectiveLedger, LedgerMode, mode_for
from .watchdog import watch

__all__ = ["before_collective", "ledger_and_mode", "ledger_for"]

_LEDGERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ledger_for(group: Optional[dist.ProcessGroup]) -> CollectiveLedger:
    """The one ledger of ``group`` (None: the default group) in this process, made at first use;
    every Communicator and save / load exchange over the group shares it, so its sequence numbers
    count every collective of ours on the group."""
    key = group if group is not None else dist.distributed_c10d._get_default_group()
    ledger = _LEDGERS.get(key)
    if ledger is None:
        ledger = _LEDGERS[key] = CollectiveLedger(group)
    return ledger


def ledger_and_mode(group: Optional[dist.ProcessGroup]) -> "tuple[CollectiveLedger, LedgerMode]":
    """``group``'s ledger and the mode to use it in now; a recorded group of several ranks on a
    backend with a store (not torch's fake one) gets the watchdog (watchdog.py)."""
    ledger, mode = ledger_for(group), mode_for(group)
    if mode is LedgerMode.RECORD and ledger.size > 1 and dist.get_backend(group) != "fake":
        watch(ledger)
    return ledger, mode


def before_collective(group: Optional[dist.ProcessGroup], kind: str, label: str,
                      tensor: Optional[torch.Tensor] = None) -> None:
    """For a collective issued outside collectives.py (the save / load functions' exchanges): record it in
    ``group``'s ledger and check it as the group's backend and the environment say."""
    ledger, mode = ledger_and_mode(group)
    ledger.before(kind, tensor, label, mode)
