"""Read packed arrays (format 5) from local pack files, verifying both checksums with hardware CRC32C.

The mirror of :func:`arraycheckpoint.engine.shardfile.encode` for the arrays a save puts in packs
(:mod:`arraycheckpoint.packing`: uncompressed, whole chunks): a member's bytes are a ``sharding_indexed``
shard, every inner chunk's little-endian bytes followed by their ``crc32c``, then the index (``(offset,
nbytes)`` as little-endian uint64 per inner chunk) and the index's ``crc32c``. Going through tensorstore's
``zip`` driver costs a ``ts.open`` per array and a software CRC32C per byte, which bound a load of many small
tensors; here one ``pread`` per member, the index and every inner chunk checked with ``google_crc32c``.

Only the exact layout a save writes is decoded (every inner chunk present, in C order, of its exact size);
anything else (a shard another writer produced with fill-value chunks omitted) goes back to tensorstore,
which reads every valid zarr shard. The pack itself was checked first (:func:`arraycheckpoint.safety
.check_packs`: regular file, no link, members stored uncompressed, local headers matching the directory).
A checksum that does not match raises :class:`CorruptCheckpointError` naming the tensor and the pack.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import numpy as np

from ..codecs import numpy_dtype
from ..errors import CorruptCheckpointError
from ..regions import Box, intersect
from . import shardfile

#: A ZIP local file header: signature, versions, flags, method, time, date, crc, sizes, name and extra lengths.
_LOCAL = struct.Struct("<4s5H3L2H")


def fast_path_available() -> bool:
    """Whether this interpreter has the hardware CRC32C (else tensorstore reads packed arrays too)."""
    return shardfile._CRC is not None and np.little_endian


class PackFile:
    """One pack opened for reading (never through a link): members by name, read with ``pread``."""

    def __init__(self, root: str, key: str, members: dict[str, Any]) -> None:
        self.path = f"{root.rstrip('/')}/{key}"
        self.key = key
        self._members = members
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(self.path, flags | getattr(os, "O_NONBLOCK", 0))

    def close(self) -> None:
        os.close(self._fd)

    def member(self, name: str) -> bytes | None:
        """The stored bytes of member ``name``, or None when its local header is not what a save writes."""
        info = self._members.get(name)
        if info is None:
            return None
        raw = name.encode()
        head = os.pread(self._fd, _LOCAL.size + len(raw), info.header_offset)
        if len(head) < _LOCAL.size:
            return None
        sig, _v, _f, method, _t, _d, _crc, csize, size, nlen, xlen = _LOCAL.unpack_from(head)
        if sig != b"PK\x03\x04" or method != 0 or head[_LOCAL.size :] != raw or nlen != len(raw):
            return None
        start = info.header_offset + _LOCAL.size + nlen + xlen
        data = os.pread(self._fd, info.file_size, start)
        return data if len(data) == info.file_size else None


def read_array(
    pack: PackFile, tm: Any, chunk_keys: list[tuple[tuple[int, ...], str]], wanted: list[Box]
) -> np.ndarray | None:
    """The packed array ``tm`` decoded from ``pack`` where it meets the regions ``wanted`` (the chunks that
    intersect none are neither read nor checked, and their part of the result is undefined), or None when a
    member is not in the layout a save writes (the caller reads it through tensorstore then).

    ``chunk_keys``: ``(chunk grid index, member name)`` of every chunk.

    Raises:
        CorruptCheckpointError: a checksum that does not match.
    """
    dtype = numpy_dtype(tm.dtype)  # native order, little-endian (fast_path_available)
    chunk, inner = tuple(tm.chunk_shape), tuple(tm.inner_chunk_shape)
    grid = tuple(c // i for c, i in zip(chunk, inner))
    n_inner = math.prod(grid)
    inner_bytes = math.prod(inner) * dtype.itemsize
    out = np.empty(tuple(tm.shape), dtype=dtype)
    for index, key in chunk_keys:
        origin = tuple(i * c for i, c in zip(index, chunk))
        if not any(intersect(Box(origin, chunk), w) is not None for w in wanted) and chunk:
            continue
        raw = pack.member(key)
        if raw is None or len(raw) != n_inner * (inner_bytes + 4 + 16) + 4:
            return None
        table_at = len(raw) - (16 * n_inner + 4)
        table = raw[table_at:-4]
        flat = np.frombuffer(raw, dtype=np.uint8)
        if shardfile.crc32c(table) != int.from_bytes(raw[-4:], "little"):
            raise _corrupt(tm, pack, key, "the shard index's crc32c does not match")
        entries = struct.unpack(f"<{2 * n_inner}Q", table)
        block = out[tuple(slice(o, o + c) for o, c in zip(origin, chunk))] if chunk else out
        for k, pos in enumerate(np.ndindex(*grid)):
            offset, nbytes = entries[2 * k], entries[2 * k + 1]
            if nbytes != inner_bytes + 4 or offset + nbytes > table_at:
                return None
            data = flat[offset : offset + inner_bytes]
            if shardfile.crc32c(data) != int.from_bytes(
                raw[offset + inner_bytes : offset + nbytes], "little"
            ):
                raise _corrupt(tm, pack, key, f"inner chunk {list(pos)}'s crc32c does not match")
            block[tuple(slice(p * i, (p + 1) * i) for p, i in zip(pos, inner))] = data.view(dtype).reshape(
                inner
            )
    return out


def chunk_members(tm: Any, separator: str) -> list[tuple[tuple[int, ...], str]]:
    """``(chunk grid index, member name)`` of every chunk of the packed array ``tm``."""
    grid = [-(-s // c) for s, c in zip(tm.shape, tm.chunk_shape)]
    return [
        (idx, separator.join(["c", *map(str, idx)]).join([f"{tm.name}/", ""])) for idx in np.ndindex(*grid)
    ]


class PackedReader:
    """Packed arrays of one load, decoded one at a time from their packs (opened once each)."""

    def __init__(self, root: str, meta: Any, storage: Any, directories: dict[str, list[Any]]) -> None:
        from ..metadata import chunk_key_separator

        self._root, self._meta, self._storage = root, meta, storage
        self._directories = directories  # what the load's checks parsed (safety.check_packs)
        self._sep = chunk_key_separator(meta.format_version)
        self._packs: dict[str, PackFile] = {}

    def read(self, name: str, wanted: list[Box]) -> np.ndarray | None:
        """The packed array ``name`` where it meets ``wanted``, or None: read it through tensorstore."""
        tm = self._meta.tensors[name]
        pack = self._packs.get(tm.pack)
        if pack is None:
            entries = self._directories.get(tm.pack)
            if entries is None:  # not checked by this load (cannot happen through LoadPipeline)
                from ..safety import read_pack_directory

                entries, _size = read_pack_directory(self._storage, self._root, self._meta, tm.pack)
            pack = self._packs[tm.pack] = PackFile(self._root, tm.pack, {e.filename: e for e in entries})
        return read_array(pack, tm, chunk_members(tm, self._sep), wanted)

    def close(self) -> None:
        for pack in self._packs.values():
            pack.close()
        self._packs.clear()


def _corrupt(tm: Any, pack: PackFile, key: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {tm.name!r}: member {key!r} of {pack.path} is damaged: {why} (DATA_LOSS: digest mismatch)"
    )
