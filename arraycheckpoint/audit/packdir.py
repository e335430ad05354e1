"""Reading a pack's ZIP directory through the storage, bounded by what the metadata lets the pack hold.

:func:`read_pack_directory` reads a pack's tail once and parses its central directory
(:mod:`arraycheckpoint.checks.zipdir`); the pack's size is bounded by the members the metadata puts in it,
and a local pack is opened without following links (:mod:`arraycheckpoint.checks.files`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..checks.bounds import MAX_OBJECT_BYTES, MAX_PACKED_JSON_BYTES
from ..checks.zipdir import PackMember, _check_local_headers, _parse_zip_directory, next_offsets
from ..errors import (
    CorruptCheckpointError,
    InconsistentCheckpointError,
)


def _chunk_grid(t: Any) -> tuple[int, ...]:
    """Chunks per dimension of the array ``t`` (``()`` for a 0-d array: one chunk)."""
    try:
        return _grid_of(t.shape, t.chunk_shape)  # arrays of one layout share it (thousands of small ones)
    except TypeError:  # unhashable shapes (lists)
        return tuple(-(-s // c) for s, c in zip(t.shape, t.chunk_shape))


@functools.lru_cache(maxsize=4096)
def _grid_of(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-s // c) for s, c in zip(shape, chunk_shape))


@functools.lru_cache(maxsize=4096)
def _longest_chunk_key(grid: tuple[int, ...]) -> int:
    """Length of the longest chunk key of ``grid`` (``c`` and one separator and index per dimension)."""
    return 1 + sum(1 + len(str(max(g - 1, 0))) for g in grid)


def _packed_chunk_bytes(t: Any) -> int:
    """Size of one chunk member of the packed array ``t``: packs hold uncompressed arrays of whole chunks
    (the metadata parser refuses anything else), so a chunk file is its data, a crc32c per inner chunk and
    the shard index (16 bytes per inner chunk and its crc32c), and never more (computed once per layout)."""
    return _chunk_file_bytes(t.dtype, tuple(t.chunk_shape), tuple(t.inner_chunk_shape))


@functools.lru_cache(maxsize=4096)
def _chunk_file_bytes(dtype: str, chunk_shape: tuple[int, ...], inner_chunk_shape: tuple[int, ...]) -> int:
    from ..codecs import numpy_dtype

    inner = math.prod(c // i for c, i in zip(chunk_shape, inner_chunk_shape))
    return math.prod(chunk_shape) * numpy_dtype(dtype).itemsize + inner * 20 + 4


def _pack_bound(meta: Any, every: Collection[str], limits: Mapping[str, int]) -> int:
    """Upper bound of the size of the pack holding exactly the arrays ``every`` (``limits``: each one's
    largest chunk file): every member's bytes (a ``zarr.json`` within :data:`MAX_PACKED_JSON_BYTES`), its
    local and central records and its name twice, and the end records."""
    from ..planning.packing import MEMBER_OVERHEAD, TRAILER_BYTES, group_keys

    total = TRAILER_BYTES
    for g in group_keys(every):
        total += MAX_PACKED_JSON_BYTES + MEMBER_OVERHEAD + 2 * len(g.encode())
    for n in every:
        grid = _chunk_grid(meta.tensors[n])
        prefix = len(n.encode()) + 1
        total += MAX_PACKED_JSON_BYTES + MEMBER_OVERHEAD + 2 * (prefix + len("zarr.json"))
        total += math.prod(grid) * (limits[n] + MEMBER_OVERHEAD + 2 * (prefix + _longest_chunk_key(grid)))
    return min(total, MAX_OBJECT_BYTES * 4)


def read_pack_directory(storage: Any, root: str, meta: Any, key: str) -> tuple[list[PackMember], int | None]:
    """The ZIP central directory (:class:`PackMember` entries, in stored order, duplicates kept) and the
    size of the pack ``key`` of ``meta``, read with the checks of :func:`check_packs` on the pack itself (a
    regular file, no link, no larger than its declared arrays can be, a ZIP archive) but none on its members:
    for tools that report each defect of a member themselves (``arraycheckpoint verify``).

    Raises:
        InconsistentCheckpointError: the pack is missing.
        CorruptCheckpointError: a link, a non-regular or oversized pack, or no ZIP archive.
    """
    every = sorted(n for n, t in meta.tensors.items() if t.pack == key)
    limits = {n: _packed_chunk_bytes(meta.tensors[n]) for n in every}
    return _pack_directory(storage, root.rstrip("/"), key, _pack_bound(meta, every, limits))


def _pack_directory(
    storage: Any,
    base: str,
    key: str,
    bound: int,
    *,
    max_directory_bytes: int | None = None,
    check_members: Callable[[list[PackMember]], list[PackMember]] | None = None,
    missing_ok: bool = False,
    deferred: dict[str, int] | None = None,
    parsed: dict[Any, Any] | None = None,
    ahead: Any = None,
) -> tuple[list[PackMember], int | None]:
    """The ZIP central directory of the pack ``key`` (its entries, in stored order, duplicates kept) and the
    pack's size, read and checked without ever inflating or allocating more than the directory.

    The pack must be a regular object of at most ``bound`` bytes (on local file systems: opened with
    ``O_NOFOLLOW | O_NONBLOCK`` below a link-free path, so neither a link nor a FIFO is followed or waited
    on), and a ZIP archive laid out as a save writes it (:func:`_parse_zip_directory`): this leaves no room
    for tensorstore's ``zip`` driver and this check to read different directories. ``max_directory_bytes``
    (what the directory of the pack's arrays can take) is checked from the end record, before the directory
    is read; it then holds at most one entry per 46 bytes. ``check_members(entries)`` (see
    :func:`check_packs`) checks the entries and returns those tensorstore will read, whose local headers are
    then checked (:func:`_check_local_headers`), or, with ``deferred``, left to the reader: it receives, for
    each of those members, where the next member's header (or the directory) starts, and the reader checks
    the local header with :func:`arraycheckpoint.checks.zipdir.check_local_header` on the bytes it reads
    along with the member's data (one read of each member, not two).
    Local files are read with ``pread``; object stores with ranged reads (the last
    :data:`_PACK_TAIL_BYTES` first, which usually hold the directory, then one small read per local header),
    so a pack is never downloaded whole to be checked.

    ``parsed`` (object stores) lets two calls with the same bounds read a directory once: a call without
    ``check_members`` (counting a rank's members before its keys are built,
    :func:`arraycheckpoint.audit.capacity.rank_capacity`) keeps there what it read and parsed (or that the
    pack is absent); a later call with ``check_members`` takes it from there and checks it, as it would
    have checked the bytes it read. ``ahead`` (object stores): the reads of packs' ends issued ahead of the
    walk (:class:`arraycheckpoint.audit.ahead.EndReads`): the end read there, with the same arguments, is
    taken from it (then parsed and checked here as one read here would be); any other is read here.

    Raises:
        InconsistentCheckpointError: the pack is missing (with ``missing_ok``: ``([], None)`` is returned).
        CorruptCheckpointError: a link, a non-regular or oversized pack, a pack that is no ZIP archive as a
            save writes it, or what ``check_members`` and the local headers refuse.
    """
    path = f"{base}/{key}"
    if getattr(storage, "commit_strategy", "") == "rename":
        from ..checks.files import open_regular

        opened = open_regular(base, key)  # no link on the way, never a FIFO (O_NONBLOCK), a regular file
        if opened is None:
            if missing_ok:
                return [], None
            raise InconsistentCheckpointError(f"the pack {path} is missing; the checkpoint is damaged")
        fd, size = opened
        try:
            _check_pack_size(path, size, bound)
            reader = _PackReader(path, lambda ranges: [os.pread(fd, n, o) for o, n in ranges], size)
            # the end records and a directory within what the pack's arrays take: one read (a larger
            # directory is refused by its size before it is read)
            last = min(size, _PACK_TAIL_BYTES, (max_directory_bytes or _PACK_TAIL_BYTES) + _TRAILER_MAX)
            (tail,) = reader.read_many([(size - last, last)])
            return _read_pack(path, tail, size, bound, reader, max_directory_bytes, check_members, deferred)
        finally:
            os.close(fd)
    held_at = (key, bound, max_directory_bytes)  # what ``parsed`` holds it under: read with these bounds
    if parsed is not None and held_at in parsed:
        held = parsed.pop(held_at) if check_members is not None else parsed[held_at]
        if held is None:
            got = None
        else:
            entries, size, cd_offset, read_remote, exact = held
            reader = _PackReader(path, read_remote, size, whole_when_cheaper=True, exact=exact)
            _check_entries(path, entries, cd_offset, reader, check_members, deferred)
            return entries, size
    else:
        want = min(bound + 1, _PACK_TAIL_BYTES)
        got = ahead.take(key, want, max_directory_bytes) if ahead is not None else NOT_AHEAD
        if got is NOT_AHEAD:
            got = read_end(storage, base, key, want, max_directory_bytes)
    keep = parsed is not None and check_members is None
    if got is None:
        if keep:
            parsed[held_at] = None  # type: ignore[index]
        if missing_ok:
            return [], None
        raise InconsistentCheckpointError(f"the pack {path} is missing; the checkpoint is damaged")
    tail, size, read_remote = got
    if size is not None:
        _check_pack_size(path, size, bound)
    elif want == bound + 1:  # the object holds at least bound + 1 bytes
        _check_pack_size(path, bound + 1, bound)
    reader = _PackReader(path, read_remote, size, tail, whole_when_cheaper=True)
    entries, size, cd_offset = _parse_zip_directory(
        path, tail, size, bound, reader.read_many, max_directory_bytes
    )
    reader.size = size
    if keep:
        parsed[held_at] = (entries, size, cd_offset, read_remote, reader.exact)  # type: ignore[index]
    _check_entries(path, entries, cd_offset, reader, check_members, deferred)
    start = size - len(tail)
    if deferred is not None and cd_offset > start:  # a load: its members in the bytes read, served from them
        return PackDirectory(entries, start, memoryview(tail)[: cd_offset - start]), size
    return entries, size


#: what :meth:`arraycheckpoint.audit.ahead.EndReads.take` answers for a read it did not issue
NOT_AHEAD: Any = object()


def read_end(
    storage: Any, base: str, key: str, want: int, max_directory_bytes: int | None
) -> RangesRead | None:
    """The first read of the pack ``key`` on an object store (:func:`_pack_directory`): its last ``want``
    bytes (fewer through a reader knowing the pack's size), its size when known, its ranged reader; None when
    it is absent."""
    ranges = getattr(storage, "pack_ranges", None)  # a reader of its own (checkpoint_store's zarr store)
    if ranges is not None:  # it knows the pack's size: the end records and what the directory can take,
        # as a local pack's first read (not 256 KiB of members besides a small directory)
        return ranges(base, key, min(want, (max_directory_bytes or want) + _TRAILER_MAX))  # type: ignore[no-any-return]
    return _kv_ranges(storage, base, key, want)


class PackDirectory(list):  # type: ignore[type-arg]
    """A pack's directory entries (a list of :class:`PackMember`) with the bytes of the pack before its
    directory that the read of its end fetched: ``held`` is bytes ``[at, at + len(held))`` of the pack. A load
    from an object store serves the members there from them instead of fetching them again (a pack smaller
    than :data:`_PACK_TAIL_BYTES` is then read once, whole); a reader keeping many drops what is over its
    budget (:data:`KEEP_HELD_BYTES`) by setting ``held`` empty."""

    def __init__(self, entries: list[PackMember], at: int, held: memoryview) -> None:
        super().__init__(entries)
        self.at = at
        self.held: memoryview | bytes = held


#: the most bytes of its packs' ends a load keeps to serve members from (:class:`PackDirectory`)
KEEP_HELD_BYTES = 64 << 20


#: What an object store's reader of a pack returns: its last bytes, its size when known, and a reader of
#: byte ranges (``(offset, length)``, a length of None for the whole object).
RangesRead = tuple[bytes, int | None, Callable[[list[tuple[int, int | None]]], list[bytes]]]


def _kv_ranges(storage: Any, base: str, key: str, want: int) -> RangesRead | None:
    """The last ``want`` bytes of the pack ``key`` on an object store (through tensorstore), its size when
    it is shorter than that (read whole), and its ranged reader; None when it is absent."""
    from ..planning.packing import PACK_DIR

    path = f"{base}/{key}"
    kv = ranged_kvstore(storage, f"{base}/{PACK_DIR}")
    leaf = key[len(PACK_DIR) + 1 :]
    size: int | None = None
    value: bytes | None = None
    suffix = getattr(storage, "read_suffix", None)  # S3: the end and the size in one GET, however small
    if suffix is not None:
        try:
            got = suffix(base, key, want)
        except NotImplementedError:
            pass
        else:
            if got is None:
                return None
            value, size = got
    if value is None:
        try:
            result = kv.read(leaf, byte_range=slice(-want, None)).result()
        except ValueError as e:  # OUT_OF_RANGE: the object is shorter than the suffix asked: read it whole
            if "OUT_OF_RANGE" not in str(e):
                raise
            result = kv.read(leaf).result()
            if result.state == "value":
                size = len(result.value)
        if result.state != "value":
            return None
        value = bytes(result.value)

    def read_remote(ranges: list[tuple[int, int | None]]) -> list[bytes]:
        futures = [kv.read(leaf, byte_range=slice(o, o + n) if n is not None else None) for o, n in ranges]
        try:
            return [_settled(path, f.result, n) for f, (_o, n) in zip(futures, ranges)]
        except BaseException:
            for f in futures:  # the check fails: its reads not yet started are not sent
                f.cancel()
            raise

    return value, size, read_remote


def _settled(path: str, result: Callable[[], Any], n: int | None) -> bytes:
    """The bytes of a ranged read of the pack ``path`` (``result``: its future's), ``n`` bytes asked for."""
    try:
        r = result()
    except ValueError as e:  # OUT_OF_RANGE: shorter than its end records say
        if "OUT_OF_RANGE" not in str(e):
            raise
        raise CorruptCheckpointError(f"{path} is shorter than its end records say") from None
    if r.state == "value" and n is not None and len(r.value) < n:  # fsspec: the bytes it holds
        raise CorruptCheckpointError(f"{path} is shorter than its end records say")
    if r.state != "value":
        raise InconsistentCheckpointError(f"the pack {path} vanished while it was checked")
    return bytes(r.value)


class _PackReader:
    """Reads of byte ranges of one pack (``read(ranges)``: ``pread`` on a local file, concurrent ranged reads
    on an object store), serving what the first read of its end (``tail``) holds from memory. With
    ``whole_when_cheaper``, a batch of more ranges than the pack's size in first reads (``n x``
    :data:`_PACK_TAIL_BYTES` >= size: many members read from a small pack) fetches the pack once instead:
    up to its size where the store told it (``exact``: the object's own size), else all of it (the size then
    is what its end records say, and an object longer than that, bytes no record accounts for, is refused)."""

    def __init__(
        self,
        path: str,
        read: Callable[[list[tuple[int, int | None]]], list[bytes]],
        size: int | None,
        tail: bytes = b"",
        whole_when_cheaper: bool = False,
        exact: bool | None = None,
    ) -> None:
        self.path, self._read, self.size, self._tail = path, read, size, tail
        self.exact = size is not None if exact is None else exact  # ``size`` is the object's, from its store
        self._whole: bytes | None = None
        self._cheaper = whole_when_cheaper

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        if self.size is None:
            return self._read(list(ranges))
        cheaper = self._cheaper and len(ranges) * _PACK_TAIL_BYTES >= self.size > len(self._tail)
        if cheaper and self._whole is None:
            # its own size known: the read's time bound counts it; else all of it, to compare with the records
            (self._whole,) = self._read([(0, self.size if self.exact else None)])
            if len(self._whole) != self.size:
                raise CorruptCheckpointError(f"{self.path} is not the size its end records say (or changed)")
        held = self._whole if self._whole is not None else self._tail
        start = self.size - len(held)
        out: list[bytes | None] = [None] * len(ranges)
        missing = []
        for i, (offset, length) in enumerate(ranges):
            if start <= offset and offset + length <= start + len(held):
                out[i] = held[offset - start : offset - start + length]
            else:
                missing.append(i)
        for i, data in zip(missing, self._read([ranges[i] for i in missing]) if missing else []):
            out[i] = data
        return [b"" if d is None else d for d in out]


def _read_pack(
    path: str,
    tail: bytes,
    size: int | None,
    bound: int,
    reader: _PackReader,
    max_directory_bytes: int | None,
    check_members: Callable[[list[PackMember]], list[PackMember]] | None,
    deferred: dict[str, int] | None = None,
) -> tuple[list[PackMember], int]:
    """:func:`_pack_directory` once the pack's last bytes ``tail`` (and its ``size`` where known) are read."""
    entries, size, cd_offset = _parse_zip_directory(
        path, tail, size, bound, reader.read_many, max_directory_bytes
    )
    reader.size = size
    _check_entries(path, entries, cd_offset, reader, check_members, deferred)
    return entries, size


def _check_entries(
    path: str,
    entries: list[PackMember],
    cd_offset: int,
    reader: _PackReader,
    check_members: Callable[[list[PackMember]], list[PackMember]] | None,
    deferred: dict[str, int] | None,
) -> None:
    """``check_members`` on a pack's parsed directory ``entries``, then the local headers of the members it
    returns (or, with ``deferred``, where each of them ends, for the reader to check them)."""
    if check_members is not None:
        members = check_members(entries)
        if deferred is None:
            _check_local_headers(path, members, entries, cd_offset, reader.read_many)
        elif members:
            following = next_offsets(entries, cd_offset)
            deferred.update((e.filename, following[e.header_offset]) for e in members)


def _check_pack_size(path: str, size: int, bound: int) -> None:
    if size > bound:
        raise CorruptCheckpointError(
            f"{path} is larger than its arrays can be stored in ({bound} bytes at most); the checkpoint is "
            "damaged or hostile"
        )


#: The end records of a ZIP64 archive: the end record, the zip64 locator and the zip64 end record.
_TRAILER_MAX = 22 + 20 + 56
#: Bytes of a pack's end read first: the end records and the directory of a pack of a few thousand members.
_PACK_TAIL_BYTES = 256 << 10


def _pack_kvstore(storage: Any, base: str, key: str) -> Any:
    import tensorstore as ts

    from ..runtime.tscontext import context

    spec = {"driver": "zip", "base": storage.object_kvstore_spec(base, key)}
    return ts.KvStore.open(spec, context=context()).result()


def ranged_kvstore(storage: Any, root: str) -> Any:
    """What a pack below ``root`` is read through in byte ranges (``read(key, byte_range=...)``):
    tensorstore's key-value store, or the backend's own ranged reads where tensorstore cannot reach it
    (fsspec: :meth:`arraycheckpoint.storage.fsspec_store.FsspecStorage.ranged_reads`, which never downloads a
    pack whole)."""
    ranged = getattr(storage, "ranged_reads", None)
    return ranged(root) if ranged is not None else _kvstore(storage, root)


def _kvstore(storage: Any, root: str) -> Any:
    import tensorstore as ts

    from ..runtime.tscontext import context

    return ts.KvStore.open(storage.kvstore_spec(root), context=context()).result()
