"""Read a ZIP archive's central directory from a key-value store with ranged reads (no whole download).

A pack (:mod:`arraycheckpoint.packing`) on an object store is checked before tensorstore reads a member of
it; downloading every pack whole for that check would multiply a load's traffic on object stores (at 10,000
ranks, every rank that reads one small array of a pack). The directory sits at the end of the archive, so one
suffix read of :data:`TAIL_BYTES` usually holds it: the end-of-central-directory record gives the directory's
offset and size, from which the archive's size follows, and Python's :mod:`zipfile` parses the directory
through :class:`TailFile`, which serves the tail from memory and any other range with one more read.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from typing import Any

#: Bytes of the first (suffix) read: the directory of a pack of a few thousand members.
TAIL_BYTES = 256 << 10
_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"


class TailFile(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes of which ``[start, size)`` (``data``: an archive's
    directory and end records) is known; any other range comes from ``fetch(start, end)``, or, without it,
    is refused (``zipfile.BadZipFile``: the archive's records point before its directory)."""

    def __init__(
        self, size: int, start: int, data: bytes, fetch: Callable[[int, int], bytes] | None = None
    ) -> None:
        super().__init__()
        self._size, self._start, self._data, self._fetch = size, start, data, fetch
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        end = min(self._size, self._pos + len(b))
        if end <= self._pos:
            return 0
        if self._pos >= self._start:
            data = self._data[self._pos - self._start : end - self._start]
        elif self._fetch is not None:
            data = self._fetch(self._pos, end)
        else:
            raise zipfile.BadZipFile("the archive's records point before its central directory")
        n = len(data)
        memoryview(b)[:n] = data
        self._pos += n
        return n


def central_directory(kv: Any, key: str, bound: int) -> tuple[list[zipfile.ZipInfo], int]:
    """The entries of the ZIP archive ``key`` and its size, reading its tail and, when the directory is
    larger than :data:`TAIL_BYTES`, the directory's range; at most ``bound`` bytes are ever read.

    Raises:
        FileNotFoundError: no such key.
        zipfile.BadZipFile: no ZIP archive, or one larger than ``bound``.
    """
    want = min(bound, TAIL_BYTES)
    try:
        result = kv.read(key, byte_range=slice(-want, None)).result()
    except ValueError as e:  # OUT_OF_RANGE: the object is shorter than the suffix asked for: read it whole
        if "OUT_OF_RANGE" not in str(e):
            raise
        result = kv.read(key).result()
        if result.state == "value" and len(result.value) > bound:
            raise zipfile.BadZipFile(f"larger than {bound} bytes") from None
    if result.state != "value":
        raise FileNotFoundError(key)
    tail = bytes(result.value)
    size = _archive_size(tail)
    if size > bound:
        raise zipfile.BadZipFile(f"the archive declares {size} bytes, more than {bound}")
    if size < len(tail):
        raise zipfile.BadZipFile("the end-of-directory record does not match the archive's size")

    def fetch(start: int, end: int) -> bytes:
        return bytes(kv.read(key, byte_range=slice(start, end)).result().value)

    return zipfile.ZipFile(TailFile(size, size - len(tail), tail, fetch)).infolist(), size


def _archive_size(tail: bytes) -> int:
    """The archive's size from its end-of-central-directory records (found in ``tail``, its last bytes):
    the directory's offset plus its size plus the records after it."""
    at = tail.rfind(_EOCD, max(0, len(tail) - (22 + 0xFFFF)))
    if at < 0 or at + 22 > len(tail):
        raise zipfile.BadZipFile("no end-of-central-directory record")
    _sig, _d, _dcd, _n_disk, _n, cd_size, cd_offset, comment = struct.unpack("<4s4H2LH", tail[at : at + 22])
    after = 22 + comment
    if at >= 20 and tail[at - 20 : at - 16] == _ZIP64_LOCATOR:
        (z64_at,) = struct.unpack("<Q", tail[at - 12 : at - 4])
        loc = tail.rfind(_ZIP64_EOCD, 0, at - 20)
        if loc < 0 or loc + 56 > at - 20:
            raise zipfile.BadZipFile("a zip64 locator without its record")
        cd_size, cd_offset = struct.unpack("<QQ", tail[loc + 40 : loc + 56])
        if z64_at != cd_offset + cd_size:
            raise zipfile.BadZipFile("the zip64 record is not where the directory ends")
        return cd_offset + cd_size + (at - loc) + after
    return cd_offset + cd_size + after
