"""Raising a checkpoint error on every rank of a group, not only on the rank that found it.

A rank that raises alone leaves the others waiting in the next collective until the process-group
timeout (a save whose rename failed on rank 0 did exactly that). So each step that can fail on
some ranks only (rank 0's renames, one rank's view of the file system, a file only one rank
reads) ends with ``raise_on_every_rank``. This is one small ``all_gather_object`` of the failures
(a class name and a message per rank, our own objects, never file content). If any rank failed,
every rank raises: a failed rank raises its own exception; the others raise the same class (when
it is a built-in or checkpoint error class, else RuntimeError) with every failure's message,
each naming its rank. The exchange is a collective of ours: its group's ledger checks that every
rank makes it (``call`` names it; comm/ledger.py, [Note: ranks that issue different
collectives]), so a save called on rank 0 only raises ``CollectiveMismatchError`` on every rank.
"""

from __future__ import annotations

import builtins
from typing import Optional, Sequence

import torch.distributed as dist

from ..comm.ledger_registry import before_collective
from .errors import CheckpointCorruptError, UnsafeCheckpointError

__all__ = ["gather_reports", "raise_on_every_rank", "raise_reported"]

_OUR_ERRORS = {cls.__name__: cls for cls in (CheckpointCorruptError, UnsafeCheckpointError)}


def _report(error: Optional[BaseException]) -> Optional[tuple]:
    return None if error is None else (type(error).__name__, str(error))


def gather_reports(group, error: Optional[BaseException], extra=None, call: str = "") -> list:
    """Every rank's ``(failure or None, extra)``, in group-rank order; ``extra`` is any small value
    the caller wants to compare across ranks (e.g. which directory each rank chose); ``call`` names
    the exchange in the group's ledger (the same text on every rank: no path a rank chose)."""
    before_collective(group, "all_gather_object", call)
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (_report(error), extra), group=group)
    return reports


def raise_reported(reports: Sequence, error: Optional[BaseException], what: str) -> None:
    """Raise on this rank if any of ``reports`` (from ``gather_reports``) is a failure."""
    failed = {rank: failure for rank, (failure, _) in enumerate(reports) if failure is not None}
    if not failed:
        return
    if error is not None:
        raise error
    name = next(iter(failed.values()))[0]
    cls = _OUR_ERRORS.get(name) or getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    details = "; ".join(f"group rank {rank}: {message}" for rank, (_, message) in failed.items())
    raise cls(f"{what} failed on group rank(s) {sorted(failed)}, so every rank stops: {details}")


def raise_on_every_rank(group, error: Optional[BaseException], what: str, call: str) -> None:
    """If ``error`` (this rank's failure, or None) or any other rank's is set, raise on every rank;
    ``call`` names the exchange in the group's ledger."""
    raise_reported(gather_reports(group, error, call=call), error, what)
