"""How ``save_checkpoint`` puts a new checkpoint directory in place of the last one so that a
crash at any point of the save (write, rename, delete) leaves the newest complete checkpoint
loadable, and how the next load finds it and the next save tidies up. File-system steps only; the
collectives around them are in save_load.py.

[Note: committing a checkpoint directory]
Three directories, and what makes one complete:

    path       the committed checkpoint
    path.tmp   the save in progress. It is complete once its ``.checksums.json`` exists: the
               manifest is written last, after DCP's ``.metadata``, which DCP writes only when
               every rank's files are written and fsynced (integrity.py).
    path.old   the previous checkpoint while ``path.tmp`` takes its place

A save: ``recover`` (rank 0), every rank writes ``path.tmp``, then ``commit`` (rank 0):
``path`` -> ``path.old``, ``path.tmp`` -> ``path``, fsync of the parent, delete ``path.old``.
``remove`` deletes a directory's manifest first, so a directory whose deletion was cut short is
never complete, and so is never loaded or promoted.

A crash at each point leaves (-> what the next load reads; what the next save's ``recover`` does):

    writing path.tmp              path + incomplete path.tmp  -> path;      deletes path.tmp
    written, before the renames   path + complete path.tmp    -> path.tmp;  commits it
    between the two renames       path.old + complete .tmp    -> path.tmp;  commits it
    deleting path.old             path + incomplete path.old  -> path;      deletes path.old
    inside recover                one of the states above, handled the same way

The newest complete checkpoint is loaded in every case. Until this design, a crash while
``path.old`` was being deleted broke every later save: the next rename of ``path`` to ``path.old``
failed (``OSError: [Errno 39] Directory not empty``) on rank 0 while the other ranks waited until
the process-group timeout.
"""

from __future__ import annotations

import os
import shutil
import warnings

from .integrity import MANIFEST, has_manifest

__all__ = ["commit", "newest_complete", "recover", "remove", "tmp_dir"]


def tmp_dir(path: str) -> str:
    return path + ".tmp"


def _old_dir(path: str) -> str:
    return path + ".old"


def _fsync_dir(path: str) -> None:
    try:                           # make renames and deletions durable; some filesystems cannot fsync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def remove(directory: str) -> None:
    """Delete ``directory`` so that, if this is cut short, what is left is never complete."""
    if not os.path.lexists(directory):
        return
    try:
        os.unlink(os.path.join(directory, MANIFEST))
    except FileNotFoundError:
        pass
    _fsync_dir(directory)
    shutil.rmtree(directory)


def newest_complete(path: str) -> str:
    """The directory a load reads: ``path.tmp`` if a save wrote all of it but died before
    committing it, else ``path``, else a complete ``path.old`` (see the note)."""
    tmp, old = tmp_dir(path), _old_dir(path)
    if has_manifest(tmp):
        return tmp
    if os.path.isdir(path):
        return path
    if has_manifest(old):
        return old
    raise FileNotFoundError(f"no checkpoint at {path!r}: neither it, a completely written {tmp!r} nor a complete "
                            f"{old!r} exists.")


def commit(path: str) -> None:
    """Put the complete ``path.tmp`` in place of ``path`` (rank 0 only)."""
    tmp, old = tmp_dir(path), _old_dir(path)
    if os.path.isdir(path):
        remove(old)                # a leftover would make the rename fail (ENOTEMPTY)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(_parent(path))
    try:
        remove(old)
    except OSError as exc:         # the new checkpoint is committed; the next save's recover retries
        warnings.warn(f"save_checkpoint: {path!r} is saved, but deleting the previous checkpoint {old!r} failed "
                      f"({exc}); the next save deletes it.", stacklevel=2)


def recover(path: str) -> None:
    """Bring ``path`` to one committed checkpoint, after any crash of an earlier save (rank 0
    only, before a save writes): commit a complete ``path.tmp``, delete an incomplete one, put a
    complete ``path.old`` back if ``path`` is missing, delete a leftover ``path.old``."""
    tmp, old = tmp_dir(path), _old_dir(path)
    if has_manifest(tmp):
        commit(path)
    else:
        remove(tmp)
        if not os.path.isdir(path) and has_manifest(old):
            os.rename(old, path)
            _fsync_dir(_parent(path))
    if os.path.isdir(path):
        remove(old)
