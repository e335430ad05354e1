"""Large files of a local save written with ``O_DIRECT`` from a reused, aligned staging buffer.

A buffered write copies every byte into page-cache pages the kernel allocates for it, dirties them and has
its flusher threads write them back. Here a large file skips the page cache: ``O_DIRECT`` from a staging buffer
that is reused from file to file and save to save (its pages are allocated once).

A file's bytes (a chunk file of its own, or a whole pack: :mod:`.packstream`) are copied into a staging
buffer (:class:`Staged`: the checksums are summed on each slice right before it is copied, as
:mod:`.summed` does before a ``pwritev``); once complete, the buffer's aligned head is written with
``O_DIRECT`` and the unaligned tail (and a pack's central directory) with an ordinary ``pwrite``. The file's
bytes are exactly those of the buffered path. Durability is unchanged: an ``O_DIRECT`` write may still sit
in the device's volatile cache, and the file's size and extents are metadata; both are made durable by the
save's one ``syncfs`` (:meth:`arraycheckpoint.storage.local.LocalStorage.flush`), as buffered writes are. A
failed direct write is reported by the write itself.

Only where it pays and is known to work: files of at least :data:`MIN_BYTES` on ext4, XFS or btrfs
(``statfs``: not tmpfs, where it would add a copy, nor network or FUSE file systems), while the process's
staging buffers (:data:`STAGING_BYTES` in all, kept for the next save) have room; anything else is written
buffered. A file system that refuses ``O_DIRECT`` (``EINVAL``) is written buffered from then on.

Off unless ``ARRAYCHECKPOINT_DIRECT_WRITES=1``: measured at 2 FSDP2 ranks (288 MiB each, interleaved rounds on the
loaded 2-core machine) it saved 5-8% of the save's CPU time but no wall time the noise could show (paired
medians 0.96x-1.02x), the disk being the bound; and a checkpoint written so is not in the page cache, so a
load right after the save reads it from the device.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from typing import Any

import numpy as np

from .summed import pwritev_all

#: offset, length and address alignment of every ``O_DIRECT`` write (the largest logical block size in use)
ALIGN = 4096
#: files below this many bytes are written buffered (their page-cache cost is small)
MIN_BYTES = 1 << 20
#: staging bytes this process may hold (kept between saves: fresh pages cost a page fault each)
STAGING_BYTES = 96 << 20
#: ``statfs`` magic numbers of the file systems written with ``O_DIRECT``: ext2/3/4, XFS, btrfs
_DIRECT_FS = frozenset({0xEF53, 0x58465342, 0x9123683E})


def enabled() -> bool:
    """Whether direct writes were asked for (``ARRAYCHECKPOINT_DIRECT_WRITES=1``; off by default)."""
    return os.environ.get("ARRAYCHECKPOINT_DIRECT_WRITES") == "1" and hasattr(os, "O_DIRECT")


def _fs_type(path: str) -> int | None:
    """The ``statfs(2)`` file system type of ``path``, or None where it cannot be read."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type first (a long on Linux)
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
        return int(ctypes.c_long.from_buffer(buf).value) & 0xFFFFFFFF
    except (OSError, AttributeError):
        return None


def suits(path: str) -> bool:
    """Whether files under the directory ``path`` are written with ``O_DIRECT`` (:func:`enabled` and a
    block-device file system known to take it)."""
    return enabled() and _fs_type(path) in _DIRECT_FS


class _Pool:
    """This process's staging buffers (anonymous mappings: page-aligned), reused across files and saves."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._free: list[mmap.mmap] = []
        self._held = 0  # bytes of every buffer, free or lent
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap | None:
        """A buffer of at least ``nbytes`` (rounded up to :data:`ALIGN`), or None when the budget is spent."""
        need = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            fits = [m for m in self._free if len(m) >= need]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
            while self._free and self._held + need > self.budget:  # smaller free ones make room
                self._held -= len(self._free.pop())
            if self._held + need > self.budget:
                return None
            self._held += need
        return mmap.mmap(-1, need)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)


POOL = _Pool(STAGING_BYTES)


class Staged:
    """A file's bytes gathered in a staging buffer (``write_at``, the interface :func:`.summed.pwritev_all`
    writes through), then written with :meth:`commit`."""

    def __init__(self, buf: mmap.mmap, nbytes: int, path: str) -> None:
        self._buf = buf
        self._view = np.frombuffer(buf, np.uint8)
        self.nbytes = nbytes
        self.path = path

    @classmethod
    def take(cls, nbytes: int, path: str) -> Staged | None:
        """A staging buffer for a file of ``nbytes`` at ``path``, or None (too small, or no room: write it
        buffered)."""
        if nbytes < MIN_BYTES:
            return None
        buf = POOL.take(nbytes)
        return None if buf is None else cls(buf, nbytes, path)

    def write_at(self, buffers: list[Any], offset: int) -> int:
        """Copy ``buffers`` (byte views) to ``offset`` of the file; the bytes copied."""
        at = offset
        view = self._view
        for b in buffers:
            n = len(b)
            if at + n > self.nbytes:
                raise OSError(errno.EFBIG, f"{self.path}: a write past the {self.nbytes} bytes laid out")
            view[at : at + n] = np.frombuffer(b, np.uint8)
            at += n
        return at - offset

    def commit(self, fd: int, tail: list[Any] | None = None) -> int:
        """Write the gathered bytes to ``fd`` (a new, empty file opened for writing), then ``tail`` after them;
        the bytes written. The aligned head goes with ``O_DIRECT``; the rest, or everything where the file
        system refuses ``O_DIRECT``, buffered."""
        view = memoryview(self._buf)
        head = self.nbytes // ALIGN * ALIGN
        done = _write_direct(fd, view[:head], self.path) if head else 0
        rest: list[Any] = [view[done : self.nbytes], *(tail or [])]
        return done + pwritev_all(fd, rest, done, self.path)

    def release(self) -> None:
        """Give the buffer back (after :meth:`commit`, or when the file is abandoned)."""
        buf, self._buf = self._buf, None
        if buf is not None:
            self._view = None  # type: ignore[assignment]
            POOL.give(buf)


#: set once a file system refused ``O_DIRECT`` (``EINVAL``): every later file is written buffered
_refused = False


def _write_direct(fd: int, view: memoryview, path: str) -> int:
    """Write ``view`` (aligned address and length) at offset 0 of ``fd`` with ``O_DIRECT``; the bytes written
    so (the caller writes the rest buffered: a refusal or a short write leaves an aligned prefix or
    nothing). Leaves ``fd`` without ``O_DIRECT``."""
    global _refused
    if _refused:
        return 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _refused = True
        return 0
    done = 0
    try:
        while done < len(view):
            try:
                n = os.pwrite(fd, view[done:], done)
            except OSError as e:
                if e.errno != errno.EINVAL or done:
                    raise OSError(e.errno, f"writing {path} failed: {e.strerror}") from e
                _refused = True  # accepted at fcntl, refused at the write (some FUSE file systems)
                return 0
            if n <= 0:
                raise OSError(errno.EIO, f"write(2) wrote nothing to {path}")
            done += n
            if n % ALIGN:  # a short, unaligned write: the rest goes buffered
                break
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done
