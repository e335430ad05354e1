"""Small helpers of :mod:`arraycheckpoint.interop.zarrstore`: byte ranges, chunk keys, and local files read
below the checkpoint root (no link followed, sizes known before reading)."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

from ..errors import CorruptCheckpointError, MetadataError


# Helpers ----------------------------------------------------------------------------------------------------
def _span(byte_range: ByteRequest | None, size: int) -> tuple[int, int]:
    """``[start, end)`` of ``byte_range`` in a value of ``size`` bytes."""
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        return min(byte_range.start, size), min(byte_range.end, size)
    if isinstance(byte_range, OffsetByteRequest):
        return min(byte_range.offset, size), size
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, size - byte_range.suffix), size
    raise TypeError(f"unexpected byte range {byte_range!r}")


def _read_file_below(
    root: str,
    key: str,
    limit: int,
    byte_range: ByteRequest | None,
    shard: tuple[int, Callable[[int, bytes], None]] | None = None,
) -> bytes | None:
    """``byte_range`` of the file ``root/key`` (None when absent), opened below ``root`` without following a
    link and without blocking on a FIFO, refused unless it is a regular file of at most ``limit`` bytes;
    ``shard`` (:meth:`CheckpointStore._shard_check`) checks a chunk file's size and last bytes first."""
    from ..storage.local import _open_below

    fd = _open_below(root, key)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{root}/{key} is not a regular file; the checkpoint is damaged")
        if st.st_size > limit:
            raise too_large(f"{root}/{key}", st.st_size, limit)
        if shard is not None:
            n = min(shard[0], st.st_size)
            shard[1](st.st_size, os.pread(fd, n, st.st_size - n))
        start, end = _span(byte_range, st.st_size)
        data = os.pread(fd, max(0, end - start), start)
        if len(data) != max(0, end - start):
            raise CorruptCheckpointError(f"{root}/{key} changed while it was read")
        return data
    finally:
        os.close(fd)


def too_large(where: str, size: int, limit: int) -> CorruptCheckpointError:
    """The error for the file ``where`` of ``size`` bytes, above the ``limit`` of a valid checkpoint's file."""
    return CorruptCheckpointError(
        f"{where} is {size} bytes, more than a valid checkpoint's file there can be ({limit}); the checkpoint "
        "is damaged or hostile"
    )


def _grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """Every chunk index of the grid (one, ``()``, for a 0-d array)."""
    import itertools

    return itertools.product(*(range(-(-s // max(c, 1))) for s, c in zip(shape, chunk_shape)))


async def _control_read(base: Store, local: str | None, key: str, limit: int | None) -> bytes | None:
    """A control file of the checkpoint, bounded (never through a link on a local path), or None if absent."""
    from ..checks.bounds import MAX_METADATA_BYTES

    bound = MAX_METADATA_BYTES if limit is None else limit
    if local is not None:
        from ..storage.local import LocalStorage

        return await asyncio.to_thread(LocalStorage().read, local, key)
    if not await base.exists(key):
        return None
    if await base.getsize(key) > bound:
        raise MetadataError(
            f"{base}/{key} is larger than {bound} bytes; the checkpoint is damaged or hostile"
        )
    buf = await base.get(key, default_buffer_prototype())
    return None if buf is None else buf.to_bytes()


def _exists_below(root: str, key: str) -> bool:
    """Whether ``root/key`` exists (opened below ``root`` without following a link: a link raises)."""
    from ..storage.local import _open_below

    fd = _open_below(root, key)
    if fd is None:
        return False
    os.close(fd)
    return True


def _size_below(root: str, key: str, missing_ok: bool = False) -> int | None:
    if missing_ok and not _exists_below(root, key):
        return None
    fd = _open_pack(root, key)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _pread_fd(fd: int, where: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the open pack ``fd`` (named ``where`` in errors)."""
    parts = []
    while start < end:
        chunk = os.pread(fd, end - start, start)
        if not chunk:
            raise CorruptCheckpointError(f"{where} is shorter than its directory says; the pack is damaged")
        parts.append(chunk)
        start += len(chunk)
    return b"".join(parts)


def _open_pack(root: str, key: str) -> int:
    from ..storage.local import _open_below

    fd = _open_below(root, key)
    if fd is None:
        raise CorruptCheckpointError(f"the pack {root}/{key} is missing; the checkpoint is damaged")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{root}/{key} is not a regular file; the checkpoint is damaged")
    return fd


#: Inner-chunk entries of the shard indices a store remembers (per chunk key, least recently used dropped
#: first) to check the inner chunks zarr then reads by range: 24 bytes each, 96 MiB at most.
MAX_REMEMBERED_ENTRIES = 1 << 22
_EMPTY = 2**64 - 1


class ChunkChecksums:
    """The crc32c checks of what a store serves of a chunk file (zarr's ``sharding_indexed``: inner chunks
    each ending in the crc32c of their bytes, then an index of ``(offset, length)`` per inner chunk ending in
    its crc32c), made before zarr-python decodes it, so that damage is an error naming the tensor and the file
    or pack member (zarr-python's own says only "Stored and computed checksum do not match").

    A whole file is checked whole; the index, read on its own (its suffix), is checked and remembered, and an
    inner chunk read by the range the index gives is checked against its crc32c. Other ranges are served
    unchecked (zarr-python still checks what it decodes). An index is held as numpy arrays (24 bytes per
    inner chunk, however many a hostile layout declares), looked up by bisection."""

    def __init__(self) -> None:
        self._indices: OrderedDict[str, tuple[Any, Any, Any]] = OrderedDict()
        self._entries = 0
        self._lock = threading.Lock()

    def check(self, key: str, data: Any, n_inner: int, byte_range: ByteRequest | None, what: str) -> None:
        """Check ``data``, the bytes ``byte_range`` of the chunk file ``key`` of ``n_inner`` inner chunks;
        ``what`` (``tensor 'x': <file or member>``) starts the error.

        Raises:
            CorruptCheckpointError: a checksum that does not match, or an index entry outside the file.
        """
        import numpy as np

        data = np.frombuffer(data, np.uint8)  # slices are views: the bytes are not copied to be summed
        index_bytes = 16 * n_inner + 4
        if byte_range is None:
            starts, ends, numbers = _index(data[-index_bytes:], len(data) - index_bytes, index_bytes, what)
            for start, end, i in zip(starts.tolist(), ends.tolist(), numbers.tolist()):
                _check_inner(data[start:end], f"inner chunk {i}", what)
        elif isinstance(byte_range, SuffixByteRequest) and byte_range.suffix == index_bytes:
            if len(data) == index_bytes:
                spans = _index(data, None, index_bytes, what)
                with self._lock:
                    old = self._indices.pop(key, None)
                    self._entries += len(spans[0]) - (0 if old is None else len(old[0]))
                    self._indices[key] = spans
                    while self._entries > MAX_REMEMBERED_ENTRIES and len(self._indices) > 1:
                        self._entries -= len(self._indices.popitem(last=False)[1][0])
        elif isinstance(byte_range, RangeByteRequest):
            with self._lock:
                spans = self._indices.get(key)
            if spans is not None:
                starts, ends, numbers = spans
                j = int(np.searchsorted(starts, byte_range.start))
                while j < len(starts) and starts[j] == byte_range.start:
                    if ends[j] == byte_range.end:
                        _check_inner(data, f"inner chunk {int(numbers[j])}", what)
                        break
                    j += 1


def _index(index: Any, data_end: int | None, index_bytes: int, what: str) -> tuple[Any, Any, Any]:
    """The stored inner chunks of the shard ``index`` (a uint8 array; its crc32c checked): their starts
    (sorted), ends and numbers in the index; with ``data_end``, every one within the file's data."""
    import numpy as np

    from ..engine.shardfile import crc32c

    if len(index) != index_bytes or crc32c(index[:-4]) != int.from_bytes(index[-4:].tobytes(), "little"):
        raise CorruptCheckpointError(
            f"{what}: its shard index does not match its crc32c (truncated or overwritten); the checkpoint is "
            "damaged"
        )
    entries = np.frombuffer(index[:-4].tobytes(), "<u8").reshape(-1, 2)
    numbers = np.flatnonzero(~((entries[:, 0] == _EMPTY) & (entries[:, 1] == _EMPTY)))
    offsets, lengths = entries[numbers, 0], entries[numbers, 1]
    if data_end is not None and (
        (lengths < 4).any()
        or (offsets > data_end).any()
        or (lengths > data_end - np.minimum(offsets, data_end)).any()
    ):
        raise CorruptCheckpointError(
            f"{what}: its shard index has an entry outside the file; the checkpoint is damaged"
        )
    order = np.argsort(offsets, kind="stable")
    return offsets[order], offsets[order] + lengths[order], numbers[order]


def _check_inner(data: Any, which: str, what: str) -> None:
    """``data`` (a uint8 array) ends in the crc32c of the bytes before it."""
    from ..engine.shardfile import crc32c

    if len(data) < 4 or crc32c(data[:-4]) != int.from_bytes(data[-4:].tobytes(), "little"):
        raise CorruptCheckpointError(
            f"{what}: {which} does not match its crc32c (stored and computed checksums differ); the "
            "checkpoint is damaged"
        )
