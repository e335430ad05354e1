"""Read packed chunks (formats 5 and 6) straight into their destinations, verifying both checksums with CRC32C.

The mirror of :func:`arraycheckpoint.engine.shardfile.encode` for the chunk files a save puts in packs
(:mod:`arraycheckpoint.planning.packing`: uncompressed, edge chunks padded): a member's bytes are a ``sharding_indexed``
shard, every inner chunk's little-endian bytes followed by their ``crc32c``, then the index (``(offset,
nbytes)`` as little-endian uint64 per inner chunk) and the index's ``crc32c``. Each member a load needs is
read once, with one ``pread`` on a local file (into one staging buffer reused for every member) or one ranged
read on an object store (tensorstore's key-value store of the pack object), its index and every inner chunk
that meets a region read checked with ``google_crc32c``, and the inner chunks' bytes copied from there into
the destination of each region (the tensor itself, or the staging buffer a sink asked for): one copy of each
byte after the read.

Format 6 chunks are found by key in the central directories the load's checks parsed
(:func:`arraycheckpoint.audit.rankpacks.check_rank_packs`: the packs of each chunk's writer), and the array's
``zarr.json`` (in its creator's packs) is checked against the metadata (:func:`arraycheckpoint.checks
.check_packed_doc`). Only the exact layout a save writes is decoded (every inner chunk present, in C order,
of its exact size): a format-5 member in another layout goes back to tensorstore; a format-6 one is damage.
A checksum that does not match raises :class:`CorruptCheckpointError` naming the tensor and the pack.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import numpy as np

from ..codecs import numpy_dtype
from ..errors import CorruptCheckpointError, InconsistentCheckpointError
from ..planning.regions import Box, intersect
from . import shardfile

#: A ZIP local file header: signature, versions, flags, method, time, date, crc, sizes, name and extra lengths.
_LOCAL = struct.Struct("<4s5H3L2H")


def fast_path_available() -> bool:
    """Whether this interpreter has the hardware CRC32C (else tensorstore reads format-5 packed arrays)."""
    return shardfile._CRC is not None and np.little_endian


class PackFile:
    """One pack opened for reading: members by name, read with ``pread`` (local file, never through a link)
    or ranged reads (``kvstore``: an object store's key-value store of the pack directory)."""

    def __init__(self, root: str, key: str, members: dict[str, Any], kvstore: Any = None) -> None:
        self.path = f"{root.rstrip('/')}/{key}"
        self.key = key
        self._members = members
        self._kv = kvstore
        self._leaf = key.rpartition("/")[2]
        self._fd = -1
        if kvstore is None:
            flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            self._fd = os.open(self.path, flags | getattr(os, "O_NONBLOCK", 0))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read(self, offset: int, nbytes: int, staging: np.ndarray | None) -> np.ndarray:
        if self._fd < 0:
            result = self._kv.read(self._leaf, byte_range=slice(offset, offset + nbytes)).result()
            raw = bytes(result.value) if result.state == "value" else b""
            return np.frombuffer(raw, dtype=np.uint8)
        buf = (
            staging[:nbytes]
            if staging is not None and staging.nbytes >= nbytes
            else np.empty(nbytes, np.uint8)
        )
        got = os.preadv(self._fd, [buf], offset)
        return buf[:got]

    def member_view(self, name: str, staging: np.ndarray | None = None) -> np.ndarray | None:
        """The stored bytes of member ``name`` (a view of ``staging`` when it is large enough), or None when
        its local header is not what a save writes."""
        info = self._members.get(name)
        if info is None:
            return None
        raw = name.encode()
        head = _LOCAL.size + len(raw)
        got = self._read(info.header_offset, head + info.file_size, staging)
        if len(got) < head:
            return None
        sig, _v, _f, method, _t, _d, _crc, _cs, _s, nlen, xlen = _LOCAL.unpack_from(
            got[: _LOCAL.size].tobytes()
        )
        if (
            sig != b"PK\x03\x04"
            or method != 0
            or nlen != len(raw)
            or got[_LOCAL.size : head].tobytes() != raw
        ):
            return None
        if xlen:  # a zip64 extra field: the data starts after it
            got = self._read(info.header_offset + head + xlen, info.file_size, staging)
            return got if len(got) == info.file_size else None
        data = got[head:]
        return data if len(data) == info.file_size else None

    def member(self, name: str) -> bytes | None:
        """The stored bytes of member ``name``, or None when its local header is not what a save writes."""
        view = self.member_view(name)
        return None if view is None else view.tobytes()


class _Layout:
    """The decoding constants of one packed array."""

    def __init__(self, tm: Any) -> None:
        self.dtype = numpy_dtype(tm.dtype)  # native order, little-endian
        self.chunk = tuple(tm.chunk_shape)
        self.inner = tuple(tm.inner_chunk_shape)
        self.grid = tuple(c // i for c, i in zip(self.chunk, self.inner))
        self.n_inner = math.prod(self.grid)
        self.inner_bytes = math.prod(self.inner) * self.dtype.itemsize
        self.member_bytes = self.n_inner * (self.inner_bytes + 4 + 16) + 4


def decode_into(
    raw: np.ndarray,
    lay: _Layout,
    origin: tuple[int, ...],
    dests: list[tuple[Box, np.ndarray]],
    damaged: Any,
) -> bool:
    """Check the chunk file ``raw`` (uint8) of the chunk at ``origin`` and copy its inner chunks into every
    destination ``(region, array of that region)`` they meet (inner chunks that meet none are not checked).
    Returns False when ``raw`` is not in the layout a save writes; ``damaged(why)`` is the error to raise on
    a checksum mismatch."""
    if len(raw) != lay.member_bytes:
        return False
    table_at = len(raw) - (16 * lay.n_inner + 4)
    table = raw[table_at:-4]
    if shardfile.crc32c(table) != int.from_bytes(raw[-4:].tobytes(), "little"):
        raise damaged("the shard index's crc32c does not match")
    entries = table.view("<u8")
    for k, pos in enumerate(np.ndindex(*lay.grid)):
        at = tuple(o + p * i for o, p, i in zip(origin, pos, lay.inner))
        box = Box(at, lay.inner)
        hits = [(h, region, arr) for region, arr in dests if (h := intersect(box, region)) is not None]
        if not hits:
            continue
        offset, nbytes = int(entries[2 * k]), int(entries[2 * k + 1])
        if nbytes != lay.inner_bytes + 4 or offset + nbytes > table_at:
            return False
        data = raw[offset : offset + lay.inner_bytes]
        if shardfile.crc32c(data) != int.from_bytes(
            raw[offset + lay.inner_bytes : offset + nbytes].tobytes(), "little"
        ):
            raise damaged(f"inner chunk {list(pos)}'s crc32c does not match")
        block = data.view(lay.dtype).reshape(lay.inner)
        for h, region, arr in hits:
            arr[h.slices(region)] = block[h.slices(box)]
    return True


def chunk_members(tm: Any, separator: str) -> list[tuple[tuple[int, ...], str]]:
    """``(chunk grid index, member name)`` of every chunk of the packed array ``tm``."""
    grid = [-(-s // c) for s, c in zip(tm.shape, tm.chunk_shape)]
    return [
        (idx, separator.join(["c", *map(str, idx)]).join([f"{tm.name}/", ""])) for idx in np.ndindex(*grid)
    ]


class PackedReader:
    """Packed arrays of one load, read chunk by chunk from their packs (each opened once) into the regions'
    destinations."""

    def __init__(self, root: str, meta: Any, storage: Any, directories: dict[str, list[Any]]) -> None:
        from ..format.metadata import chunk_key_separator
        from ..storage.local import LocalStorage

        self._root, self._meta, self._storage = root, meta, storage
        self._directories = directories  # what the load's checks parsed (audit.packs.check_packs and friends)
        self._sep = chunk_key_separator(meta.format_version)
        self._packs: dict[str, PackFile] = {}
        self._where: dict[str, str] = {}  # member -> pack key (format 6, from the directories)
        for key, entries in directories.items():
            for e in entries:
                self._where.setdefault(e.filename, key)
        self._local = isinstance(storage, LocalStorage)
        self._kv: Any = None
        self._staging = np.empty(0, np.uint8)

    def _pack(self, key: str) -> PackFile:
        pack = self._packs.get(key)
        if pack is None:
            entries = self._directories.get(key)
            if entries is None:  # not checked by this load (cannot happen through LoadPipeline)
                from ..audit.packdir import read_pack_directory

                entries, _size = read_pack_directory(self._storage, self._root, self._meta, key)
            kv = None
            if not self._local:
                if self._kv is None:
                    from ..audit.packdir import _kvstore
                    from ..planning.packing import PACK_DIR

                    self._kv = _kvstore(self._storage, f"{self._root.rstrip('/')}/{PACK_DIR}")
                kv = self._kv
            pack = self._packs[key] = PackFile(self._root, key, {e.filename: e for e in entries}, kv)
        return pack

    def _read_member(self, tm: Any, member: str, nbytes: int) -> tuple[PackFile, np.ndarray | None]:
        key = tm.pack if tm.pack_rank is None else self._where.get(member)
        if key is None:
            raise InconsistentCheckpointError(
                f"tensor {tm.name!r}: {member} is in none of its writer's packs in {self._root}; the "
                "checkpoint is damaged"
            )
        pack = self._pack(key)
        if self._local and self._staging.nbytes < nbytes:
            self._staging = np.empty(max(nbytes, 2 * self._staging.nbytes), np.uint8)
        return pack, pack.member_view(member, self._staging if self._local else None)

    def deliver(self, t: Any) -> int | None:
        """Read the regions of the load tensor ``t`` (its shards) of a packed array into their destinations
        and hand them to their sinks; returns the bytes delivered, or None (format 5 only) when a member is not
        in the layout a save writes: read it through tensorstore then.

        Raises:
            CorruptCheckpointError: a checksum that does not match; a format-6 member not as a save writes it.
        """
        from ..audit.arrays import check_packed_doc
        from ..audit.packs import chunks_wanted

        tm = self._meta.tensors[t.name]
        v6 = tm.pack_rank is not None
        lay = _Layout(tm)
        if v6:
            doc = f"{tm.name}/zarr.json"
            pack, raw = self._read_member(tm, doc, 1 << 16)
            if raw is None:
                raise _corrupt(tm, pack, doc, "its local header is not as a save writes it")
            check_packed_doc(tm, raw.tobytes(), f"{pack.path}:{tm.name}", self._sep)
        dests: list[tuple[Box, np.ndarray]] = []
        for shard in t.shards:
            if shard.target is not None and shard.target.dtype == lay.dtype:
                dests.append((shard.box, shard.target))
            elif shard.staging is not None:  # e.g. a pinned buffer on its way to a device
                dests.append((shard.box, shard.staging(shard.box.lengths, lay.dtype)))
            else:
                dests.append((shard.box, np.empty(shard.box.lengths, dtype=lay.dtype)))
        grid = tuple(-(-s // c) for s, c in zip(tm.shape, tm.chunk_shape))
        for flat in chunks_wanted(tm, [b for b, _ in dests]).tolist():
            idx = tuple(int(i) for i in np.unravel_index(flat, grid)) if grid else ()
            member = f"{tm.name}/" + self._sep.join(["c", *map(str, idx)])
            origin = tuple(i * c for i, c in zip(idx, lay.chunk))
            near = [(b, a) for b, a in dests if intersect(Box(origin, lay.chunk), b) is not None]
            pack, raw = self._read_member(tm, member, _LOCAL.size + len(member.encode()) + lay.member_bytes)

            def damaged(why: str, pack: PackFile = pack, member: str = member) -> CorruptCheckpointError:
                return _corrupt(tm, pack, member, why)

            if raw is None or not decode_into(raw, lay, origin, near, damaged):
                if v6:
                    raise damaged("it is not the chunk file a save writes (size or layout)")
                return None
        total = 0
        for shard, (_box, arr) in zip(t.shards, dests):
            if arr is not shard.target:
                shard.sink(arr)
            total += arr.nbytes
        return total

    def close(self) -> None:
        for pack in self._packs.values():
            pack.close()
        self._packs.clear()


def _corrupt(tm: Any, pack: PackFile, key: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {tm.name!r}: member {key!r} of {pack.path} is damaged: {why} (DATA_LOSS: digest mismatch)"
    )
