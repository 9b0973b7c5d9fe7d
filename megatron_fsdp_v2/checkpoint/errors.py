"""The errors a checkpoint save or load raises, apart from the code that raises them, so that the
integrity checks, the safe reader and the every-rank raising can all name them without importing
each other."""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["CheckpointCorruptError", "UnsafeCheckpointError", "corrupt", "this_rank"]


class CheckpointCorruptError(ValueError):
    """A checkpoint file is truncated or corrupt (a size or checksum that does not match what the
    save wrote, or content that does not parse)."""


def this_rank() -> int:
    """The global rank named in error messages (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def corrupt(path, why: str) -> CheckpointCorruptError:
    """The error for a file that is not what the save wrote: names the file and the rank that found it."""
    return CheckpointCorruptError(f"checkpoint file {os.fspath(path)!r} is truncated or corrupt (found on rank "
                                  f"{this_rank()}): {why}.")


class UnsafeCheckpointError(ValueError):
    """A checkpoint asks to unpickle something outside torch's weights-only allow-list (or
    pickled bytes where a tensor belongs); nothing of it was unpickled."""
