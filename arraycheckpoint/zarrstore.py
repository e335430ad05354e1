"""A read-only zarr-python store presenting a whole checkpoint as one hierarchy, packed arrays included.

From format 5 on, small arrays live in packs (:mod:`arraycheckpoint.packing`): uncompressed ZIP files
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
parsed and validated by :class:`arraycheckpoint.metadata.CheckpointMetadata` (a pack must be named
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
import os
import stat
import struct
import zipfile
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore, LocalStore

from .errors import CheckpointNotFoundError, CorruptCheckpointError, MetadataError
from .metadata import CONTROL_LAYOUTS, CheckpointMetadata
from .packing import PACK_KEY, chunk_count, group_keys, stored_bytes
from .safety import MAX_PACKED_JSON_BYTES
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
        for name, t in sorted(meta.tensors.items()):
            if t.pack is None:
                continue
            if not PACK_KEY.match(t.pack):  # the metadata parser checked it; a store never trusts less
                raise MetadataError(
                    f"tensor {name!r} names the pack {t.pack!r}, which is no pack of a checkpoint"
                )
            self._packed[name] = t.pack
            self._in_pack.setdefault(t.pack, []).append(name)
        # directories above packed arrays: their children from the packs, and which pack holds their zarr.json
        self._children: dict[str, set[str]] = {}
        self._group_pack: dict[str, str] = {}
        for name, pack in self._packed.items():
            parts = name.split("/")
            for i in range(len(parts)):
                parent = "/".join(parts[:i])
                self._children.setdefault(parent, set()).add(parts[i])
                self._group_pack.setdefault(parent, pack)
        self._packs: dict[str, _Pack] = {}

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
                return await self._read_member(*found, prototype, byte_range)
            if self._served_by_pack(key):
                return None
        return await self._base.get(key, prototype, byte_range)

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
        return await self._base.exists(key)

    async def getsize(self, key: str) -> int:
        if self._served_by_pack(key) or self._group_of(key) in self._group_pack:
            found = await self._member(key)
            if found is not None:
                return int(found[1].info.file_size)
            if self._served_by_pack(key):
                raise FileNotFoundError(key)
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
            pack = await self._pack(self._packed[self._array_of(below)])  # type: ignore[index]
            for key in pack.members:
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
            pack = await self._pack(self._packed[name])
            for key in pack.members:
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
        for pack_key, names in sorted(self._in_pack.items()):
            wanted = [n for n in names if n.startswith(below)]
            if not wanted:
                continue
            pack = await self._pack(pack_key)
            for key in pack.members:
                name = self._array_of(key)
                if name is not None and name.startswith(below) and self._packed[name] == pack_key:
                    yield key

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
        if self._local is not None:
            return await asyncio.to_thread(_pread_below, self._local, key, start, end)
        buf = await self._base.get(key, default_buffer_prototype(), RangeByteRequest(start, end))
        if buf is None:
            raise CorruptCheckpointError(f"the pack {self._where(key)} is missing; the checkpoint is damaged")
        return buf.to_bytes()

    async def _size(self, key: str) -> int:
        if self._local is not None:
            return await asyncio.to_thread(_size_below, self._local, key)
        try:
            return int(await self._base.getsize(key))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"the pack {self._where(key)} is missing; the checkpoint is damaged"
            ) from None

    def _where(self, key: str) -> str:
        return f"{self._local or self._base}/{key}"

    async def _read_directory(self, key: str) -> _Pack:
        """Read and check the central directory of the pack ``key`` (see the module docstring)."""
        from .codecs import numpy_dtype

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
        at = pack.data_at.get(info.filename)
        if at is None:
            name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
            header = await self._read(pack.key, info.header_offset, info.header_offset + 30 + len(name))
            if len(header) != 30 + len(name) or header[:4] != _LOCAL or header[30:] != name:
                raise CorruptCheckpointError(
                    f"member {info.filename!r} of {self._where(pack.key)} has no matching local header; the pack "
                    "is damaged"
                )
            method, name_len, extra_len = struct.unpack("<H16xHH", header[8:30])
            at = info.header_offset + 30 + name_len + extra_len
            if (
                method != zipfile.ZIP_STORED
                or name_len != len(name)
                or at + info.file_size > pack.directory_at
            ):
                raise CorruptCheckpointError(
                    f"member {info.filename!r} of {self._where(pack.key)} has an inconsistent local header; the "
                    "pack is damaged"
                )
            pack.data_at[info.filename] = at
        size = int(info.file_size)
        if byte_range is None:
            start, end = 0, size
        elif isinstance(byte_range, RangeByteRequest):
            start, end = min(byte_range.start, size), min(byte_range.end, size)
        elif isinstance(byte_range, OffsetByteRequest):
            start, end = min(byte_range.offset, size), size
        elif isinstance(byte_range, SuffixByteRequest):
            start, end = max(0, size - byte_range.suffix), size
        else:
            raise TypeError(f"unexpected byte range {byte_range!r}")
        data = await self._read(pack.key, at + start, at + max(start, end))
        return prototype.buffer.from_bytes(data)


# Helpers ----------------------------------------------------------------------------------------------------
def _grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """Every chunk index of the grid (one, ``()``, for a 0-d array)."""
    import itertools

    return itertools.product(*(range(-(-s // max(c, 1))) for s, c in zip(shape, chunk_shape)))


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


def _size_below(root: str, key: str) -> int:
    fd = _open_pack(root, key)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _pread_below(root: str, key: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``root/key``, opened below ``root`` without following a link."""
    fd = _open_pack(root, key)
    try:
        parts = []
        while start < end:
            chunk = os.pread(fd, end - start, start)
            if not chunk:
                raise CorruptCheckpointError(
                    f"{root}/{key} is shorter than its directory says; the pack is damaged"
                )
            parts.append(chunk)
            start += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)
