"""Packs written member by member, as each member is encoded (the local file system's pack writer).

Every member's size is known before the first is encoded: a chunk file's size follows from its array's chunk
shape and dtype (:func:`arraycheckpoint.planning.packing.chunk_file_bytes`, edge chunks padded), and the
``zarr.json`` documents are encoded up front. So every member's local header and bytes have a fixed offset in
the pack, and a member is written with ``pwritev(2)`` at its offset as soon as it is encoded, on the writer's
threads, while the next ones are encoded: the pack's bytes reach the page cache (and, through
:func:`.shardfile.start_writeback`, the device) during the save instead of after its last member. The central
directory follows the last member written. The file's bytes are exactly :func:`.packfile.write_zip`'s for the
same members in the same order (``tests/test_packstream.py``), so every reader of packs reads it unchanged.
A member's CRC-32 (in its local header) is summed on the writing thread: a large chunk's slice by slice beside
its CRC32C right before each slice is written (:mod:`.summed`), its local header written after its bytes.

Small members are handed to the threads in batches (:data:`BATCH_BYTES`, :data:`BATCH_MEMBERS`), each batch's
members that are neighbours in the file written with one ``pwritev``. A pack whose write failed, or that a
failed save left incomplete, is closed and removed (:meth:`StreamedPack.abandon`): no file without its
directory is left behind, and no descriptor.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zipfile
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import SaveFailedError
from . import direct, summed
from .packfile import Buffer, Member, _crc32, _flat, central_directory, header_parts, local_header

#: A batch of small members is handed to the writer's threads once it holds this many bytes ...
BATCH_BYTES = 4 << 20
#: ... or this many members (or when the pack's last member arrives, or at :meth:`StreamedPack.flush`).
BATCH_MEMBERS = 128
#: A member of one buffer up to this size is written joined to its header (one buffer instead of two).
_JOIN_BYTES = 1 << 12

#: ``submit(task, nbytes)``: run ``task`` on one of the writer's threads (chosen by ``nbytes``).
Submit = Callable[[Callable[[], None], int], Any]
#: ``later(task)``: run ``task`` on the writer's write-back thread, after every task handed to it before.
Later = Callable[[Callable[[], None]], None]


class StreamedPack:
    """One pack file, created now, whose members are written at fixed offsets as they arrive.

    ``members``: ``(key, nbytes)`` of every member in pack order. :meth:`add` takes member ``index``'s buffers
    (from one thread: the save's) and returns the future of the batch that writes it. The last write of a
    member writes the central directory and hands the file to ``release(fd, nbytes)`` (the writer closes it
    after starting its write-back). Ranges of at least ``writeback_bytes`` start their device write-back on
    the write-back thread (``later``) as soon as they are written.
    """

    def __init__(
        self,
        path: str,
        members: list[tuple[str, int]],
        submit: Submit,
        later: Later,
        release: Callable[[int, int], None],
        writeback: Callable[[int, int, int], None],
        writeback_bytes: int,
        stage: Callable[[int, str], direct.Staged | None] | None = None,
    ) -> None:
        self.path = path
        self._submit, self._later, self._release = submit, later, release
        self._writeback, self._writeback_bytes = writeback, writeback_bytes
        self._members = _Members(path, members)
        #: each member's CRC-32, known on the writing thread; its local header around it (None: zip64)
        self._crcs: list[int | None] = [None] * len(members)
        self._headers = header_parts(members)
        self._offsets: list[int] = []  # of each member's local header
        self._header_bytes: list[int] = []
        offset = 0
        for key, nbytes in members:
            # zipfile's local header: 30 bytes, the UTF-8 name, no extra field but zip64's sizes (20 bytes)
            header = 30 + len(key.encode("utf-8")) + (20 if _zip64(nbytes) else 0)
            self._offsets.append(offset)
            self._header_bytes.append(header)
            offset += header + nbytes
        self.end = offset  # where the central directory starts
        self._left = len(members)  # members not yet written (or failed)
        self._lock = threading.Lock()
        self._failed = False
        self._done = False
        self._batch: list[tuple[int, list[Any]]] = []
        self._batch_bytes = 0
        self._batch_future: Future[None] = Future()
        self._queue: deque[tuple[list[tuple[int, list[Any]]], Future[None]]] = deque()
        self._draining = False  # a thread is writing this pack's queued batches
        flags = (
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
        self._fd: int | None = os.open(path, flags, 0o644)
        #: the pack's bytes gathered for one ``O_DIRECT`` write at its end (:mod:`.direct`), or None: written
        #: in place as they arrive (taken once the file is open: an open that fails holds no staging budget)
        try:
            self._staged = stage(offset, path) if stage is not None else None
        except BaseException:  # no staging memory: no descriptor and no empty file left behind
            os.close(self._fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        if not members:  # an empty pack: just its end records
            self._left = 1
            self._finish(1)

    @property
    def complete(self) -> bool:
        """Every member was handed to :meth:`add`."""
        return self._members.complete

    @property
    def closed(self) -> bool:
        """The pack's file is no longer held open here (written whole and handed on, or removed)."""
        return self._fd is None

    def add(self, index: int, parts: list[Any]) -> tuple[Future[None], int]:
        """Queue member ``index``'s bytes (``parts``, in order; their CRC-32 is summed on the writing thread);
        the future of the batch that writes it, and the member's bytes.

        Raises:
            SaveFailedError: the member was added before, or its bytes are not the size the pack was laid
                out with (a plan and an encoder that disagree: nothing is written at a wrong offset).
        """
        nbytes = self._members.arrive(index, parts)
        self._batch.append((index, parts))
        self._batch_bytes += nbytes
        fut = self._batch_future
        if self._batch_bytes >= BATCH_BYTES or len(self._batch) >= BATCH_MEMBERS or self.complete:
            self.flush()
        return fut, nbytes

    def flush(self) -> None:
        """Hand the pending batch to the writer's threads.

        One pack's batches are written one after the other, never by two threads at once: two threads writing
        one file contend for its inode lock (measured at 2 FSDP2 ranks: 40% more CPU time, the waiting
        writer spinning, and a slower save than writing the pack whole). Another pack's batches go on meanwhile
        on the other threads."""
        if not self._batch:
            return
        batch, fut, nbytes = self._batch, self._batch_future, self._batch_bytes
        self._batch, self._batch_bytes, self._batch_future = [], 0, Future()
        with self._lock:
            self._queue.append((batch, fut))
            if self._draining:
                return  # the thread writing this pack takes it next
            self._draining = True
        self._submit(self._drain, nbytes)

    def _drain(self) -> None:
        """Write this pack's queued batches until none is left."""
        while True:
            with self._lock:
                if not self._queue:
                    self._draining = False
                    return
                batch, fut = self._queue.popleft()
            error: BaseException | None = None
            try:
                self._write(batch)
            except BaseException as e:  # noqa: BLE001 - reported through the batch's future
                self._failed, error = True, e
            try:
                self._finish(len(batch))
            except BaseException as e:  # noqa: BLE001 - the central directory's write failed
                error = error or e
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    def abandon(self) -> None:
        """Close and remove a pack that will not be completed (a failed save): call after its last write."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._remove()

    def _write(self, batch: list[tuple[int, list[Any]]]) -> None:
        """Write the members of ``batch``: each run of neighbours in the file with one ``pwritev``."""
        batch.sort(key=lambda m: m[0])
        run: list[Buffer] = []
        start = prev = -2
        keys, sizes, offsets = self._members.keys, self._members.sizes, self._offsets
        for index, parts in batch:
            deferred = len(parts) > 1 and summed.has_deferred(parts)
            if deferred:  # a large chunk: summed as written, its header after its bytes
                if run:
                    self._pwrite(run, offsets[start])
                    run = []
                at = offsets[index] + self._header_bytes[index]
                crc, nbytes = summed.write(self._sink(), parts, at, self.path, zip_crc=True)
                self._queue_writeback(at, nbytes)
                flat: list[Buffer] = []
            elif len(parts) == 1 and type(parts[0]) is bytes:  # a document, a small chunk file: one buffer
                flat = parts
                crc = zlib.crc32(parts[0])
            else:
                flat = [_flat(p) if isinstance(p, np.ndarray) else p for p in parts]
                crc = 0
                for p in flat:
                    crc = _crc32(p, crc)
            self._crcs[index] = crc
            parts_of = self._headers[index]
            if parts_of is not None:
                header = parts_of[0] + crc.to_bytes(4, "little") + parts_of[1]
            else:
                header = local_header((keys[index], crc, sizes[index], offsets[index]))
            if len(header) != self._header_bytes[index]:  # a name zipfile would alter (checked names never)
                raise SaveFailedError(
                    f"the local header of {keys[index]} in {self.path} is not the {self._header_bytes[index]} "
                    "bytes its layout assumed"
                )
            if deferred:
                self._pwrite([header], offsets[index])
                continue
            if run and index != prev + 1:
                self._pwrite(run, offsets[start])
                run = []
            if not run:
                start = index
            if flat is parts and len(parts[0]) <= _JOIN_BYTES:
                run.append(header + parts[0])  # one buffer for the header and its small member
            else:
                run.append(header)
                run.extend(flat)
            prev = index
        if run:
            self._pwrite(run, offsets[start])

    def _open_fd(self) -> int:
        fd = self._fd
        assert fd is not None, "a pack written after it was closed"
        return fd

    def _sink(self) -> Any:
        """Where member bytes go: the staging buffer, or the file."""
        return self._staged if self._staged is not None else self._open_fd()

    def _pwrite(self, buffers: list[Buffer], offset: int) -> None:
        total = summed.pwritev_all(self._sink(), buffers, offset, self.path)
        self._queue_writeback(offset, total)

    def _queue_writeback(self, offset: int, nbytes: int) -> None:
        """Start the device write-back of ``nbytes`` written at ``offset``, on the write-back thread, where
        they are at least ``writeback_bytes`` (not for a staged pack: it is written at its end)."""
        if nbytes >= self._writeback_bytes and self._staged is None:
            fd = self._open_fd()
            self._later(lambda: self._writeback(fd, offset, nbytes))

    def _finish(self, count: int) -> None:
        """``count`` members written (or failed). After the last: the central directory, and the file handed
        to ``release``; or, when any write failed, the file removed."""
        with self._lock:
            self._left -= count
            if self._left or self._done:
                return
            self._done = True
        if self._failed:
            self._remove()
            return
        staged = self._staged
        try:
            records = zip(self._members.keys, self._crcs, self._members.sizes, self._offsets)
            directory = central_directory([r for r in records if r[1] is not None], self.end)
            if staged is not None:  # the whole pack now: its aligned head direct, the rest buffered
                staged.commit(self._open_fd(), [memoryview(directory)])
            else:
                self._pwrite([memoryview(directory)], self.end)
        except BaseException:
            self._remove()
            raise
        fd, self._fd = self._fd, None
        assert fd is not None
        if staged is not None:
            self._staged = None
            staged.release()
            self._release(fd, 0)  # on the device already but for its tail: closed now (syncfs does the rest)
            return
        self._release(fd, self.end + len(directory))

    def _remove(self) -> None:
        """Close the file (after the write-back requests queued for it) and unlink it."""
        fd, self._fd = self._fd, None
        path = self.path
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.release()

        def run() -> None:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)

        self._later(run)


class WholePack:
    """A pack written in one piece once every member arrived (a key-value store takes one value per object):
    the same interface as :class:`StreamedPack`. ``write(members)`` writes the pack and returns its future."""

    def __init__(
        self, name: str, members: list[tuple[str, int]], write: Callable[[list[Member]], Any]
    ) -> None:
        self.path = name
        self._members = _Members(name, members)
        self._parts: list[list[Buffer]] = [[] for _ in members]
        self._write = write

    @property
    def complete(self) -> bool:
        """Every member was handed to :meth:`add`."""
        return self._members.complete

    def add(self, index: int, parts: list[Buffer]) -> tuple[Any, int] | None:
        """Hold member ``index``'s bytes (zipfile sums their CRC-32); after the last member: the pack's write
        future and its bytes."""
        self._members.arrive(index, parts)
        self._parts[index] = parts
        if not self.complete:
            return None
        members = list(zip(self._members.keys, self._parts))
        self._parts = []
        return self._write(members), sum(self._members.sizes)

    def flush(self) -> None:
        pass

    def abandon(self) -> None:
        self._parts = []


class _Members:
    """A pack's members as laid out (keys and sizes in pack order), and which of them arrived."""

    def __init__(self, pack: str, members: list[tuple[str, int]]) -> None:
        self.pack = pack
        self.keys = [key for key, _n in members]
        self.sizes = [n for _key, n in members]
        self._arrived = [False] * len(members)
        self._count = 0

    @property
    def complete(self) -> bool:
        return self._count == len(self.keys)

    def arrive(self, index: int, parts: list[Buffer]) -> int:
        """Mark member ``index`` arrived with ``parts``; its bytes.

        Raises:
            SaveFailedError: the member arrived before, or its bytes are not the size the pack was laid out
                with (a plan and an encoder that disagree: nothing is written at a wrong offset).
        """
        nbytes = 0
        for p in parts:  # (a loop: this runs once per member, 100,000 times for as many small tensors)
            nbytes += p.nbytes if isinstance(p, np.ndarray) else len(p)
        if self._arrived[index] or nbytes != self.sizes[index]:
            what = (
                "twice"
                if self._arrived[index]
                else f"with {nbytes} bytes, not the {self.sizes[index]} planned"
            )
            raise SaveFailedError(f"pack member {self.keys[index]} of {self.pack} was written {what}")
        self._arrived[index] = True
        self._count += 1
        return nbytes


def _zip64(nbytes: int) -> bool:
    """Whether a member's local header carries zip64 sizes (what zipfile's ``open(..., force_zip64=...)``
    decides in :func:`.packfile.write_zip`)."""
    return nbytes >= zipfile.ZIP64_LIMIT


def _nbytes(p: Any) -> int:
    return int(p.nbytes) if isinstance(p, np.ndarray) else len(p)


def write_pack_file(path: str, members: list[Member]) -> None:
    """Create ``path`` (exclusively, never through a symbolic link) holding the pack of ``members``, written
    member by member in the calling thread (:class:`StreamedPack` without a writer's threads): the bytes of
    :func:`.packfile.write_zip`. A failed write leaves no file and no descriptor behind."""
    pack = StreamedPack(
        path,
        [(key, sum(_nbytes(p) for p in parts)) for key, parts in members],
        lambda task, _nbytes: task(),
        lambda task: task(),
        lambda fd, _nbytes: os.close(fd),
        lambda _fd, _offset, _nbytes: None,
        1 << 62,
    )
    futures = [pack.add(i, parts)[0] for i, (_key, parts) in enumerate(members)]
    pack.flush()
    for fut in futures:
        fut.result()
