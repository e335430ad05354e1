"""A file-like view of an archive of which only the tail is at hand (a pack's central directory).

A pack (:mod:`arraycheckpoint.planning.packing`) is read with ranged reads, never downloaded whole for one small array:
its last bytes hold the ZIP central directory, which :mod:`zipfile` lists through :class:`TailFile`.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Iterable
from typing import Any

from ..checks.zipdir import UNICODE_PATH_TAG


def check_member_names(infos: Iterable[zipfile.ZipInfo], where: str) -> None:
    """Refuse a member that carries a second name: an Info-ZIP Unicode Path extra field, which tensorstore's
    ``zip`` driver takes as the member's name (and refuses when it differs) while Python's :mod:`zipfile`
    (before 3.12) ignores it, so two readers would see different members; or a NUL in its name (zipfile cuts
    the name there, tensorstore does not). A pack as a save writes it has neither.

    Raises:
        CorruptCheckpointError: naming the member and ``where`` (the pack).
    """
    from ..errors import CorruptCheckpointError

    for info in infos:
        extra, pos = info.extra, 0
        while pos + 4 <= len(extra):
            tag, length = struct.unpack_from("<HH", extra, pos)
            if tag == UNICODE_PATH_TAG:
                raise CorruptCheckpointError(
                    f"member {info.filename!r} of {where} carries a Unicode Path extra field (a second name, "
                    "which tensorstore reads and zipfile ignores); a save writes none: the pack is damaged or "
                    "hostile"
                )
            pos += 4 + length
        if "\0" in info.orig_filename:
            raise CorruptCheckpointError(
                f"member {info.orig_filename!r} of {where} has a NUL byte in its name; the pack is damaged or "
                "hostile"
            )


class TailFile(io.RawIOBase):
    """A read-only, seekable file of ``size`` bytes of which ``[start, size)`` (``data``: an archive's
    directory and end records) is known; a read before ``start`` is refused (``zipfile.BadZipFile``: the
    archive's records point before its directory)."""

    def __init__(self, size: int, start: int, data: bytes) -> None:
        super().__init__()
        self._size, self._start, self._data = size, start, data
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
        else:
            raise zipfile.BadZipFile("the archive's records point before its central directory")
        n = len(data)
        memoryview(b)[:n] = data
        self._pos += n
        return n
