"""The one link a source follows: a Hugging Face hub cache snapshot's link to its blob.

``huggingface_hub`` (``snapshot_download``, ``from_pretrained``'s cache) stores a repository as::

    models--org--name/blobs/<etag>                          the files' bytes
    models--org--name/snapshots/<commit>/model.safetensors  -> ../../blobs/<etag>

so every file of a snapshot directory is a symlink. A checkpoint's files are never read through a link
(docs/security.md); this module allows exactly this one shape, so ``acp.load(snapshot_dir, state)`` works
on what the hub downloaded: a plain file name in a directory whose parent is named ``snapshots``, linking
(relative or absolute) to a file directly in the ``blobs`` directory beside ``snapshots`` (itself no link).
The blob is then opened like any file of a checkpoint (no link, no FIFO, bounded): the link can reach no
file outside its repository's cache folder. Any other link is left to the caller's checks, which refuse it.
"""

from __future__ import annotations

import os
import stat

__all__ = ["locate"]


def locate(root: str, key: str) -> tuple[str, str]:
    """Where to open the file ``key`` of the local directory ``root``: ``(directory, name)``.

    ``(blobs directory, blob name)`` when ``root/key`` is a hub cache link (see the module docstring);
    ``(root, key)`` otherwise (a regular file, an absent one, or a link the caller's checks refuse).
    """
    if "/" in key or key in ("", ".", ".."):
        return root, key
    path = os.path.join(root, key)
    try:
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return root, key
        target = os.readlink(path)
    except OSError:
        return root, key
    snapshot = os.path.realpath(root)  # a relative link resolves from the directory that really holds it
    snapshots = os.path.dirname(snapshot)
    if os.path.basename(snapshots) != "snapshots":
        return root, key
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    blob = os.path.normpath(os.path.join(snapshot, target))
    try:
        blobs_is_dir = stat.S_ISDIR(os.lstat(blobs).st_mode)
    except OSError:
        return root, key
    if not blobs_is_dir or os.path.dirname(blob) != blobs or os.path.basename(blob) in ("", ".", ".."):
        return root, key
    return blobs, os.path.basename(blob)
