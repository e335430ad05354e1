"""Write packs: uncompressed ZIP files of small zarr v3 arrays (the layout is :mod:`arraycheckpoint.packing`).

A pack's members are the exact keys the arrays would have in the checkpoint directory (``<name>/zarr.json``
and the chunk files :mod:`.shardfile` encodes), plus a group ``zarr.json`` for the pack's root and every
directory above a member. Python's :mod:`zipfile` writes the container (``ZIP_STORED``: a member's bytes are
its file's bytes, so tensorstore's ``zip`` driver and zarr-python's ``ZipStore`` read them with ranged reads
and nothing to inflate); fixed timestamps make a pack's bytes a function of its arrays alone.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from typing import IO, Any

import numpy as np

from ..packing import group_keys
from .shardfile import start_writeback

Buffer = bytes | np.ndarray

#: (member key, the buffers of its bytes in order)
Member = tuple[str, list[Buffer]]

_EPOCH = (1980, 1, 1, 0, 0, 0)
_GROUP_DOC = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def members_with_groups(arrays: list[str], members: list[Member]) -> list[Member]:
    """``members`` preceded by the group documents of the pack holding ``arrays``."""
    return [(key, [_GROUP_DOC]) for key in group_keys(arrays)] + members


def write_zip(out: IO[bytes], members: list[Member]) -> None:
    """Write ``members`` as an uncompressed ZIP archive to ``out`` (positioned at its start)."""
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, parts in members:
            info = zipfile.ZipInfo(key, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            nbytes = sum(_nbytes(p) for p in parts)
            with zf.open(info, "w", force_zip64=nbytes >= zipfile.ZIP64_LIMIT) as w:
                for p in parts:
                    w.write(memoryview(_flat(p)) if isinstance(p, np.ndarray) else p)


def zip_bytes(members: list[Member]) -> bytes:
    """The archive of ``members`` in memory (for key-value stores, which take one value per object)."""
    buf = io.BytesIO()
    write_zip(buf, members)
    return buf.getvalue()


def write_zip_file(path: str, members: list[Member]) -> None:
    """Create ``path`` (exclusively, never through a symbolic link) holding the archive of ``members``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    with os.fdopen(fd, "wb", buffering=1 << 20) as f:
        write_zip(f, members)
        f.flush()
        start_writeback(fd)


def _nbytes(p: Any) -> int:
    return int(p.nbytes) if isinstance(p, np.ndarray) else len(p)


def _flat(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
