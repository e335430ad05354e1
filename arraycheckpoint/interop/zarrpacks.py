"""The packs behind :class:`~arraycheckpoint.interop.zarrstore.CheckpointStore`: ZIP directories and member bytes.

Every pack is read as the native load reads it, by the same code, so that the store, ``verify`` and
``acp.load`` accept and refuse the same checkpoints: a pack's central directory is read once (its tail,
ranged) and parsed by :func:`arraycheckpoint.checks.zipdir._parse_zip_directory` (the layout a save writes),
and each member's local header is checked on first use by
:func:`arraycheckpoint.checks.zipdir.check_local_header`. Format 6: a member is looked for in the pack of
its rank that the metadata predicts holds it, as the load looks for it (:mod:`.zarrranks`). Format 5: the members
the metadata puts in the pack, and nothing else. A member's bytes are read by range, and on a local path
through one descriptor per pack (:class:`_PackFiles`, opened below the root without following links, at most
:data:`MAX_OPEN_PACKS` at once)"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zarr.abc.store import ByteRequest, RangeByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from ..checks.bounds import MAX_PACKED_JSON_BYTES
from ..checks.zipdir import PackMember, _parse_zip_directory, check_local_header, next_offsets
from ..errors import CorruptCheckpointError
from ..format.metadata import CheckpointMetadata
from ..planning.packing import (
    chunk_count,
    group_keys,
    stored_bytes,
)
from ..runtime.descriptors import descriptor_share
from . import zarrfiles
from .zarrfiles import _grid, _pread_fd, _span
from .zarrranks import RankWalks

#: Bytes per central-directory record allowed beyond the member's name (46 fixed, zip64 extra, slack).
_RECORD_BYTES = 46 + 32 + 1024
_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_LOCAL = b"PK\x03\x04"


@dataclass(frozen=True)
class _Member:
    """One exposed member of a pack: its central-directory entry, the bound on its size, and where the next
    member (or the directory) starts, which bounds its local header and data
    (:func:`arraycheckpoint.checks.zipdir.check_local_header`, as the load checks it)."""

    info: PackMember
    limit: int
    following: int


class _Pack:
    """The exposed members of one pack (its validated central directory) and where their bytes start."""

    def __init__(self, key: str, members: dict[str, _Member]) -> None:
        self.key = key
        self.members = members
        # member -> offset of its bytes (from its local header, read on the member's first use)
        self.data_at: dict[str, int] = {}


class _PackFiles:
    """Open descriptors of a local checkpoint's packs: each pack is opened once (below the root, never through
    a link, a regular file: :func:`_open_pack`) and read with ``pread`` from then on, so reading the chunks of
    a pack costs one open, not one per chunk. At most :data:`MAX_OPEN_PACKS` stay open (an eighth of the
    process's descriptor limit where that is fewer; least recently used closed first, never one a read is
    using); thread-safe (reads run in worker threads)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._open: OrderedDict[str, list[int]] = OrderedDict()  # key -> [fd, reads in progress]
        self.opens = 0  # packs opened so far (what the scale tests count)
        # this store's part of the process's descriptor budget; an idle store gives packs back to newcomers
        self._max_open = descriptor_share(MAX_OPEN_PACKS, trim=self._trim)

    def _acquire(self, key: str) -> list[int]:
        with self._lock:  # opened under the lock: concurrent first reads of a pack open it once, not each
            entry = self._open.get(key)
            if entry is not None:
                self._open.move_to_end(key)
                entry[1] += 1
                return entry
            fd = zarrfiles._open_pack(self.root, key)  # looked up at call time (tests count the opens)
            self.opens += 1
            entry = self._open[key] = [fd, 1]
            self._close_idle(int(self._max_open))
            return entry

    def _close_idle(self, keep: int) -> None:
        """Close the least recently used packs no read is using until at most ``keep`` are open (lock held)."""
        idle = [k for k, (_fd, busy) in self._open.items() if not busy]  # least recently used first
        for other in idle[: max(0, len(self._open) - keep)]:
            os.close(self._open.pop(other)[0])

    def _trim(self, keep: int) -> int:
        """The descriptor budget's request (another reader needs room): close idle packs down to ``keep``
        unless a read holds the lock now (then it shrinks at its next open); the packs still open."""
        if not self._lock.acquire(blocking=False):
            return len(self._open)
        try:
            self._close_idle(keep)
            return len(self._open)
        finally:
            self._lock.release()

    def _release(self, entry: list[int]) -> None:
        with self._lock:
            entry[1] -= 1

    def pread(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the pack ``key``."""
        if end <= start:
            return b""
        entry = self._acquire(key)
        try:
            return _pread_fd(entry[0], f"{self.root}/{key}", start, end)
        finally:
            self._release(entry)

    def size(self, key: str) -> int:
        """The size of the pack ``key``."""
        entry = self._acquire(key)
        try:
            return os.fstat(entry[0]).st_size
        finally:
            self._release(entry)

    #: ``os.close``, kept where interpreter shutdown (which clears module globals first) still finds it
    _close_fd = staticmethod(os.close)

    def close(self) -> None:
        """Close every descriptor (the store's ``close``)."""
        with self._lock:
            for fd, _busy in self._open.values():
                self._close_fd(fd)
            self._open.clear()
        self._max_open.release()  # its part of the process's descriptor budget goes back to the others

    def __del__(self) -> None:
        self.close()


#: Pack descriptors a local checkpoint store keeps open at most.
MAX_OPEN_PACKS = 64


def _directory_span(tail: bytes, size: int) -> tuple[int, int]:
    """The central directory's offset and size from the archive's last bytes ``tail`` (``size`` in all)."""
    at = tail.rfind(_EOCD, max(0, len(tail) - (22 + 0xFFFF)))
    if at < 0 or at + 22 > len(tail):
        raise zipfile.BadZipFile("no end-of-central-directory record")
    _sig, _d, _dcd, _n_disk, _n, cd_size, cd_at, comment = struct.unpack("<4s4H2LH", tail[at : at + 22])
    if at + 22 + comment != len(tail):
        raise zipfile.BadZipFile("bytes follow the end-of-central-directory record")
    end = size - len(tail) + at  # where the directory must end (the records after it follow)
    if at >= 20 and tail[at - 20 : at - 16] == _ZIP64_LOCATOR:
        (record,) = struct.unpack("<Q", tail[at - 12 : at - 4])
        local = record - (size - len(tail))
        if local < 0 or local + 56 > at - 20 or tail[local : local + 4] != _ZIP64_EOCD:
            raise zipfile.BadZipFile("a zip64 locator without its record")
        cd_size, cd_at = struct.unpack("<QQ", tail[local + 40 : local + 56])
        end = record
    if cd_at + cd_size != end:
        raise zipfile.BadZipFile("the central directory does not end where its end records start")
    return cd_at, cd_size


#: First read of a pack: its last bytes, which hold the central directory of a pack of a few hundred arrays.
TAIL_BYTES = 64 << 10


class PackReading(RankWalks):
    """The pack-reading half of :class:`~arraycheckpoint.interop.zarrstore.CheckpointStore`: a pack's central
    directory read, checked and cached, and its members' bytes read by range (see that module's docstring)."""

    _base: Store
    _meta: CheckpointMetadata
    _local: str | None
    _name: str  # how errors name the checkpoint (:func:`arraycheckpoint.interop.zarrstore._display`)
    _sep: str
    _packs: dict[str, _Pack]
    _in_pack: dict[str, list[str]]
    _fds: _PackFiles | None

    # Packs ------------------------------------------------------------------------------------------------
    async def _pack(self, key: str) -> _Pack:
        pack = self._packs.get(key)
        if pack is None:  # concurrent first uses may both read the directory: same result, no lock needed
            pack = await self._read_directory(key)
            self._packs[key] = pack
        return pack

    async def _read(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the checkpoint's object ``key`` (a pack)."""
        if end <= start:
            return b""
        if self._fds is not None:
            return await asyncio.to_thread(self._fds.pread, key, start, end)
        buf = await self._base.get(key, default_buffer_prototype(), RangeByteRequest(start, end))
        if buf is None:
            raise CorruptCheckpointError(f"the pack {self._where(key)} is missing; the checkpoint is damaged")
        return buf.to_bytes()

    async def _size(self, key: str) -> int:
        if self._fds is not None:
            return await asyncio.to_thread(self._fds.size, key)
        try:
            return int(await self._base.getsize(key))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"the pack {self._where(key)} is missing; the checkpoint is damaged"
            ) from None

    def _where(self, key: str) -> str:
        return f"{self._local or self._name}/{key}"

    async def _read_directory(self, key: str) -> _Pack:
        """Format 5: read and check the central directory of the pack ``key`` (see the module docstring)."""
        from ..codecs import numpy_dtype

        where = self._where(key)
        names = self._in_pack.get(key, [])
        limits: dict[str, int] = {}
        for name in names:
            t = self._meta.tensors[name]
            chunks = chunk_count(t.shape, t.chunk_shape)
            per_chunk = stored_bytes(t, numpy_dtype(t.dtype).itemsize) // max(chunks, 1)
            limits[f"{name}/zarr.json"] = MAX_PACKED_JSON_BYTES
            for index in _grid(t.shape, t.chunk_shape):
                limits[f"{name}/{'.'.join(['c', *map(str, index)])}"] = per_chunk
        for doc in group_keys(names):
            limits[doc] = MAX_PACKED_JSON_BYTES
        longest = max((len(k.encode()) for k in limits), default=0)
        directory_bound = len(limits) * (_RECORD_BYTES + longest) + 22 + 56 + 20 + 0xFFFF

        size = await self._size(key)
        tail_at = max(0, size - min(TAIL_BYTES, size))
        tail = await self._read(key, tail_at, size)
        try:  # where the directory starts, to read it with the tail (the parser below checks it all)
            cd_at, cd_size = _directory_span(tail, size)
        except (zipfile.BadZipFile, struct.error):
            cd_at, cd_size = tail_at, 0
        if cd_size > directory_bound:
            raise CorruptCheckpointError(
                f"{where} is not a ZIP archive as a save writes it: a directory of {cd_size} bytes, more than its "
                f"arrays' take ({directory_bound}); the checkpoint is damaged or hostile"
            )
        if 0 <= cd_at < tail_at:
            tail = await self._read(key, cd_at, tail_at) + tail

        # the load's own parser: the layout a save writes, strictly enough that every reader sees one directory
        entries, _size, cd_at = _parse_zip_directory(where, tail, size, size, _read_before, directory_bound)
        following = next_offsets(entries, cd_at)
        members: dict[str, _Member] = {}
        for info in entries:
            if info.filename not in limits:
                near = self._array_of(info.filename)
                about = f"tensor {near!r}: " if near is not None else ""
                raise CorruptCheckpointError(
                    f"{about}{where} holds the member {info.filename!r}, which none of its arrays has; the pack "
                    "is damaged or hostile"
                )
            if info.filename in members:
                raise CorruptCheckpointError(
                    f"{where} names the member {info.filename!r} twice; the pack is damaged"
                )
            limit = limits[info.filename]
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise CorruptCheckpointError(
                    f"member {info.filename!r} of {where} is compressed; packs store members uncompressed and "
                    "nothing is inflated"
                )
            if info.file_size > limit:
                raise CorruptCheckpointError(
                    f"member {info.filename!r} of {where} is {info.file_size} bytes, more than its encoding can be "
                    f"({limit}); the pack is damaged"
                )
            members[info.filename] = _Member(info, limit, following[info.header_offset])
        counts: dict[str, int] = {}
        for k in members:
            if not k.endswith("/zarr.json"):
                owner = self._array_of(k)
                counts[owner or ""] = counts.get(owner or "", 0) + 1
        for name in names:
            if f"{name}/zarr.json" not in members:
                raise CorruptCheckpointError(f"tensor {name!r}: its pack {where} holds no {name}/zarr.json")
            t = self._meta.tensors[name]
            if counts.get(name, 0) != chunk_count(t.shape, t.chunk_shape):
                raise CorruptCheckpointError(
                    f"tensor {name!r}: its pack {where} holds {counts.get(name, 0)} of its "
                    f"{chunk_count(t.shape, t.chunk_shape)} chunk(s); the pack is damaged"
                )
        return _Pack(key, members)

    async def _read_member(
        self, pack: _Pack, member: _Member, prototype: BufferPrototype, byte_range: ByteRequest | None
    ) -> Buffer:
        """Bytes ``byte_range`` of ``member`` (see :meth:`_member_bytes`); a local pack's reads in one worker
        call through its descriptor, an object store's as ranged reads of the pack object."""
        start, end = _span(byte_range, int(member.info.file_size))
        if self._fds is not None:
            fds = self._fds
            data = await asyncio.to_thread(
                lambda: _run_sync(self._member_bytes(pack, member, start, end, _sync_reader(fds, pack.key)))
            )
        else:
            data = await _run_async(
                self._member_bytes(pack, member, start, end, lambda a, b: self._read(pack.key, a, b))
            )
        return prototype.buffer.from_bytes(data)

    def _member_bytes(
        self, pack: _Pack, member: _Member, start: int, end: int, read: Callable[[int, int], Any]
    ) -> Any:
        """A generator of the reads (``read(a, b)``: bytes ``[a, b)`` of the pack) that fetch bytes
        ``[start, end)`` of ``member``; returns them. On the member's first use its local header is checked
        (:meth:`_data_at`): read with its bytes in one ranged read when they start at the member's start
        (what zarr asks for a whole chunk file or document), else first. Bytes cut short (a truncated pack)
        are an error naming the member and the pack."""
        info = member.info
        at = pack.data_at.get(info.filename)
        if at is None:
            first, whole = _header_reads(member)
            if start == 0:  # header and bytes together: one request per member, not two
                span = yield read(info.header_offset, info.header_offset + first + end)
                if whole(span[:first]) <= first:
                    at = self._data_at(pack, member, span[:first])
                    return self._whole(pack, member, span[at - info.header_offset :][:end], end)
            header = yield read(info.header_offset, info.header_offset + first)
            if whole(header) > len(header):  # an extra field beyond the first read, within the member's room
                header = yield read(info.header_offset, info.header_offset + whole(header))
            at = self._data_at(pack, member, header)
        data = yield read(at + start, at + max(start, end))
        return self._whole(pack, member, data, max(0, end - start))

    def _whole(self, pack: _Pack, member: _Member, data: bytes, want: int) -> bytes:
        """``data`` when it holds the ``want`` bytes asked for, else the error naming member and pack."""
        if len(data) != want:
            array = member.info.filename.rpartition("/")[0]
            raise CorruptCheckpointError(
                f"tensor {array!r}: member {member.info.filename!r} of {self._where(pack.key)} is cut short "
                f"({len(data)} of {want} bytes read); the pack is damaged or truncated"
            )
        return data

    def _data_at(self, pack: _Pack, member: _Member, header: bytes) -> int:
        """Where the member's bytes start, from its local ``header``, checked against the directory entry as
        the load checks it (:func:`arraycheckpoint.checks.zipdir.check_local_header`); remembered in ``pack``."""
        info = member.info

        at = info.header_offset + check_local_header(
            self._where(pack.key), info, header, member.following, _read_before
        )
        pack.data_at[info.filename] = at
        return at


def _sync_reader(fds: _PackFiles, key: str) -> Callable[[int, int], bytes]:
    return lambda a, b: fds.pread(key, a, b)


def _run_sync(steps: Any) -> bytes:
    """Drive a :meth:`PackReading._member_bytes` generator whose reads return bytes."""
    try:
        got = next(steps)
        while True:
            got = steps.send(got)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def _run_async(steps: Any) -> bytes:
    """Drive a :meth:`PackReading._member_bytes` generator whose reads return awaitables."""
    try:
        got = next(steps)
        while True:
            got = steps.send(await got)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _read_before(_ranges: list[tuple[int, int]]) -> list[bytes]:
    """The parser's and the local-header check's reader of bytes beyond what was read: never called, the
    store reads a directory (and a member's local header) whole before it checks it; what it would need
    instead reads as cut short."""
    return [b""]


def _header_reads(member: _Member) -> tuple[int, Callable[[bytes], int]]:
    """The bytes of ``member``'s local header read first, and from those first bytes, the length of the
    whole header when it fits the member's room (format 6: before the next member), else the first read's."""
    info = member.info
    first = 30 + len(info.raw_name)
    room = member.following - info.header_offset - int(info.file_size)
    first = max(0, min(first + 64, room))

    def whole(head: bytes) -> int:
        if len(head) < 30:
            return len(head)
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        need = 30 + name_len + extra_len
        return need if len(head) < need <= room else len(head)

    return first, whole
