"""A read-only zarr-python store presenting a whole checkpoint as one hierarchy, packed arrays included.

From format 5 on, small arrays live in packs (:mod:`arraycheckpoint.planning.packing`): uncompressed ZIP files
``.acp/packs/<rank>.<k>.zip`` whose members carry the keys the arrays would have in the checkpoint directory.
A plain ``zarr.open_group(ckpt)`` walk therefore lists only the arrays stored in their own directories.
:func:`checkpoint_store` returns a :class:`zarr.abc.store.Store` that serves every key of a packed array
(``model/w/zarr.json``, ``model/w/c.0.0``) from its pack, and every other key from the checkpoint itself, so
``zarr.open_group(store)``, ``.members()``, ``.tree()``, ``xarray.open_datatree(store, engine="zarr")`` and
dask see every tensor at its natural path::

    import zarr
    from arraycheckpoint.zarr import checkpoint_store

    root = zarr.open_group(checkpoint_store("ckpt/step_100"), mode="r")
    w = root["model/layers.0.attn.wq.weight"][...]

Which arrays are packed, and in which pack, comes from the checkpoint's metadata (``.acp/metadata.json``),
parsed and validated by :class:`arraycheckpoint.format.metadata.CheckpointMetadata` (a pack must be named
``.acp/packs/<rank>.<index>.zip`` of a rank of the checkpoint's world). A pack is read with ranged reads: its
ZIP central directory once (the archive's tail), then each member's bytes, so an object store never serves a
whole pack for one small array. Only the members of the arrays the metadata puts in a pack (and the group
documents above them) are exposed, and each must be stored uncompressed (nothing is inflated), lie inside
the archive before its directory, and be no larger than its encoding can be; anything else raises
:class:`~arraycheckpoint.errors.CorruptCheckpointError` naming the pack. On a local path neither the control
files nor a pack is read through a symbolic link (:func:`arraycheckpoint.storage.local._open_below`).

The store lists the checkpoint's own keys too (the pack files under ``.acp/`` included: ``.acp`` is an empty
array node, which zarr never walks into). ``list_prefix`` takes its prefix as a directory (``model/w`` lists
``model/w/...``, not ``model/w2/...``), like zarr's ``LocalStore`` and ``FsspecStore``.

This module imports zarr, numpy and arraycheckpoint's light modules; never torch, jax or tensorstore.
"""

from __future__ import annotations

import asyncio
import math
import os
import stat
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore, LocalStore

from .errors import CheckpointNotFoundError, CorruptCheckpointError, MetadataError
from .format.metadata import CONTROL_LAYOUTS, CheckpointMetadata, chunk_key_separator
from .planning.packing import (
    PACK_DIR,
    PACK_KEY,
    chunk_count,
    chunk_file_bytes,
    group_keys,
    pack_key,
    stored_bytes,
)
from .safety import MAX_PACKED_JSON_BYTES, check_layouts
from .storage.ranged import TailFile, check_member_names

__all__ = ["CheckpointStore", "checkpoint_store"]

#: First read of a pack: its last bytes, which hold the central directory of a pack of a few hundred arrays.
TAIL_BYTES = 64 << 10
#: Bytes per central-directory record allowed beyond the member's name (46 fixed, zip64 extra, slack).
_RECORD_BYTES = 46 + 32 + 1024
_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_LOCAL = b"PK\x03\x04"


def checkpoint_store(
    path: str | os.PathLike[str] | Store, *, storage_options: dict[str, Any] | None = None
) -> CheckpointStore:
    """A read-only zarr-python store of the committed checkpoint at ``path``: every tensor, packed or not.

    Args:
        path: a local path (``file://`` URLs too), any fsspec URL (``s3://bucket/ckpt``, read through zarr's
            ``FsspecStore``), or a zarr store whose root is the checkpoint.
        storage_options: passed to fsspec for a URL.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
        MetadataError: its metadata is malformed or hostile (a pack name outside ``.acp/packs/``, ...).
    """
    from zarr.core.sync import sync

    local: str | None = None
    if isinstance(path, Store):
        base = path
        if isinstance(base, LocalStore):
            local = os.fspath(base.root)
    else:
        text = os.fspath(path)
        if text.startswith("file://"):
            text = text[len("file://") :]
        if "://" in text:
            base = FsspecStore.from_url(text, storage_options=storage_options, read_only=True)
        else:
            local = os.path.abspath(text)
            base = LocalStore(local, read_only=True)
    return sync(CheckpointStore.open_checkpoint(base, local))


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


class CheckpointStore(Store):
    """The read-only store :func:`checkpoint_store` returns (see the module docstring)."""

    supports_writes = False
    supports_deletes = False
    supports_listing = True

    def __init__(self, base: Store, meta: CheckpointMetadata, local_root: str | None = None) -> None:
        super().__init__(read_only=True)
        self._base = base
        self._meta = meta
        self._local = local_root
        self._packed: dict[str, str] = {}  # array name -> pack key
        self._in_pack: dict[str, list[str]] = {}  # pack key -> its arrays
        check_layouts(meta)  # every declared layout possible (bounded chunks) before anything is sized by it
        for name, t in sorted(meta.tensors.items()):
            if t.pack is None:
                continue
            if not (PACK_KEY.match(t.pack) or t.pack_rank is not None):  # checked by the metadata parser too
                raise MetadataError(
                    f"tensor {name!r} names the pack {t.pack!r}, which is no pack of a checkpoint"
                )
            self._packed[name] = t.pack
            if t.pack_rank is None:
                self._in_pack.setdefault(t.pack, []).append(name)
        # directories above packed arrays: their children from the packs, and which pack holds their zarr.json
        # (format 5; a format-6 save writes every group document as a file)
        self._children: dict[str, set[str]] = {}
        self._group_pack: dict[str, str] = {}
        for name, pack in self._packed.items():
            parts = name.split("/")
            for i in range(len(parts)):
                parent = "/".join(parts[:i])
                self._children.setdefault(parent, set()).add(parts[i])
                if self._meta.tensors[name].pack_rank is None:
                    self._group_pack.setdefault(parent, pack)
        self._packs: dict[str, _Pack] = {}
        # format 6: rank -> member -> (pack, member), every pack of that rank read once
        self._ranks: dict[int, dict[str, tuple[_Pack, _Member]]] = {}
        self._sep = chunk_key_separator(meta.format_version)
        # local packs: one descriptor per pack, opened (below the root, no link, a regular file) on first use
        self._fds = _PackFiles(local_root) if local_root is not None else None

    @classmethod
    async def open_checkpoint(cls, base: Store, local_root: str | None = None) -> CheckpointStore:
        """Open ``base`` (a zarr store rooted at a checkpoint), read and validate the checkpoint's metadata."""
        if not base._is_open:
            await base._open()
        where = local_root or str(base)
        for files in CONTROL_LAYOUTS:
            if await _control_read(base, local_root, files.committed, 1 << 20) is not None:
                raw = await _control_read(base, local_root, files.metadata, None)
                if raw is None:
                    raise MetadataError(f"checkpoint {where} is committed but has no {files.metadata}")
                meta = CheckpointMetadata.from_json(raw, what=f"{where}/{files.metadata}")
                store = cls(base, meta, local_root)
                store._is_open = True
                return store
        raise CheckpointNotFoundError(f"no committed checkpoint at {where}")

    # Identity ---------------------------------------------------------------------------------------------
    @property
    def metadata(self) -> CheckpointMetadata:
        """The checkpoint's validated metadata."""
        return self._meta

    @property
    def packed(self) -> dict[str, str]:
        """``array name -> pack key`` of every packed array."""
        return dict(self._packed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckpointStore) and self._base == other._base

    def __hash__(self) -> int:
        return hash(str(self._base))

    def __str__(self) -> str:
        return f"arraycheckpoint+{self._base}"

    def __repr__(self) -> str:
        return f"CheckpointStore({self._base!r}, {len(self._packed)} packed arrays)"

    def with_read_only(self, read_only: bool = False) -> CheckpointStore:
        if not read_only:
            raise ValueError("a checkpoint store is read-only")
        return self

    async def _open(self) -> None:
        if not self._base._is_open:
            await self._base._open()
        self._is_open = True

    def close(self) -> None:
        if self._fds is not None:
            self._fds.close()
        self._base.close()
        super().close()

    # Routing ----------------------------------------------------------------------------------------------
    def _array_of(self, key: str) -> str | None:
        """The packed array whose key ``key`` is (``model/w/c.0`` -> ``model/w``), else None."""
        at = key.find("/")
        while at >= 0:
            if key[:at] in self._packed:
                return key[:at]
            at = key.find("/", at + 1)
        return None

    def _group_of(self, key: str) -> str | None:
        """The directory above packed arrays whose group document ``key`` is, else None."""
        if key == "zarr.json":
            return ""
        if key.endswith("/zarr.json") and key[: -len("/zarr.json")] in self._group_pack:
            return key[: -len("/zarr.json")]
        return None

    async def _member(self, key: str) -> tuple[_Pack, _Member] | None:
        """The pack member serving ``key`` (a packed array's key, or a group document only a pack holds)."""
        name = self._array_of(key)
        if name is not None and self._meta.tensors[name].pack_rank is not None:
            rank = self._rank_of(name, key)
            if rank is None:
                return None
            found = (await self._rank(rank)).get(key)
            if found is None:  # every chunk has its member (all-zero ones too): a missing one is damage
                raise CorruptCheckpointError(
                    f"tensor {name!r}: {key} is in none of rank {rank}'s packs ({self._where(PACK_DIR)}/"
                    f"{rank}.<k>.zip); the checkpoint is damaged"
                )
            return found
        if name is not None:
            pack = await self._pack(self._packed[name])
            member = pack.members.get(key)
            return None if member is None else (pack, member)
        group = self._group_of(key)
        if group is not None and group in self._group_pack and not await self._base.exists(key):
            pack = await self._pack(self._group_pack[group])
            member = pack.members.get(key)
            return None if member is None else (pack, member)
        return None

    def _served_by_pack(self, key: str) -> bool:
        return self._array_of(key) is not None

    # Reads ------------------------------------------------------------------------------------------------
    async def get(
        self, key: str, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        if self._served_by_pack(key) or self._group_of(key) in self._group_pack:
            found = await self._member(key)
            if found is not None:
                buf = await self._read_member(*found, prototype, byte_range)
                self._check_doc(key, buf.to_bytes(), byte_range)
                return buf
            if self._served_by_pack(key):
                return None
        shard = self._shard_check(key)
        if self._local is not None:  # never through a link, never a FIFO, bounded before it is read
            data = await asyncio.to_thread(
                _read_file_below, self._local, key, self._limit(key), byte_range, shard
            )
        else:
            if shard is not None and await self._base.exists(key):
                size = await self._base.getsize(key)
                tail = await self._base.get(key, prototype, SuffixByteRequest(min(shard[0], size)))
                shard[1](size, b"" if tail is None else tail.to_bytes())
            buf = await self._base.get(key, prototype, byte_range)
            data = None if buf is None else buf.to_bytes()
        if data is None:
            return None
        self._check_doc(key, data, byte_range)
        return prototype.buffer.from_bytes(data)

    def _limit(self, key: str) -> int:
        """The largest a valid checkpoint's file ``key`` can be: a chunk file of its array's encoding, an
        array or group document, or a control file."""
        from .codecs import numpy_dtype
        from .safety import MAX_ARRAY_JSON_BYTES, MAX_METADATA_BYTES, _max_file_bytes

        if key.endswith("zarr.json"):
            return MAX_ARRAY_JSON_BYTES
        at = key.rfind("/")
        while at > 0:
            t = self._meta.tensors.get(key[:at])
            if t is not None:
                return _max_file_bytes(t.chunk_shape, t.inner_chunk_shape, numpy_dtype(t.dtype).itemsize)
            at = key.rfind("/", 0, at)
        return MAX_METADATA_BYTES

    def _shard_check(self, key: str) -> tuple[int, Callable[[int, bytes], None]] | None:
        """For a chunk file of an array stored in its own directory: the length of its shard index and the
        check of the file's ``(size, last bytes)`` before zarr sees any of it (a file of the array's layout's
        size, uncompressed, or within its largest encoding; an index whose crc32c matches and whose entries
        lie inside the file), as the native load checks it (:mod:`arraycheckpoint.engine.chunkread`); else
        None."""
        from .codecs import numpy_dtype

        at = key.rfind("/")
        while at > 0:
            t = self._meta.tensors.get(key[:at])
            if t is not None:
                break
            at = key.rfind("/", 0, at)
        else:
            return None
        shape, chunk = tuple(t.shape), tuple(t.chunk_shape)
        if t.pack is not None or _chunk_flat(key[at + 1 :], shape, chunk, self._sep) is None:
            return None
        n_inner = math.prod(c // i for c, i in zip(chunk, t.inner_chunk_shape))
        index_bytes = 16 * n_inner + 4
        itemsize = numpy_dtype(t.dtype).itemsize
        if t.compression is None:
            limit = chunk_file_bytes(t, itemsize)
        else:
            limit = self._limit(key)
        path = self._where(key)

        def check(size: int, tail: bytes) -> None:
            from .engine.shardfile import crc32c

            why = None
            if not index_bytes <= size <= limit:
                why = f"is {size} bytes, outside what its chunk's encoding allows ({index_bytes} to {limit})"
            elif crc32c(tail[:-4]) != int.from_bytes(tail[-4:], "little"):
                why = "has a shard index whose crc32c does not match (truncated or overwritten)"
            else:
                entries = struct.unpack(f"<{2 * n_inner}Q", tail[:-4])
                for offset, length in zip(entries[::2], entries[1::2]):
                    if not offset == length == 2**64 - 1 and offset + length > size - index_bytes:
                        why = "has a shard index entry outside the file"
                        break
            if why is not None:
                raise CorruptCheckpointError(f"tensor {t.name!r}: {path} {why}; the checkpoint is damaged")

        return index_bytes, check

    def _check_doc(self, key: str, data: bytes, byte_range: ByteRequest | None) -> None:
        """An array's ``zarr.json`` served must agree with the checkpoint metadata (as the load checks it)."""
        from .safety import check_packed_doc

        if byte_range is None and key.endswith("/zarr.json"):
            t = self._meta.tensors.get(key[: -len("/zarr.json")])
            if t is not None:
                check_packed_doc(t, data, self._where(t.name), self._sep)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        if self._served_by_pack(key) or self._group_of(key) in self._group_pack:
            if await self._member(key) is not None:
                return True
            if self._served_by_pack(key):
                return False
        if self._local is not None:
            return await asyncio.to_thread(_exists_below, self._local, key)
        return await self._base.exists(key)

    async def getsize(self, key: str) -> int:
        if self._served_by_pack(key) or self._group_of(key) in self._group_pack:
            found = await self._member(key)
            if found is not None:
                return int(found[1].info.file_size)
            if self._served_by_pack(key):
                raise FileNotFoundError(key)
        if self._local is not None:
            size = await asyncio.to_thread(_size_below, self._local, key, True)
            if size is None:
                raise FileNotFoundError(key)
            return size
        return await self._base.getsize(key)

    # Listing ----------------------------------------------------------------------------------------------
    async def list(self) -> AsyncIterator[str]:
        async for key in self._base.list():
            if not self._served_by_pack(key):
                yield key
        async for key in self._virtual_keys(""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        path = prefix.strip("/")
        if not path:
            async for key in self.list():
                yield key
            return
        below = path + "/"
        if self._array_of(below) is not None:  # a packed array or a key inside one
            for key in await self._array_keys(self._array_of(below)):  # type: ignore[arg-type]
                if key.startswith(below):
                    yield key
            return
        async for key in self._base.list_prefix(below):
            if key.startswith(below) and not self._served_by_pack(key):
                yield key
        async for key in self._virtual_keys(path):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        path = prefix.strip("/")
        below = path + "/" if path else ""
        name = self._array_of(below) if path else None
        seen: set[str] = set()
        if name is not None:  # inside a packed array: its pack's members
            for key in await self._array_keys(name):
                if key.startswith(below):
                    child = key[len(below) :].split("/", 1)[0]
                    if child not in seen:
                        seen.add(child)
                        yield child
            return
        async for child in self._base.list_dir(prefix):
            if child not in seen:
                seen.add(child)
                yield child
        for child in sorted(self._children.get(path, ())):
            if child not in seen:
                seen.add(child)
                yield child
        if path in self._group_pack and "zarr.json" not in seen and await self.exists(below + "zarr.json"):
            yield "zarr.json"

    async def _virtual_keys(self, path: str) -> AsyncIterator[str]:
        """Keys served from packs at or below the directory ``path`` ("" for all): packed arrays' members,
        and the group documents the checkpoint itself lacks."""
        below = path + "/" if path else ""
        for group in sorted(self._group_pack):
            if group == path or group.startswith(below):
                key = f"{group}/zarr.json" if group else "zarr.json"
                if not await self._base.exists(key) and await self._member(key) is not None:
                    yield key
        for name in sorted(self._packed):
            if self._meta.tensors[name].pack_rank is not None and name.startswith(below):
                for key in await self._array_keys(name):
                    yield key
        for pkey, names in sorted(self._in_pack.items()):
            wanted = [n for n in names if n.startswith(below)]
            if not wanted:
                continue
            pack = await self._pack(pkey)
            for key in pack.members:
                name = self._array_of(key)
                if name is not None and name.startswith(below) and self._packed[name] == pkey:
                    yield key

    async def _array_keys(self, name: str) -> list[str]:
        """The keys of the packed array ``name``: format 6, its ``zarr.json`` and every chunk of its grid (each
        has its member, checked when read); format 5, its pack's members."""
        t = self._meta.tensors[name]
        if t.pack_rank is None:
            pack = await self._pack(self._packed[name])
            return [k for k in pack.members if k.startswith(name + "/")]
        return [f"{name}/zarr.json"] + [
            f"{name}/{self._sep.join(['c', *map(str, index)])}" for index in _grid(t.shape, t.chunk_shape)
        ]

    def _rank_of(self, name: str, key: str) -> int | None:
        """Format 6: the rank whose packs hold ``key`` of the packed array ``name`` (its creator for its
        ``zarr.json``, a chunk's writer for the chunk), None for a key the array does not have."""
        t = self._meta.tensors[name]
        leaf = key[len(name) + 1 :]
        if leaf == "zarr.json":
            return t.pack_rank
        flat = _chunk_flat(leaf, t.shape, t.chunk_shape, self._sep)
        return None if flat is None else t.writers[flat]

    async def _rank(self, rank: int) -> dict[str, tuple[_Pack, _Member]]:
        """Format 6: every member of ``rank``'s packs (``<rank>.0.zip``, ``<rank>.1.zip``, ... up to the first
        absent one), each pack's directory read and checked once: every entry must be a member that rank
        holds (none twice), and every member it holds must be there."""
        found = self._ranks.get(rank)
        if found is not None:
            return found
        from .codecs import numpy_dtype

        limits: dict[str, int] = {}
        for name in self._packed:
            t = self._meta.tensors[name]
            if t.pack_rank is None:
                continue
            if t.pack_rank == rank:
                limits[f"{name}/zarr.json"] = MAX_PACKED_JSON_BYTES
            mine = [i for i, w in enumerate(t.writers) if w == rank]
            if mine:
                per_chunk = chunk_file_bytes(t, numpy_dtype(t.dtype).itemsize)
                grid = [-(-s // c) for s, c in zip(t.shape, t.chunk_shape)]
                for flat in mine:
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

    async def _exists_object(self, key: str) -> bool:
        if self._local is not None:
            return await asyncio.to_thread(_exists_below, self._local, key)
        return bool(await self._base.exists(key))

    # Writes -----------------------------------------------------------------------------------------------
    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def delete(self, key: str) -> None:
        self._check_writable()

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
        from .codecs import numpy_dtype

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
        except (zipfile.BadZipFile, struct.error, ValueError, EOFError) as e:
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
        fd = _open_pack(self.root, key)
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
    from .storage.local import _open_below

    fd = _open_below(root, key)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{root}/{key} is not a regular file; the checkpoint is damaged")
        if st.st_size > limit:
            raise CorruptCheckpointError(
                f"{root}/{key} is {st.st_size} bytes, more than a valid checkpoint's file there can be ({limit}); "
                "the checkpoint is damaged or hostile"
            )
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


def _grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """Every chunk index of the grid (one, ``()``, for a 0-d array)."""
    import itertools

    return itertools.product(*(range(-(-s // max(c, 1))) for s, c in zip(shape, chunk_shape)))


def _chunk_flat(
    leaf: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...], separator: str
) -> int | None:
    """The flat (row-major) index of the chunk key ``leaf`` (``c.1.0``) in the grid, None when ``leaf`` is
    no canonical chunk key inside it."""
    grid = [-(-s // max(c, 1)) for s, c in zip(shape, chunk_shape)]
    parts = leaf.split(separator)
    if parts[0] != "c" or len(parts) != len(grid) + 1:
        return None
    flat = 0
    for p, g in zip(parts[1:], grid):
        if not p.isascii() or not p.isdigit() or p != str(int(p)) or int(p) >= g:
            return None
        flat = flat * g + int(p)
    return flat


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


async def _control_read(base: Store, local: str | None, key: str, limit: int | None) -> bytes | None:
    """A control file of the checkpoint, bounded (never through a link on a local path), or None if absent."""
    from .safety import MAX_METADATA_BYTES

    bound = MAX_METADATA_BYTES if limit is None else limit
    if local is not None:
        from .storage.local import LocalStorage

        return await asyncio.to_thread(LocalStorage().read, local, key)
    if not await base.exists(key):
        return None
    if await base.getsize(key) > bound:
        raise MetadataError(
            f"{base}/{key} is larger than {bound} bytes; the checkpoint is damaged or hostile"
        )
    buf = await base.get(key, default_buffer_prototype())
    return None if buf is None else buf.to_bytes()


def _open_pack(root: str, key: str) -> int:
    from .storage.local import _open_below

    fd = _open_below(root, key)
    if fd is None:
        raise CorruptCheckpointError(f"the pack {root}/{key} is missing; the checkpoint is damaged")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{root}/{key} is not a regular file; the checkpoint is damaged")
    return fd


def _exists_below(root: str, key: str) -> bool:
    """Whether ``root/key`` exists (opened below ``root`` without following a link: a link raises)."""
    from .storage.local import _open_below

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
