"""Read uncompressed chunk files of a local checkpoint straight into their destination: one copy per byte.

The mirror of :func:`arraycheckpoint.engine.shardfile.encode` for arrays in their own directories: a chunk file
is a zarr v3 ``sharding_indexed`` shard, every inner chunk's little-endian bytes followed by their ``crc32c``,
then the index (``(offset, nbytes)`` as little-endian uint64 per inner chunk) and the index's ``crc32c``.
Tensorstore reads such a file into its own buffers, checksums it in software and copies the bytes into the
destination; here each inner chunk the destination holds whole and contiguously is read with one
``preadv`` into the destination itself (the other inner chunks into one scratch buffer, then the part
wanted is copied out), and both checksums are verified with the hardware CRC32C.

Only the layout a save writes is read here (every inner chunk the region needs present at its exact size
inside the file; tensorstore leaves out an edge chunk's inner chunks beyond the array); anything else returns
False and the caller reads that region through
tensorstore, which reads every valid zarr shard. The files were checked first
(:func:`arraycheckpoint.audit.scan.check_chunk_files`: regular files, no link on the path, sizes bounded); a file
is opened without following a link all the same. A checksum that does not match raises
:class:`CorruptCheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..codecs import CODEC_PRESET, numpy_dtype
from ..errors import CorruptCheckpointError
from ..planning.regions import Box, intersect
from . import shardfile

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def available() -> bool:
    """Whether this interpreter has the hardware CRC32C on a little-endian host (else tensorstore reads)."""
    return shardfile._CRC is not None and np.little_endian


class ChunkReader:
    """Reads regions of a local checkpoint's unpacked, uncompressed arrays on a small thread pool."""

    def __init__(self, root: str, meta: Any, threads: int) -> None:
        from ..format.metadata import chunk_key_separator

        self._root = root.rstrip("/")
        self._meta = meta
        self._sep = chunk_key_separator(meta.format_version)
        self._preset = getattr(meta, "codec_preset", None) == CODEC_PRESET
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="acp-read")
        self._lock = threading.Lock()
        #: bytes read straight into destinations, and through the scratch buffer (then copied once more)
        self.direct_bytes = 0
        self.scratch_bytes = 0

    def handles(self, name: str) -> bool:
        """Whether the array ``name`` is read here (its own directory, uncompressed, this codec preset)."""
        tm = self._meta.tensors[name]
        return self._preset and tm.pack is None and tm.compression is None

    def submit(self, name: str, box: Box, out: np.ndarray) -> list[Future[bool]]:
        """Start reading region ``box`` of array ``name`` into ``out`` (its shape, the stored dtype, any
        strides); one future per chunk file, True once its part is in ``out``, False when the file is not in
        the layout a save writes (read that region through tensorstore then)."""
        tm = self._meta.tensors[name]
        if box.volume == 0:
            return []
        chunk = tuple(tm.chunk_shape)
        first = [o // c for o, c in zip(box.offsets, chunk)]
        last = [(o + n - 1) // c for o, n, c in zip(box.offsets, box.lengths, chunk)]
        futures = []
        for rel in np.ndindex(*(b - a + 1 for a, b in zip(first, last))):
            index = tuple(a + i for a, i in zip(first, rel))
            futures.append(self._pool.submit(self._read_chunk, tm, index, box, out))
        return futures

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _read_chunk(self, tm: Any, index: tuple[int, ...], box: Box, out: np.ndarray) -> bool:
        dtype = numpy_dtype(tm.dtype)
        chunk, inner = tuple(tm.chunk_shape), tuple(tm.inner_chunk_shape)
        grid = tuple(c // i for c, i in zip(chunk, inner))
        n_inner = math.prod(grid)
        inner_bytes = math.prod(inner) * dtype.itemsize
        table_len = 16 * n_inner + 4
        data_end = n_inner * (inner_bytes + 4)
        key = self._sep.join(["c", *map(str, index)])
        path = f"{self._root}/{tm.name}/{key}"
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError:
            return False  # tensorstore reports a missing or unreadable file in its own words
        try:
            st = os.fstat(fd)
            # a whole chunk holds every inner chunk; an edge chunk's inner chunks outside the array may be absent
            if not stat.S_ISREG(st.st_mode) or not table_len <= st.st_size <= data_end + table_len:
                return False
            data_end = st.st_size - table_len
            table = os.pread(fd, table_len, data_end)
            if len(table) != table_len:
                return False
            if shardfile.crc32c(table[:-4]) != int.from_bytes(table[-4:], "little"):
                raise _corrupt(tm, path, "the shard index's crc32c does not match")
            entries = struct.unpack(f"<{2 * n_inner}Q", table[:-4])
            origin = tuple(i * c for i, c in zip(index, chunk))
            scratch: np.ndarray | None = None
            crc = bytearray(4)
            direct = staged = 0
            for k, pos in enumerate(np.ndindex(*grid)):
                block = Box(tuple(o + p * i for o, p, i in zip(origin, pos, inner)), inner)
                part = intersect(block, box)
                if part is None:
                    continue
                offset, nbytes = entries[2 * k], entries[2 * k + 1]
                if nbytes != inner_bytes + 4 or offset + nbytes > data_end:
                    return False
                dest = out[(*part.slices(box), ...)]  # a view, also of a 0-d array
                if part == block and dest.flags.c_contiguous:
                    data = dest.reshape(-1).view(np.uint8)  # straight into the destination
                else:
                    if scratch is None:
                        scratch = np.empty(inner_bytes, np.uint8)
                    data = scratch
                if os.preadv(fd, [data, crc], offset) != nbytes:
                    return False
                if shardfile.crc32c(data) != int.from_bytes(crc, "little"):
                    raise _corrupt(tm, path, f"inner chunk {list(pos)}'s crc32c does not match")
                if data is scratch:
                    dest[...] = scratch.view(dtype).reshape(inner)[part.slices(block)]
                    staged += inner_bytes
                else:
                    direct += inner_bytes
            with self._lock:
                self.direct_bytes += direct
                self.scratch_bytes += staged
            return True
        finally:
            os.close(fd)


def _corrupt(tm: Any, path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {tm.name!r}: {path} is damaged: {why} (DATA_LOSS: digest mismatch)"
    )
