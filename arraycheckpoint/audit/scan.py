"""Directory scans: the arrays one rank reads hold regular files only, as many as their grids declare.

:func:`check_chunk_files` checks that the arrays read, and only those, hold regular files (no symlink, no
FIFO, no device, nowhere below the root) and as many chunk objects as their chunk grids declare, so a shape
of 1e13 declared by a checkpoint that holds one small file is refused before any buffer exists; it runs the
pack checks for packed arrays. :func:`check_checkpoint`: both, for every array (what the tools run).
It deliberately does not defend against a writer racing the reader (a file swapped for a symlink between the
scan and tensorstore's ``open``): tensorstore cannot open with ``O_NOFOLLOW``; docs/security.md says so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping
from typing import Any

from ..checks.limits import check_layouts, chunk_count
from ..checks.zstd import _max_file_bytes
from ..errors import (
    CorruptCheckpointError,
    InconsistentCheckpointError,
)
from . import rankpacks  # rankpacks.check_rank_packs: looked up at call time (tests count its calls)
from .packs import _CHUNK_KEYS, check_packs


# Scanning -----------------------------------------------------------------------------------------------
def scan_local(path: str) -> dict[str, int]:
    """Every regular file below the directory ``path`` (relative key -> size), with ``os.scandir`` only.

    ``path`` itself may be a symlink (a checkpoint root often is); nothing below it may be one.

    Raises:
        CorruptCheckpointError: a symlink, FIFO, socket or device below ``path``, naming it.
    """
    out: dict[str, int] = {}
    stack = [("", path)]
    while stack:
        rel, directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            raise CorruptCheckpointError(
                f"{directory} is not a directory; the checkpoint is damaged"
            ) from None
        for e in entries:
            key = f"{rel}{e.name}"
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append((key + "/", e.path))
            elif stat.S_ISREG(st.st_mode):
                out[key] = st.st_size
            else:
                kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise CorruptCheckpointError(
                    f"{e.path} is {kind}; a checkpoint holds only regular files and directories, and nothing "
                    "is read through a link (replace it with the file itself, or re-save the checkpoint)"
                )
    return out


def _check_path_below(
    root: str, sub: str, why: str = "nothing in a checkpoint is read through a link (re-save the checkpoint)"
) -> None:
    """No component of ``root/sub`` below ``root`` is a symlink or a non-directory (``root`` may be a link);
    ``why`` ends the error."""
    current = root.rstrip("/")
    for part in sub.strip("/").split("/"):
        current = f"{current}/{part}"
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise CorruptCheckpointError(f"{current} is {kind}; {why}")


def inventory(storage: Any, root: str) -> dict[str, int | None]:
    """Every object below ``root``: key -> size (None where the backend lists no sizes)."""
    if getattr(storage, "commit_strategy", "") == "rename":  # a POSIX file system
        return dict(scan_local(root))
    sized = getattr(storage, "list_sizes", None)
    if sized is not None:
        return sized(root)
    return dict.fromkeys(storage.list(root))


def check_checkpoint(storage: Any, root: str, meta: Any) -> dict[str, int | None]:
    """Validate a whole committed checkpoint against its metadata: :func:`check_layouts`, then
    :func:`check_chunk_files` of every array (one scan of the checkpoint; what the tools use).

    Returns:
        The inventory (key -> size) of the checkpoint's arrays.
    """
    check_layouts(meta)
    return check_chunk_files(storage, root, meta, None)


#: Keys one listing request returns (S3 and GCS pages), to weigh one listing per array against one of all.
_KEYS_PER_LISTING = 1000


def check_chunk_files(
    storage: Any,
    root: str,
    meta: Any,
    names: Collection[str] | None,
    directories: dict[str, list[Any]] | None = None,
    regions: Mapping[str, list[Any] | None] | None = None,
    deferred: dict[str, dict[str, int]] | None = None,
) -> dict[str, int | None]:
    """The stored files of the arrays ``names`` (every array if None) match their metadata.

    Each array holds exactly as many chunk objects as its grid declares (every chunk has its file, also an
    all-zero one), none larger than a chunk can encode to, and, on local file systems, only regular files
    with no link anywhere on the path below ``root``. A load checks only the arrays it reads: at 10,000
    ranks, every rank scanning a whole checkpoint of 100,000 files would cost the file system a billion
    metadata operations per load; checking what one reads costs one directory listing per array read. On
    object stores, one listing of the whole checkpoint replaces the per-array ones when it takes fewer
    requests (a rank that reads most arrays).

    ``directories`` receives the ZIP directories of the packs checked (:func:`check_packs`,
    :func:`check_rank_packs`); ``regions`` (name -> regions read) limits the format-6 packs checked to those
    holding chunks that meet them; ``deferred`` leaves the local headers of the format-6 members read to the
    reader (:func:`check_rank_packs`).

    Returns:
        The inventory (key -> size) of the arrays checked.

    Raises:
        MetadataError: a declared shape the stored files do not hold.
        CorruptCheckpointError: a symlink or non-regular file, or an oversized chunk file.
    """
    from ..codecs import numpy_dtype
    from ..format.metadata import chunk_key_separator

    chunk_key = _CHUNK_KEYS[chunk_key_separator(meta.format_version)]
    selected = list(meta.tensors) if names is None else [n for n in dict.fromkeys(names) if n in meta.tensors]
    packed = [n for n in selected if meta.tensors[n].pack is not None]
    by_rank = [n for n in packed if meta.tensors[n].pack_rank is not None]
    packed = [n for n in packed if meta.tensors[n].pack_rank is None]
    selected = [n for n in selected if meta.tensors[n].pack is None]
    items = _array_inventory(storage, root, meta, selected if names is not None else None)
    items.update(check_packs(storage, root, meta, packed, directories))
    items.update(rankpacks.check_rank_packs(storage, root, meta, by_rank, regions, directories, deferred))
    chunks: dict[str, list[int | None]] = {}
    for key, size in items.items():
        m = chunk_key.match(key)
        if m:
            chunks.setdefault(m.group(1), []).append(size)
    for name in selected:
        t = meta.tensors[name]
        expected = chunk_count(t.shape, t.chunk_shape)
        found = chunks.get(name, [])
        if len(found) != expected:
            raise InconsistentCheckpointError(
                f"tensor {name!r}: the metadata declares shape {list(t.shape)} in {expected} chunk(s) of "
                f"{list(t.chunk_shape)}, but the checkpoint holds {len(found)} chunk file(s) for it; the "
                "metadata does not describe this checkpoint (damaged, hostile, or partly deleted)"
            )
        limit = _max_file_bytes(t.chunk_shape, t.inner_chunk_shape, numpy_dtype(t.dtype).itemsize)
        too_big = [s for s in found if s is not None and s > limit]
        if too_big:
            raise CorruptCheckpointError(
                f"tensor {name!r}: a chunk file of {max(too_big)} bytes is larger than any encoding of its "
                f"{list(t.chunk_shape)} chunk ({limit} bytes at most); the checkpoint is damaged"
            )
    return items


def _array_inventory(storage: Any, root: str, meta: Any, names: list[str] | None) -> dict[str, int | None]:
    """Keys (relative to ``root``) and sizes of the arrays ``names``' files, or of everything if None."""
    if names is None:
        return inventory(storage, root)
    if not names:  # only packed arrays are read: their packs are checked, nothing is listed
        return {}
    if getattr(storage, "commit_strategy", "") != "rename":
        stored = sum(chunk_count(t.shape, t.chunk_shape) + 1 for t in meta.tensors.values() if t.pack is None)
        if len(names) * _KEYS_PER_LISTING >= stored:  # one listing of everything takes fewer requests
            return inventory(storage, root)
    out: dict[str, int | None] = {}
    base = root.rstrip("/")
    for name in names:
        if getattr(storage, "commit_strategy", "") == "rename":
            _check_path_below(base, name)  # no link on the way down (the scan below refuses any beneath)
        out.update((f"{name}/{k}", n) for k, n in inventory(storage, f"{base}/{name}").items())
    return out
