"""The packs behind :class:`~arraycheckpoint.interop.zarrstore.CheckpointStore`: ZIP directories and member bytes.

A pack's central directory is read once (its tail, ranged), checked against the members the metadata puts in
the pack (stored uncompressed, inside the archive before the directory, no larger than their encoding can be),
and cached; a member's bytes are read by range, and on a local path through one descriptor per pack
(:class:`_PackFiles`, opened below the root without following links, at most :data:`MAX_OPEN_PACKS` at once).
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from zarr.abc.store import ByteRequest, RangeByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from ..checks.bounds import MAX_PACKED_JSON_BYTES
from ..errors import CorruptCheckpointError
from ..format.metadata import CheckpointMetadata
from ..planning.packing import (
    PACK_DIR,
    chunk_count,
    chunk_file_bytes,
    group_keys,
    pack_key,
    stored_bytes,
)
from ..storage.ranged import TailFile, check_member_names
from . import zarrfiles
from .zarrfiles import _grid, _pread_fd, _span

#: Bytes per central-directory record allowed beyond the member's name (46 fixed, zip64 extra, slack).
_RECORD_BYTES = 46 + 32 + 1024
_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_LOCAL = b"PK\x03\x04"


@dataclass(frozen=True)
class _Member:
    """One exposed member of a pack: its central-directory entry and the bound on its size."""

    info: zipfile.ZipInfo
    limit: int


class _Pack:
    """The exposed members of one pack (its validated central directory) and where their bytes start."""

    def __init__(self, key: str, members: dict[str, _Member], directory_at: int) -> None:
        self.key = key
        self.members = members
        self.directory_at = directory_at
        # member -> offset of its bytes (from its local header, read on the member's first use)
        self.data_at: dict[str, int] = {}


def _member_name(info: zipfile.ZipInfo) -> bytes:
    """The member's name as its local header stores it."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


class _PackFiles:
    """Open descriptors of a local checkpoint's packs: each pack is opened once (below the root, never through
    a link, a regular file: :func:`_open_pack`) and read with ``pread`` from then on, so reading the chunks of
    a pack costs one open, not one per chunk. At most :data:`MAX_OPEN_PACKS` stay open (least recently used
    closed first, never one a read is using); thread-safe (reads run in worker threads)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._open: OrderedDict[str, list[int]] = OrderedDict()  # key -> [fd, reads in progress]
        self.opens = 0  # packs opened so far (what the scale tests count)

    def _acquire(self, key: str) -> list[int]:
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                self._open.move_to_end(key)
                entry[1] += 1
                return entry
        fd = zarrfiles._open_pack(self.root, key)  # looked up at call time (tests count the opens)
        with self._lock:
            self.opens += 1
            entry = self._open.get(key)
            if entry is not None:  # another thread opened it meanwhile: keep theirs
                os.close(fd)
            else:
                entry = self._open[key] = [fd, 0]
            entry[1] += 1
            idle = [k for k, (_fd, busy) in self._open.items() if not busy]  # least recently used first
            for other in idle[: max(0, len(self._open) - MAX_OPEN_PACKS)]:
                os.close(self._open.pop(other)[0])
            return entry

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

    def close(self) -> None:
        """Close every descriptor (the store's ``close``)."""
        with self._lock:
            for fd, _busy in self._open.values():
                os.close(fd)
            self._open.clear()

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


class PackReading:
    """The pack-reading half of :class:`~arraycheckpoint.interop.zarrstore.CheckpointStore`: a pack's central
    directory read, checked and cached, and its members' bytes read by range (see that module's docstring)."""

    _base: Store
    _meta: CheckpointMetadata
    _local: str | None
    _sep: str
    _packs: dict[str, _Pack]
    _ranks: dict[int, dict[str, tuple[_Pack, _Member]]]
    _in_pack: dict[str, list[str]]
    _fds: _PackFiles | None

    def _chunks_of(self, name: str, rank: int) -> np.ndarray:
        """The chunks (flat indices, ascending) of the packed array ``name`` that ``rank`` wrote: its writers
        grouped by rank once per array (a store reads every rank's packs: a scan of every writer per rank
        would cost ranks x chunks)."""
        cache = self.__dict__.setdefault("_by_writer", {})
        grouped = cache.get(name)
        if grouped is None:
            writers = self._meta.tensors[name].writers
            ranks = np.asarray(getattr(writers, "array", writers), dtype=np.int64)
            order = np.argsort(ranks, kind="stable")
            grouped = cache[name] = (order, ranks[order])
        order, ranks = grouped
        return order[np.searchsorted(ranks, rank, "left") : np.searchsorted(ranks, rank, "right")]

    async def _rank(self, rank: int) -> dict[str, tuple[_Pack, _Member]]:
        """Format 6: every member of ``rank``'s packs (``<rank>.0.zip``, ``<rank>.1.zip``, ... up to the first
        absent one), each pack's directory read and checked once: every entry must be a member that rank
        holds (none twice), and every member it holds must be there."""
        found = self._ranks.get(rank)
        if found is not None:
            return found
        from ..audit.rankpacks import rank_capacity_problem
        from ..codecs import numpy_dtype

        mine_of = {
            n: self._chunks_of(n, rank) for n in self._packed if self._meta.tensors[n].pack_rank is not None
        }
        if self._local is not None:  # before a key is built per chunk: the packs can hold that many
            chunks = {
                n: len(m) for n, m in mine_of.items() if len(m) and len(self._meta.tensors[n].writers) > 1
            }
            problem = rank_capacity_problem(self._local, rank, chunks)
            if problem is not None:
                raise CorruptCheckpointError(f"tensors {sorted(chunks)[:3]}: {problem}")
        limits: dict[str, int] = {}
        for name, mine in mine_of.items():
            t = self._meta.tensors[name]
            if t.pack_rank == rank:
                limits[f"{name}/zarr.json"] = MAX_PACKED_JSON_BYTES
            if len(mine):
                per_chunk = chunk_file_bytes(t, numpy_dtype(t.dtype).itemsize)
                grid = [-(-s // c) for s, c in zip(t.shape, t.chunk_shape)]
                for flat in mine.tolist():
                    index = [int(i) for i in np.unravel_index(flat, grid)] if grid else []
                    limits[f"{name}/{self._sep.join(['c', *map(str, index)])}"] = per_chunk
        found = {}
        for k in range(len(limits) + 1):
            key = pack_key(rank, k)
            if not await self._exists_object(key):
                break
            if k == len(limits):
                raise CorruptCheckpointError(
                    f"{self._where(key)} exists, but rank {rank}'s {len(limits)} packed member(s) fill at most "
                    f"{len(limits)} pack(s); the checkpoint is damaged or hostile"
                )
            pack = await self._read_directory(key, limits)
            for member, m in pack.members.items():
                if member in found:
                    raise CorruptCheckpointError(
                        f"{self._where(key)} holds the member {member!r} a second time (in another of rank "
                        f"{rank}'s packs); the pack is damaged or hostile"
                    )
                found[member] = (pack, m)
        missing = sorted(set(limits) - set(found))
        if missing:
            raise CorruptCheckpointError(
                f"tensor {missing[0].rpartition('/')[0]!r}: {missing[0]} is in none of rank {rank}'s packs "
                f"({self._where(PACK_DIR)}/{rank}.<k>.zip); the checkpoint is damaged"
            )
        self._ranks[rank] = found
        return found

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
        return f"{self._local or self._base}/{key}"

    async def _read_directory(self, key: str, rank_limits: dict[str, int] | None = None) -> _Pack:
        """Read and check the central directory of the pack ``key`` (see the module docstring); format 6:
        ``rank_limits`` (member -> largest size) lists every member the pack's rank holds, and an entry
        outside it is damage."""
        from ..codecs import numpy_dtype

        where = self._where(key)
        names = self._in_pack.get(key, []) if rank_limits is None else []
        limits: dict[str, int] = dict(rank_limits or {})
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
        try:
            cd_at, cd_size = _directory_span(tail, size)
            if cd_size > directory_bound:
                raise zipfile.BadZipFile(
                    f"its directory is {cd_size} bytes, more than {directory_bound} for its arrays"
                )
            if cd_at < tail_at:
                tail = await self._read(key, cd_at, tail_at) + tail
                tail_at = cd_at
            infos = zipfile.ZipFile(TailFile(size, tail_at, tail)).infolist()
        except (zipfile.BadZipFile, struct.error, ValueError, EOFError, NotImplementedError) as e:
            raise CorruptCheckpointError(
                f"{where} is not a readable ZIP archive ({e}); the pack is damaged"
            ) from None
        check_member_names(infos, where)  # one name per member, whichever reader reads the pack
        members: dict[str, _Member] = {}
        for info in infos:
            if info.filename not in limits:
                if rank_limits is not None:
                    raise CorruptCheckpointError(
                        f"{where} holds the member {info.filename!r}, which its rank did not write (a chunk of "
                        "another writer or outside the grid, or a foreign file); the pack is damaged or hostile"
                    )
                continue  # not an array the metadata puts in this pack: never served
            if info.filename in members:
                raise CorruptCheckpointError(
                    f"{where} names the member {info.filename!r} twice; the pack is damaged"
                )
            limit = limits[info.filename]
            if (
                info.compress_type != zipfile.ZIP_STORED
                or info.compress_size != info.file_size
                or info.flag_bits & 1
            ):
                raise CorruptCheckpointError(
                    f"member {info.filename!r} of {where} is compressed or encrypted; packs store members "
                    "uncompressed and nothing is inflated"
                )
            if info.file_size > limit or info.header_offset + 30 + info.file_size > cd_at:
                raise CorruptCheckpointError(
                    f"member {info.filename!r} of {where} is {info.file_size} bytes at {info.header_offset}, more "
                    f"than its encoding can be ({limit}) or beyond the archive's data; the pack is damaged"
                )
            members[info.filename] = _Member(info, limit)
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
        return _Pack(key, members, cd_at)

    async def _read_member(
        self, pack: _Pack, member: _Member, prototype: BufferPrototype, byte_range: ByteRequest | None
    ) -> Buffer:
        info = member.info
        start, end = _span(byte_range, int(info.file_size))
        if self._fds is not None:  # a local pack: its header (first use) and the bytes in one worker call
            data = await asyncio.to_thread(self._member_bytes_local, pack, info, start, end)
            return prototype.buffer.from_bytes(data)
        at = pack.data_at.get(info.filename)
        if at is None:
            name = _member_name(info)
            header = await self._read(pack.key, info.header_offset, info.header_offset + 30 + len(name))
            at = self._data_at(pack, info, header)
        data = await self._read(pack.key, at + start, at + max(start, end))
        return prototype.buffer.from_bytes(data)

    def _member_bytes_local(self, pack: _Pack, info: zipfile.ZipInfo, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the member ``info`` of the local pack ``pack`` (its local header checked
        on first use), through the pack's one descriptor."""
        assert self._fds is not None
        at = pack.data_at.get(info.filename)
        if at is None:
            name = _member_name(info)
            header = self._fds.pread(pack.key, info.header_offset, info.header_offset + 30 + len(name))
            at = self._data_at(pack, info, header)
        return self._fds.pread(pack.key, at + start, at + max(start, end))

    def _data_at(self, pack: _Pack, info: zipfile.ZipInfo, header: bytes) -> int:
        """Where the member ``info``'s bytes start, from its local ``header`` (checked against the directory
        entry); remembered in ``pack``."""
        name = _member_name(info)
        if len(header) != 30 + len(name) or header[:4] != _LOCAL or header[30:] != name:
            raise CorruptCheckpointError(
                f"member {info.filename!r} of {self._where(pack.key)} has no matching local header; the pack "
                "is damaged"
            )
        method, name_len, extra_len = struct.unpack("<H16xHH", header[8:30])
        at = info.header_offset + 30 + name_len + extra_len
        if method != zipfile.ZIP_STORED or name_len != len(name) or at + info.file_size > pack.directory_at:
            raise CorruptCheckpointError(
                f"member {info.filename!r} of {self._where(pack.key)} has an inconsistent local header; the "
                "pack is damaged"
            )
        pack.data_at[info.filename] = at
        return at
