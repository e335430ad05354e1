"""Read packed chunks (formats 5 and 6) straight into their destinations, verifying both checksums with CRC32C.

The mirror of :func:`arraycheckpoint.engine.shardfile.encode` for the chunk files a save puts in packs
(:mod:`arraycheckpoint.planning.packing`: uncompressed, edge chunks padded): a member's bytes are a ``sharding_indexed``
shard, every inner chunk's little-endian bytes followed by their ``crc32c``, then the index (``(offset,
nbytes)`` as little-endian uint64 per inner chunk) and the index's ``crc32c``. Each member a load needs is
read by :func:`arraycheckpoint.engine.chunkread.read_shard` at its offset in the pack, like a chunk file of
its own: on a local file, the member read whole in order (its local header, each inner chunk into the
destination that holds it whole and contiguously, else into one staging buffer reused for every member, the
checksums and the index; ``preadv`` calls of about 256 KiB, each block checksummed as it lands), the index
first for a part of a member; on an object store, the member's bytes in a merged ranged read of the members
the load reads of that pack (:mod:`.coalesce`: tensorstore's key-value store of the pack object, issued
ahead), or the pack's end its directory check read, whose bytes are the only staging. The index and
every inner chunk that meets a region are checked with ``google_crc32c``; staged bytes are copied once into
the destination of each region (the tensor itself, or the staging buffer a sink asked for).

Format 6 chunks are found by key in the central directories the load's checks parsed
(:func:`arraycheckpoint.audit.rankpacks.check_rank_packs`: the packs of each chunk's writer), and the array's
``zarr.json`` (in its creator's packs) is checked against the metadata (:func:`arraycheckpoint.checks
.check_packed_doc`). Only the exact layout a save writes is decoded (every inner chunk present, in C order,
of its exact size): a format-5 member in another layout goes back to tensorstore; a format-6 one is damage.
A checksum that does not match raises :class:`CorruptCheckpointError` naming the tensor and the pack.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..checks import zipdir  # zipdir.check_local_header: looked up at call time (tests count its calls)
from ..errors import CorruptCheckpointError, InconsistentCheckpointError
from ..planning.regions import Box
from . import chunkread, shardfile
from .chunksmet import chunks_met, first
from .coalesce import SpanReader
from .common import open_packs_allowed
from .packdoc import DocCheck as _DocCheck

#: A ZIP local file header: signature, versions, flags, method, time, date, crc, sizes, name and extra lengths.
_LOCAL = struct.Struct("<4s5H3L2H")


def fast_path_available() -> bool:
    """Whether this interpreter has the hardware CRC32C (else tensorstore reads format-5 packed arrays)."""
    return chunkread.available()


class PackFile:
    """One pack opened for reading: members by name, read with ``pread`` (local file, never through a link)
    or ranged reads (``kvstore``: an object store's key-value store of the pack directory)."""

    def __init__(
        self,
        root: str,
        key: str,
        members: dict[str, Any],
        kvstore: Any = None,
        unchecked: Any = None,
        dir_fd: int | None = None,
    ) -> None:
        self.path = f"{root.rstrip('/')}/{key}"
        self.key = key
        self._members = members
        #: member -> where the next member's header starts: members whose local header the load's checks left
        #: to this reader (checked on the bytes read with the member, before they are used)
        self._unchecked: dict[str, int] = unchecked or {}
        self._kv = kvstore
        self._leaf = key.rpartition("/")[2]
        self._fd = -1
        #: an object store's merged reads of this load's members (:class:`.coalesce.SpanReader`), or None
        self.ahead: Any = None
        #: the last :data:`_WINDOW` bytes read ahead from a local pack (offset, bytes): small members a load
        #: reads one after the other (the document and chunk of each small tensor, in pack order) come from
        #: it, not from a ``pread`` each
        self._window: tuple[int, np.ndarray] = (0, np.empty(0, np.uint8))
        self._ahead = 0  # bytes the last window read
        if kvstore is None:
            # below the root one component at a time, no link, non-blocking, a regular file: the pack may have
            # been swapped since the load's checks (a FIFO, a directory, a link to ``.acp``)
            from ..checks.files import open_regular, open_regular_at

            what = f"pack {key!r}: "
            opened = (
                open_regular(root.rstrip("/"), key, what=what)
                if dir_fd is None  # else ``dir_fd`` is the pack's directory, opened so by the reader
                else open_regular_at(dir_fd, self._leaf, self.path, what=what)
            )
            if opened is None:
                raise InconsistentCheckpointError(f"{self.path} is missing; the checkpoint is damaged")
            self._fd = opened[0]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read(self, offset: int, nbytes: int, staging: np.ndarray | None) -> np.ndarray:
        if self._fd < 0:
            held = None if self.ahead is None else self.ahead.read(self._leaf, offset, nbytes)
            if held is not None:  # a view of a merged read's bytes (the only staging, as a read alone)
                return held
            try:
                result = self._kv.read(self._leaf, byte_range=slice(offset, offset + nbytes)).result()
            except ValueError as e:  # tensorstore's errors; a range past the end: the pack was cut since
                if "OUT_OF_RANGE" not in str(e):  # the checks, a short read (damage, named by the caller)
                    raise
                return np.empty(0, np.uint8)
            raw = bytes(result.value) if result.state == "value" else b""
            return np.frombuffer(raw, dtype=np.uint8)
        buf = (
            staging[:nbytes]
            if staging is not None and staging.nbytes >= nbytes
            else np.empty(nbytes, np.uint8)
        )
        got = os.preadv(self._fd, [buf], offset)
        return buf[:got]

    def _near(self, offset: int, nbytes: int) -> np.ndarray | None:
        """Bytes ``[offset, offset + nbytes)`` of a local pack through the read-ahead window (cut short where the
        file ends), or None for a member too large for it or a pack on an object store."""
        if self._fd < 0 or nbytes > _WINDOW // 4:
            return None
        at, held = self._window
        if offset < at or offset + nbytes > at + len(held):  # (one cut short by the file's end: read again)
            # read ahead as far as the reads go on in order (grown 4x per window up to _WINDOW); a read
            # elsewhere (a load that needs some members only) starts again small: never 1 MiB per member
            end = at + len(held)
            ahead = (
                min(_WINDOW, 4 * self._ahead) if end - _WINDOW_START <= offset <= end + _WINDOW_START else 0
            )
            self._ahead = max(ahead, _WINDOW_START, nbytes)
            at, held = self._window = (offset, self._read(offset, self._ahead, None))
        return held[offset - at : offset - at + nbytes]

    def _read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        return [self._read(o, n, None).tobytes() for o, n in ranges]

    def _lead_check(self, name: str, info: Any) -> Callable[[bytes], int | None]:
        """The check of member ``name``'s local header bytes (up to its name's end): how far past the name its
        data starts, or None when it is not a stored member of that name. A member the load's checks left to
        this reader gets every check of :func:`arraycheckpoint.checks.zipdir.check_local_header` (which raises)."""
        return lambda raw: self._lead(name, info, raw)

    def _lead(self, name: str, info: Any, raw: bytes) -> int | None:
        """:meth:`_lead_check`'s check applied to ``raw`` (without making the check first)."""
        following = self._unchecked.get(name)
        if following is None:
            return _header_check(name)(raw)
        head = _LOCAL.size + len(info.raw_name)
        return zipdir.check_local_header(self.path, info, raw, following, self._read_many) - head

    def doc(self, name: str) -> bytes | None:
        """The stored bytes of the ``zarr.json`` member ``name`` (:meth:`member`). A save puts each array's
        document just before its chunks, so a load reading arrays in name order reads both through the pack's
        read-ahead window (:meth:`_near`): one ``pread`` per window, not one per array."""
        return self.member(name)

    def member_view(self, name: str, staging: np.ndarray | None = None) -> np.ndarray | None:
        """The stored bytes of member ``name`` (a view of ``staging`` when it is large enough), or None when
        its local header is not what a save writes."""
        info = self._members.get(name)
        if info is None:
            return None
        head = _LOCAL.size + len(name.encode())
        got = self._near(info.header_offset, head + info.file_size)
        if got is None:
            got = self._read(info.header_offset, head + info.file_size, staging)
        if len(got) < head:
            return None
        shift = self._lead(name, info, got[:head].tobytes())
        if shift is None:
            return None
        if shift:  # a zip64 extra field: the data starts after it
            got = self._read(info.header_offset + head + shift, info.file_size, staging)
            return got if len(got) == info.file_size else None
        data = got[head:]
        return data if len(data) == info.file_size else None

    def member(self, name: str) -> bytes | None:
        """The stored bytes of member ``name``, or None when its local header is not what a save writes."""
        view = self.member_view(name)
        return None if view is None else view.tobytes()

    def read_small_chunk(self, name: str, lay: chunkread.ShardLayout, target: np.ndarray) -> bool:
        """Read the chunk file stored as member ``name`` into ``target`` (the whole chunk: a C-contiguous array
        of its shape and the stored dtype) when it is one small inner chunk in exactly the layout a save writes,
        from the read-ahead window: its local header checked as :meth:`read_chunk` checks it, the index equal to
        the exact one, the data's crc32c equal to the stored one. False (``target`` untouched): anything else,
        which the caller reads with :meth:`read_chunk` (every check and error of the general path)."""
        info = self._members.get(name)
        if info is None or lay.n_inner != 1 or info.file_size != lay.nbytes:
            return False
        head = _LOCAL.size + len(name.encode())  # as read_chunk reads it
        raw = self._near(info.header_offset, head + lay.nbytes)
        if raw is None or len(raw) != head + lay.nbytes:
            return False
        if self._lead(name, info, raw[:head].tobytes()) != 0:
            return False
        ib = lay.inner_bytes
        if raw[head + ib + 4 :].tobytes() != lay.exact_table():
            return False
        data = raw[head : head + ib]
        if shardfile.crc32c(data) != int.from_bytes(raw[head + ib : head + ib + 4].tobytes(), "little"):
            return False
        target.reshape(-1).view(np.uint8)[...] = data
        return True

    def read_chunk(
        self,
        name: str,
        lay: chunkread.ShardLayout,
        origin: tuple[int, ...],
        dests: list[chunkread.Dest],
        staging: chunkread.Staging,
        damaged: Callable[[str], Exception],
    ) -> tuple[int, int] | None:
        """Read the chunk file stored as member ``name`` (the chunk at ``origin``) into ``dests``
        (:func:`.chunkread.read_shard`): on a local file with its local header in the same ``preadv``; from an
        object store with its ranged read (header and member; merged with its neighbours: :mod:`.coalesce`), the
        only staging. None: not in the layout a save writes (local header included)."""
        info = self._members.get(name)
        if info is None:
            return None
        if self._fd < 0:  # the ranged read of the member (and its local header): the only staging
            raw = self.member_view(name)
            if raw is None:
                return None
            return chunkread.read_shard(raw, 0, len(raw), lay, origin, dests, staging, damaged)
        head = _LOCAL.size + len(name.encode())
        return chunkread.read_shard(
            self._fd,
            info.header_offset + head,
            info.file_size,
            lay,
            origin,
            dests,
            staging,
            damaged,
            (head, self._lead_check(name, info)),
        )


def _header_check(name: str) -> Callable[[bytes], int | None]:
    """The check of member ``name``'s local header (its bytes before the name's end): how far past the name
    its data starts (the extra field's length), or None when it is not a stored member of that name."""
    raw = name.encode()

    def check(head: bytes) -> int | None:
        if len(head) != _LOCAL.size + len(raw):
            return None
        sig, _v, _f, method, _t, _d, _crc, _cs, _s, nlen, xlen = _LOCAL.unpack_from(head)
        if sig != b"PK\x03\x04" or method != 0 or nlen != len(raw) or head[_LOCAL.size :] != raw:
            return None
        return xlen

    return check


#: the decoding constants of one packed array (kept under this name for the readers of format 5 and 6)
_Layout = chunkread.ShardLayout


def decode_into(
    raw: np.ndarray,
    lay: chunkread.ShardLayout,
    origin: tuple[int, ...],
    dests: list[tuple[Box, np.ndarray]],
    damaged: Any,
) -> bool:
    """Check the chunk file ``raw`` (uint8, in memory) of the chunk at ``origin`` and copy its inner chunks
    into every destination ``(region, array of that region)`` they meet (inner chunks that meet none are not
    checked). Returns False when ``raw`` is not in the layout a save writes; ``damaged(why)`` is the error to
    raise on a checksum mismatch."""
    if len(raw) != lay.nbytes:
        return False
    return (
        chunkread.read_shard(raw, 0, len(raw), lay, origin, dests, chunkread.Staging(), damaged) is not None
    )


class PackedReader:
    """Packed arrays of one load, read chunk by chunk from their packs (each opened once) into the regions'
    destinations."""

    def __init__(
        self,
        root: str,
        meta: Any,
        storage: Any,
        directories: dict[str, list[Any]],
        unchecked: dict[str, dict[str, int]] | None = None,
    ) -> None:
        from ..format.metadata import chunk_key_separator
        from ..storage.local import LocalStorage

        self._root, self._meta, self._storage = root, meta, storage
        self._directories = directories  # what the load's checks parsed (audit.packs.check_packs and friends)
        # pack -> member -> next header offset: local headers the checks left to this reader (read once)
        self._unchecked = unchecked or {}
        self._sep = chunk_key_separator(meta.format_version)
        #: open packs, least recently used first: at most :data:`MAX_OPEN_PACKS` (a resharded load reads from
        #: the packs of every saving rank: thousands, more than a process may hold descriptors for)
        self._packs: OrderedDict[str, PackFile] = OrderedDict()
        self._dirs: dict[
            str, int
        ] = {}  # open directories of local packs (``.acp/packs``): :meth:`_directory`
        self._max_open = open_packs_allowed()  # packs open at once (least recently used closed first)
        self._members: dict[str, dict[str, Any]] = {}  # pack key -> its members by name (once per pack)
        self._ends: dict[str, int] = {}  # pack key -> where its last member ends (object stores)
        self._where: dict[str, str] = {}  # member -> pack key (format 6, from the directories)
        for key, entries in directories.items():
            for e in entries:
                self._where.setdefault(e.filename, key)
        self._local = isinstance(storage, LocalStorage)
        self._kv: Any = None
        self._staging = chunkread.Staging()
        self._docs = _DocCheck(self._sep)
        self._layouts: dict[tuple[Any, ...], chunkread.ShardLayout] = {}
        #: bytes read straight into destinations, and through the staging buffer (then copied once more)
        self.direct_bytes = 0
        self.scratch_bytes = 0

    def _entries(self, key: str) -> dict[str, Any]:
        """Pack ``key``'s members by name, from the directory the load's checks parsed (indexed once, kept
        when the pack is closed)."""
        members = self._members.get(key)
        if members is None:
            entries = self._directories.get(key)
            if entries is None:  # not checked by this load (cannot happen through LoadPipeline)
                from ..audit.packdir import read_pack_directory

                entries, _size = read_pack_directory(self._storage, self._root, self._meta, key)
            members = self._members[key] = {e.filename: e for e in entries}
        return members

    def _pack(self, key: str) -> PackFile:
        pack = self._packs.get(key)
        if pack is not None:
            self._packs.move_to_end(key)
        else:
            members = self._entries(key)
            kv = None if self._local else self._remote_kv()
            limit = int(self._max_open)  # this load's part of the process's descriptor budget, now
            while self._packs and len(self._packs) >= limit:
                self._packs.popitem(last=False)[1].close()
            pack = self._packs[key] = PackFile(
                self._root, key, members, kv, self._unchecked.get(key), self._directory(key)
            )
        return pack

    def _remote_kv(self) -> Any:
        """The object store's key-value store of the packs' directory (opened once per load)."""
        if self._kv is None:
            from ..audit.packdir import ranged_kvstore
            from ..planning.packing import PACK_DIR

            self._kv = ranged_kvstore(self._storage, f"{self._root.rstrip('/')}/{PACK_DIR}")
        return self._kv

    def _ahead(self, reads: dict[str, list[tuple[Any, ...]]]) -> SpanReader:
        """Merged ranged reads of the members ``reads`` lists (each pack's in offset order: a member's local
        header and data, as :meth:`PackFile.member_view` reads them), issued ahead (:mod:`.coalesce`). Each
        pack's spans end at its last member's end, which the checks found before its directory, within its
        size."""
        plan = []
        for key, members in reads.items():
            entries = self._members[key]  # indexed by ``place``
            end = self._ends.get(key)
            if end is None:
                end = self._ends[key] = max(
                    (e.header_offset + _LOCAL.size + len(e.raw_name) + e.file_size for e in entries.values()),
                    default=0,
                )
            ranges = [
                (info.header_offset, _LOCAL.size + len(m[2].encode()) + info.file_size)
                for m in members
                if (info := entries.get(m[2])) is not None
            ]
            # audit.packdir.PackDirectory: the pack's end, which the check of its directory read
            checked = self._directories.get(key)
            held = getattr(checked, "held", None)
            plan.append((key.rpartition("/")[2], ranges, end, (checked.at, held) if held else None))
        return SpanReader(self._remote_kv(), plan)

    def _directory(self, key: str) -> int | None:
        """The open directory holding the local pack ``key`` (opened once, below the root without a link:
        a pack opened again costs one ``openat``), or None (object stores; a key without a directory)."""
        parent = key.rpartition("/")[0]
        if not self._local or not parent:
            return None
        fd = self._dirs.get(parent)
        if fd is None:
            from ..checks.files import open_directory

            try:
                fd = open_directory(self._root.rstrip("/"), parent)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"pack {key!r}: {e}") from None
            if fd is None:
                raise InconsistentCheckpointError(
                    f"{self._root.rstrip('/')}/{key} is missing; the checkpoint is damaged"
                )
            self._dirs[parent] = fd
        return fd

    def _open(self, tm: Any, key: str) -> PackFile:
        try:
            return self._pack(key)
        except (CorruptCheckpointError, InconsistentCheckpointError) as e:  # swapped since the checks
            raise type(e)(f"tensor {tm.name!r}: {e}") from None

    def deliver(self, t: Any) -> int | None:
        """:meth:`deliver_many` of the one load tensor ``t``: the bytes delivered, or None (format 5 only) when
        a member is not in the layout a save writes (read it through tensorstore then)."""
        total, left = self.deliver_many([t])
        return None if left else total

    def deliver_many(self, tensors: list[Any]) -> tuple[int, list[Any]]:
        """Read the regions of the load tensors ``tensors`` (their shards) of packed arrays into their
        destinations, in pack order, and hand them to their sinks; returns the bytes delivered and the tensors
        left to tensorstore (format 5 only: a member not in the layout a save writes).

        Every member to read (each chunk a region meets, a format-6 array's ``zarr.json``) is placed first;
        then the packs are read one after the other, each member of a pack in the order of its offset: a pack
        is opened once for all the arrays, however many packs a load may keep open (arrays spread over more
        saving ranks' packs than that opened every pack again for every array), and its small members come
        from the read-ahead window. The destinations the caller has no target for are allocated first (the
        caller bounds their bytes: :func:`arraycheckpoint.engine.load`), and handed to their sinks once every
        read of ``tensors`` succeeded.

        Raises:
            CorruptCheckpointError: a checksum that does not match; a format-6 member not as a save writes it.
        """
        # pack -> (offset, tensor, member, chunk origin, destinations, _DOC | _CHUNK | _SMALL, array, layout)
        reads: dict[str, list[tuple[Any, ...]]] = {}
        sinks: list[int] = []  # tensors with a destination that is not its target: handed over at the end
        small: dict[int, int] = {}  # tensor -> bytes, of those read whole into their target
        tensors_meta, layouts, sep, local = self._meta.tensors, self._layouts, self._sep, self._local
        first_chunk: dict[int, tuple[str, tuple[int, ...]]] = {}  # ndim -> chunk 0's key and origin
        where = self._where

        def place(tm: Any, v6: bool, member: str) -> tuple[str, int]:
            """The pack holding ``member`` of ``tm`` and its offset there (0 where its directory lacks it:
            :meth:`PackFile.read_chunk` then says so)."""
            key = where.get(member) if v6 else tm.pack
            if key is None:
                raise InconsistentCheckpointError(
                    f"tensor {tm.name!r}: {member} is in none of its writer's packs in {self._root}; the "
                    "checkpoint is damaged"
                )
            entries = self._members.get(key)
            if entries is None:
                try:
                    entries = self._entries(key)
                except (CorruptCheckpointError, InconsistentCheckpointError) as e:
                    raise type(e)(f"tensor {tm.name!r}: {e}") from None
            info = entries.get(member)
            return key, 0 if info is None else info.header_offset

        dests_of: list[list[chunkread.Dest]] = []
        for i, t in enumerate(tensors):
            tm = tensors_meta[t.name]
            v6 = tm.pack_rank is not None
            lay = chunkread.layout_of(tm, layouts)
            dests: list[chunkread.Dest] = []
            dests_of.append(dests)
            if v6:
                doc = f"{tm.name}/zarr.json"
                key, at = place(tm, v6, doc)
                reads.setdefault(key, []).append((at, i, doc, (), dests, _DOC, tm, lay))
            shards = t.shards
            if local and len(shards) == 1 and lay.n_inner == 1:
                # a small array of one chunk read whole into its target (100,000 small tensors): one slice of
                # the pack's read-ahead window, checked and copied; anything unusual takes the general path
                shard = shards[0]
                arr, box = shard.target, shard.box
                if (
                    arr is not None
                    and box.lengths == lay.chunk
                    and not any(box.offsets)
                    and arr.dtype == lay.dtype
                    and arr.flags.c_contiguous
                    and tuple(tm.shape) == lay.chunk
                ):
                    dests.append((box, arr))
                    known = first_chunk.get(len(lay.chunk))
                    if known is None:
                        ndim = len(lay.chunk)
                        known = first_chunk[ndim] = (sep.join(["c", *("0" * ndim)]), (0,) * ndim)
                    member = f"{tm.name}/{known[0]}"
                    key, at = place(tm, v6, member)
                    reads.setdefault(key, []).append((at, i, member, known[1], dests, _SMALL, tm, lay))
                    small[i] = arr.nbytes
                    continue
            for shard in shards:
                if shard.target is not None and shard.target.dtype == lay.dtype:
                    arr = shard.target
                elif shard.staging is not None:  # e.g. a pinned buffer on its way to a device
                    arr = shard.staging(shard.box.lengths, lay.dtype)
                else:
                    arr = np.empty(shard.box.lengths, dtype=lay.dtype)
                dests.append((shard.box, arr))
            sinks.append(i)
            for idx, near in chunks_met(dests, tm.chunk_shape):
                member = f"{tm.name}/" + sep.join(["c", *map(str, idx)])
                origin = tuple(k * c for k, c in zip(idx, tm.chunk_shape))
                key, at = place(tm, v6, member)
                reads.setdefault(key, []).append((at, i, member, origin, near, _CHUNK, tm, lay))
        left: set[int] = set()  # format-5 arrays with a member not as a save writes it: tensorstore's
        direct = scratch = 0
        doc_kind, small_kind = _DOC, _SMALL
        for members in reads.values():
            members.sort(key=first)  # by offset (unique in a pack)
        # an object store: each pack's members in merged ranged reads, issued ahead (local files: pread)
        ahead = None if local else self._ahead(reads)
        try:
            for key, members in reads.items():
                pack: PackFile | None = None
                for _at, i, member, origin, near, kind, tm, lay in members:
                    if left and i in left:
                        continue
                    if pack is None:
                        pack = self._open(tm, key)
                        pack.ahead = ahead
                    if kind == doc_kind:  # a format-6 array's document
                        raw = pack.doc(member)
                        if raw is None:
                            raise _corrupt(tm, pack, member, "its local header is not as a save writes it")
                        self._docs.check(tm, raw, pack.path)
                        continue
                    if kind == small_kind and pack.read_small_chunk(member, lay, near[0][1]):
                        direct += near[0][1].nbytes
                        continue

                    def damaged(
                        why: str, tm: Any = tm, pack: PackFile = pack, member: str = member
                    ) -> Exception:
                        return _corrupt(tm, pack, member, why)

                    got = pack.read_chunk(member, lay, origin, near, self._staging, damaged)
                    if got is None:
                        if tm.pack_rank is not None:
                            raise damaged("it is not the chunk file a save writes (size or layout)")
                        left.add(i)
                        continue
                    direct += got[0]
                    scratch += got[1]
        except BaseException:
            if ahead is not None:  # the load fails: its merged reads not yet started are not sent
                ahead.cancel()
            raise
        finally:
            for pack in self._packs.values():
                pack.ahead = None  # the merged reads' bytes are freed with this batch
        self.direct_bytes += direct
        self.scratch_bytes += scratch
        total = sum(small.values())
        for i in left:
            total -= small.get(i, 0)
        for i in sinks:
            if left and i in left:
                continue
            for shard, (_box, arr) in zip(tensors[i].shards, dests_of[i]):
                if arr is not shard.target:
                    shard.sink(arr)
                total += arr.nbytes
        return total, [tensors[i] for i in sorted(left)]

    def close(self) -> None:
        for pack in self._packs.values():
            pack.close()
        self._packs.clear()
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()


#: bytes a local pack is read ahead by, for its small members (:meth:`PackFile._near`; members up to a
#: quarter of it)
_WINDOW = 1 << 20
#: the first window of a pack, and one after a read out of order (a member far from the last window)
_WINDOW_START = 16 << 10


#: what :meth:`PackedReader.deliver_many` reads of a member: a format-6 array's ``zarr.json``, a chunk, a
#: chunk that is a whole small array (read from the read-ahead window where it can)
_DOC, _CHUNK, _SMALL = 0, 1, 2


def _corrupt(tm: Any, pack: PackFile, key: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {tm.name!r}: member {key!r} of {pack.path} is damaged: {why} (DATA_LOSS: digest mismatch)"
    )
