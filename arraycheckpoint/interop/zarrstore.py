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
array node, which zarr never walks into), and only those the metadata names
(:class:`~arraycheckpoint.format.hierarchy.NamedKeys`): a planted ``model/evil`` array is neither listed nor
served (``verify`` warns about it). ``list_prefix`` takes its prefix as a directory (``model/w`` lists
``model/w/...``, not ``model/w2/...``), like zarr's ``LocalStore`` and ``FsspecStore``.

This module imports zarr, numpy and arraycheckpoint's light modules; never torch, jax or tensorstore.
"""

from __future__ import annotations

import asyncio
import math
import os
import struct
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any

from zarr.abc.store import ByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore, LocalStore

from ..checks.limits import check_layouts
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, MetadataError
from ..format.hierarchy import chunk_flat as _chunk_flat
from ..format.metadata import CONTROL_LAYOUTS, CheckpointMetadata, chunk_key_separator
from ..planning.packing import (
    PACK_KEY,
    chunk_file_bytes,
)
from .zarrfiles import (
    ChunkChecksums,
    _control_read,
    _exists_below,
    _read_file_below,
    _size_below,
    _span,
    too_large,
)
from .zarrkeys import KeyRouting
from .zarrpacks import _Member, _Pack, _PackFiles
from .zarrranks import forget_listings

__all__ = ["CheckpointStore", "checkpoint_store"]


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


def _display(base: Store) -> str:
    """How errors name the checkpoint behind ``base``: an fsspec store by its URL (``s3://bucket/ckpt``, not
    ``<FsspecStore(S3FileSystem, bucket/ckpt)>``), any other store as zarr prints it."""
    protocol = getattr(getattr(base, "fs", None), "protocol", None) if isinstance(base, FsspecStore) else None
    protocol = protocol[0] if isinstance(protocol, (tuple, list)) and protocol else protocol
    if isinstance(protocol, str):
        return f"{protocol}://{base.path}".rstrip("/")  # type: ignore[attr-defined]
    return str(base).rstrip("/")


class CheckpointStore(KeyRouting, Store):
    """The read-only store :func:`checkpoint_store` returns (see the module docstring)."""

    supports_writes = False
    supports_deletes = False
    supports_listing = True

    def __init__(self, base: Store, meta: CheckpointMetadata, local_root: str | None = None) -> None:
        super().__init__(read_only=True)
        self._base = base
        self._meta = meta
        self._local = local_root
        self._name = _display(base)
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
        self._checksums = ChunkChecksums()

    @classmethod
    async def open_checkpoint(cls, base: Store, local_root: str | None = None) -> CheckpointStore:
        """Open ``base`` (a zarr store rooted at a checkpoint), read and validate the checkpoint's metadata."""
        if not base._is_open:
            await base._open()
        forget_listings(base)  # nothing cached of an earlier checkpoint at this URL
        where = local_root or _display(base)
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
        pool = self.__dict__.pop("_walk_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        self._base.close()
        super().close()

    # Reads ------------------------------------------------------------------------------------------------
    async def get(
        self, key: str, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        if not self._names.key(key):  # a stray: no part of the checkpoint the metadata describes
            return None
        implied = self._node_docs.get(key)
        if implied is not None or (byte_range is not None and self._array_doc(key)):
            # a group's (or the control node's) document as the metadata implies it, where the checkpoint has
            # one: a stored group document with inline consolidated metadata declared the arrays below it
            # big-endian, and zarr-python read byte-swapped values through it; a part of an array's document
            # is a part of the one served whole (checked: the stored one was served unchecked)
            whole = await self.get(key, prototype) if implied is None else await self._stored(key, prototype)
            if whole is None:
                return None
            data = whole.to_bytes() if implied is None else implied
            start, end = _span(byte_range, len(data))
            return prototype.buffer.from_bytes(data[start:end])
        return await self._stored(key, prototype, byte_range)

    async def _stored(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """:meth:`get` of what the checkpoint stores (an array's document: the one the metadata implies)."""
        if self._served_by_pack(key) or self._group_of(key) in self._group_pack:
            found = await self._member(key)
            if found is not None:
                buf = await self._read_member(*found, prototype, byte_range)
                if key.endswith("zarr.json"):
                    buf = prototype.buffer.from_bytes(self._check_doc(key, buf.to_bytes(), byte_range))
                self._check_chunk(key, buf, byte_range, f"{key} in {self._where(found[0].key)}")
                return buf
            if self._served_by_pack(key):
                return None
        shard = self._shard_check(key)
        if self._local is not None:  # never through a link, never a FIFO, bounded before it is read
            data = await asyncio.to_thread(
                _read_file_below, self._local, key, self._limit(key), byte_range, shard
            )
        else:
            if shard is not None:  # its size (one request: it also says whether it is there), its index
                try:
                    size = await self._base.getsize(key)
                except FileNotFoundError:
                    return None
                tail = await self._base.get(key, prototype, SuffixByteRequest(min(shard[0], size)))
                shard[1](size, b"" if tail is None else tail.to_bytes())
            elif byte_range is None:  # bounded before it is downloaded, as a local file is before it is read
                try:
                    size = await self._base.getsize(key)
                except FileNotFoundError:
                    return None
                if size > self._limit(key):
                    raise too_large(self._where(key), size, self._limit(key))
            buf = await self._base.get(key, prototype, byte_range)
            data = None if buf is None else buf.to_bytes()
        if data is None:
            return None
        data = self._check_doc(key, data, byte_range)
        self._check_chunk(key, data, byte_range, self._where(key))
        return prototype.buffer.from_bytes(data)

    def _check_chunk(
        self, key: str, data: bytes | Buffer, byte_range: ByteRequest | None, where: str
    ) -> None:
        """What is served of a chunk file (``where``: the file, or the member and its pack) passes its
        crc32c checks before zarr-python decodes it (:class:`~.zarrfiles.ChunkChecksums`), so that damage is
        an error naming the tensor and the file."""
        found = self._tensor_of(key)
        if found is None:
            return
        t, at = found
        if _chunk_flat(key[at + 1 :], tuple(t.shape), tuple(t.chunk_shape), self._sep) is None:
            return
        n_inner = math.prod(c // i for c, i in zip(t.chunk_shape, t.inner_chunk_shape))
        raw = data if isinstance(data, bytes) else data.as_numpy_array()  # no copy
        self._checksums.check(key, raw, n_inner, byte_range, f"tensor {t.name!r}: {where}")

    def _limit(self, key: str) -> int:
        """The largest a valid checkpoint's file ``key`` can be: a chunk file of its array's encoding, an
        array or group document, or a control file."""
        from ..checks.bounds import MAX_ARRAY_JSON_BYTES, MAX_METADATA_BYTES
        from ..checks.zstd import _max_file_bytes
        from ..codecs import numpy_dtype

        if key.endswith("zarr.json"):
            return MAX_ARRAY_JSON_BYTES
        found = self._tensor_of(key)
        if found is None:
            return MAX_METADATA_BYTES
        t = found[0]
        return _max_file_bytes(t.chunk_shape, t.inner_chunk_shape, numpy_dtype(t.dtype).itemsize)

    def _tensor_of(self, key: str) -> tuple[Any, int] | None:
        """The tensor whose array holds ``key`` (its longest prefix that names one) and where its name ends
        in ``key``; None for a key outside every array."""
        at = key.rfind("/")
        while at > 0:
            t = self._meta.tensors.get(key[:at])
            if t is not None:
                return t, at
            at = key.rfind("/", 0, at)
        return None

    def _shard_check(self, key: str) -> tuple[int, Callable[[int, bytes], None]] | None:
        """For a chunk file of an array stored in its own directory: the length of its shard index and the
        check of the file's ``(size, last bytes)`` before zarr sees any of it (a file of the array's layout's
        size, uncompressed, or within its largest encoding; an index whose crc32c matches and whose entries
        lie inside the file), as the native load checks it (:mod:`arraycheckpoint.engine.chunkread`); else
        None."""
        from ..codecs import numpy_dtype

        found = self._tensor_of(key)
        if found is None:
            return None
        t, at = found
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
            from ..engine.shardfile import crc32c

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

    @cached_property
    def _node_docs(self) -> dict[str, bytes]:
        """Group documents and the control node's, as the metadata implies them (served in place of the
        stored ones): key -> bytes."""
        from ..format.hierarchy import node_documents

        return node_documents(self._meta)

    def _array_doc(self, key: str) -> bool:
        """Whether ``key`` is an array's ``zarr.json`` (served as the metadata implies it: :meth:`_check_doc`)."""
        return key.endswith("/zarr.json") and key[: -len("/zarr.json")] in self._meta.tensors

    def _check_doc(self, key: str, data: bytes, byte_range: ByteRequest | None) -> bytes:
        """An array's ``zarr.json`` served must agree with the checkpoint metadata (as the load checks it);
        what is served is the document the metadata implies, as the load opens the array with it: fields the
        check does not compare (a stray key, a codec's other settings) cannot make zarr-python fail deep
        inside its parser or read other values than the load."""
        from ..audit.arrays import check_packed_doc

        if byte_range is None and key.endswith("/zarr.json"):
            t = self._meta.tensors.get(key[: -len("/zarr.json")])
            if t is not None:
                return check_packed_doc(t, data, self._where(t.name), self._sep)
        return data

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        if not self._names.key(key):
            return False
        if self._served_by_pack(key) or self._group_of(key) in self._group_pack:
            if await self._member(key) is not None:
                return True
            if self._served_by_pack(key):
                return False
        if self._local is not None:
            return await asyncio.to_thread(_exists_below, self._local, key)
        return await self._base.exists(key)

    async def getsize(self, key: str) -> int:
        if not self._names.key(key):
            raise FileNotFoundError(key)
        if self._array_doc(key) or key in self._node_docs:  # the document served, not the stored one
            got = await self.get(key)
            if got is None:
                raise FileNotFoundError(key)
            return len(got)
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

    # Writes -----------------------------------------------------------------------------------------------
    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def delete(self, key: str) -> None:
        self._check_writable()
