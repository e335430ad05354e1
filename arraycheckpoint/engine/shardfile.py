"""Write stored chunk files of the default codec preset without tensorstore's array machinery.

A chunk file of an uncompressed array (:func:`arraycheckpoint.codecs.array_metadata` with ``compression=None``)
is a zarr v3 ``sharding_indexed`` shard: every inner chunk's little-endian bytes followed by their ``crc32c``,
in C order of the inner chunk grid, then the index (``(offset, nbytes)`` as little-endian uint64 per inner
chunk, C order) and the index's ``crc32c``. That is simple enough to produce here, and doing so lets a save

* write a small tensor with one file write instead of opening a tensorstore array for it (the open, not the
  bytes, dominated saves of many small tensors);
* checksum with the hardware CRC32C of ``google_crc32c`` (zarr-python's own dependency) straight from the
  source buffer, and, on a local file system, hand the source buffer to ``writev(2)`` without copying it into
  a write buffer first (tensorstore copies it and checksums in software).

Compressed arrays and partial edge chunks still go through tensorstore. Nothing is read here: loads go through
tensorstore (or zarr-python), which verify both checksums, so a file this module got wrong fails its first read.
"""

from __future__ import annotations

import ctypes
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..regions import Box


def _crc32c() -> Any:
    try:
        import google_crc32c
    except ImportError:  # pragma: no cover - zarr depends on it
        return None
    return google_crc32c if google_crc32c.implementation == "c" else None


_CRC = _crc32c()

Buffer = bytes | np.ndarray


def can_encode(layout: Any, chunk: Box, dtype: np.dtype[Any]) -> bool:
    """Whether :func:`encode` produces ``chunk``'s file of ``layout``: uncompressed, a whole chunk inside the
    array (no padding), little-endian data, and a hardware CRC32C available."""
    return (
        _CRC is not None
        and np.little_endian
        and layout.compression is None
        and chunk.volume > 0
        and tuple(chunk.lengths) == tuple(layout.chunk_shape)
        and dtype.byteorder in ("<", "=", "|")
    )


def chunk_key(layout: Any, chunk: Box) -> str:
    """The chunk's key under its array (``default`` chunk key encoding, ``/`` separator)."""
    index = [o // c for o, c in zip(chunk.offsets, layout.chunk_shape)]
    return "/".join(["c", *map(str, index)])


def crc32c(buf: Buffer) -> int:
    """CRC32C of ``buf`` (bytes or a C-contiguous array), without copying an array."""
    if isinstance(buf, np.ndarray):
        if buf.nbytes == 0:
            return _CRC.value(b"")
        # google_crc32c takes only buffers without a release hook (bytes): a ctypes view of the same memory
        view = (ctypes.c_char * buf.nbytes).from_address(buf.ctypes.data)
        return _CRC.value(view)
    return _CRC.value(buf)


def encode(data: np.ndarray, inner_chunk_shape: tuple[int, ...]) -> list[Buffer]:
    """The shard file of ``data`` (one whole chunk) in inner chunks of ``inner_chunk_shape``, as the list of
    buffers to write one after the other (views of ``data`` where the inner chunks are contiguous in it)."""
    grid = tuple(c // i for c, i in zip(data.shape, inner_chunk_shape))
    if all(g == 1 for g in grid):
        blocks = [_flat_bytes(data)]
    else:
        blocks = [
            _flat_bytes(data[tuple(slice(p * i, (p + 1) * i) for p, i in zip(pos, inner_chunk_shape))])
            for pos in np.ndindex(*grid)
        ]
    parts: list[Buffer] = []
    index = []
    offset = 0
    for block in blocks:
        parts.append(block)
        parts.append(crc32c(block).to_bytes(4, "little"))
        index += (offset, block.nbytes + 4)
        offset += block.nbytes + 4
    raw_index = struct.pack(f"<{len(index)}Q", *index)
    parts.append(raw_index)
    parts.append(crc32c(raw_index).to_bytes(4, "little"))
    return parts


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes in C order as a 1-D uint8 array (a view when ``a`` is C-contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class KvWriter:
    """Writes files through a tensorstore key-value store (any storage backend): one joined copy per file."""

    def __init__(self, kvstore: Any) -> None:
        self._kv = kvstore

    def write(self, key: str, parts: list[Buffer]) -> Any:
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        return self._kv.write(key, data)

    def close(self) -> None:
        pass


#: Files below this size are written in the calling thread (see :meth:`FileWriter.write`).
INLINE_BYTES = 1 << 20


class FileWriter:
    """Writes files under a fresh local directory with ``writev(2)`` from the source buffers: small files in the
    calling thread, larger ones on a thread pool.

    The directory is a save's private staging directory: no other writer, nothing to replace atomically (the
    commit renames the whole directory), and durability comes from the storage's one flush before the commit.
    Files are created exclusively and never through a symbolic link.
    """

    def __init__(self, root: str, threads: int) -> None:
        self._root = root.rstrip("/")
        self._dirs: set[str] = set()
        os.makedirs(self._root, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="acp-write")

    def write(self, key: str, parts: list[Buffer]) -> Future[None]:
        path = f"{self._root}/{key}"
        self._make_parents(key)
        if sum(len(p) for p in parts) < INLINE_BYTES:
            # a thread hand-off costs more than writing a small file: do it here
            done: Future[None] = Future()
            try:
                _write_file(path, parts)
            except BaseException as e:  # noqa: BLE001 - reported through the future, like a pooled write
                done.set_exception(e)
            else:
                done.set_result(None)
            return done
        return self._pool.submit(_write_file, path, parts)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _make_parents(self, key: str) -> None:
        # one mkdir per new directory, top down (os.makedirs probes bottom up: failed mkdirs and stats)
        parts = key.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in self._dirs:
                try:
                    os.mkdir(f"{self._root}/{sub}")
                except FileExistsError:
                    pass
                self._dirs.add(sub)


_IOV_MAX = 1024


def _write_file(path: str, parts: list[Buffer]) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    try:
        while views:
            n = os.writev(fd, views[:_IOV_MAX])
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]
    finally:
        os.close(fd)
