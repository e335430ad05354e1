"""A local save's target and the renames of its commit: what ``<dir>/<name>`` may hold before a save
replaces it (a committed checkpoint, nothing, or an empty directory: never the user's files), its parents, the
replaced copy put back when a commit fails, and the fsync that makes a rename durable (:mod:`.local`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError, StorageError
from ..format.metadata import CONTROL_LAYOUTS

#: Root entries that only a checkpoint (committed or left by a crashed save) holds: its control files.
_CONTROL_NAMES = frozenset(files.metadata.split("/")[0] for files in CONTROL_LAYOUTS)


def refuse_foreign(final: str, is_committed: Any) -> bool:
    """Whether ``final`` is an empty directory; raise if it is anything but that, absent, or a checkpoint
    (``is_committed(final)``, or an uncommitted one: its control files are there).

    Raises:
        CheckpointExistsError: ``final`` is a file, a link, or a directory holding what is not a checkpoint
            (the message lists the first entries).
    """
    if not os.path.lexists(final):
        return False
    if os.path.islink(final) or not os.path.isdir(final):
        raise CheckpointExistsError(
            f"cannot save to {final}: it exists and is not a directory (a file or a link); a save replaces only "
            "a committed checkpoint: choose another path or remove it"
        )
    entries = sorted(os.listdir(final))
    if not entries:
        return True
    if is_committed(final) or any(e in _CONTROL_NAMES for e in entries):
        return False  # a checkpoint: committed, or an uncommitted save's leftover (its control files show it)
    shown = [e + ("/" if os.path.isdir(os.path.join(final, e)) else "") for e in entries[:10]]
    more = f" and {len(entries) - 10} more" if len(entries) > 10 else ""
    raise CheckpointExistsError(
        f"cannot save to {final}: the directory exists and is not a checkpoint (it holds {', '.join(shown)}{more}); "
        "a save replaces only a committed checkpoint (with overwrite=True) and never deletes other files: "
        "choose a new path (e.g. a subdirectory) or move those files away"
    )


def put_back(old: str, final: str, why: OSError) -> None:
    """Put the checkpoint an overwrite commit moved aside (``old``) back at ``final`` after the commit's own
    rename failed (``why``).

    Raises:
        StorageError: it could not go back (something else is at ``final`` now); the message says where it
            is kept, so it is never lost silently.
    """
    try:
        os.rename(old, final)
    except OSError as e:
        raise StorageError(
            f"storage commit of {final} failed ({why}), and the checkpoint it was replacing could not be put "
            f"back ({e}): it is kept at {old}; move it back yourself if {final} is not the copy you want"
        ) from why
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(old))


def check_parents(directory: Path) -> None:
    """The nearest existing ancestor of ``directory`` (itself included) must be a directory."""
    for p in (directory, *directory.parents):
        if os.path.lexists(p):
            if not os.path.isdir(p):
                kind = "a regular file" if os.path.isfile(p) else "not a directory"
                raise StorageError(
                    f"cannot save under {directory}: {p} is {kind}, not a directory; choose another path or "
                    "remove that file"
                )
            return


def fsync_path(path: str) -> None:
    """fsync a file or directory by path (directories: makes renames and creations in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
