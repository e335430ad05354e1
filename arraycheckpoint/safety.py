"""Checks on untrusted checkpoint input, run before anything the checkpoint declares is allocated or opened.

A checkpoint is input other jobs, tools and people write (DESIGN invariant 10). This module holds every check
of on-disk bytes the load path makes before tensorstore or numpy sees them:

* :func:`load_json_bounded`: JSON with a size cap and a nesting-depth cap (no ``RecursionError``, no
  gigabytes of metadata parsed);
* :func:`check_tensor_layout`: a declared array is possible (chunk <= shape, bounded chunk bytes and inner
  chunk count), so tensorstore never sizes a buffer from a hostile number;
* :func:`check_layouts`: every declared layout is possible (pure, before any I/O);
* :func:`check_chunk_files`: the arrays one rank reads, and only those, hold regular files only (no symlink, no
  FIFO, no device, nowhere below the root) and as many chunk objects as their chunk grids declare, so a shape
  of 1e13 declared by a checkpoint that holds one small file is refused before any buffer exists
  (:func:`check_checkpoint`: both, for every array; what the tools run);
* :func:`check_arrays`: just before the arrays are opened, every ``zarr.json`` read in one concurrent batch and
  cross-checked against ``.metadata.json`` (bounded parse; the exact bytes this release writes are accepted
  as they are), crc32c required on every inner chunk and on the shard index (whatever the checkpoint says
  about its codec preset), and the zstd frame headers of every chunk checked against the declared chunk size
  before tensorstore inflates them. It returns the validated array metadata, which the engine opens with
  ``assume_metadata`` so that tensorstore does not read ``zarr.json`` a second time.

It deliberately does not defend against a writer racing the reader (a file swapped for a symlink between the
scan and tensorstore's ``open``): tensorstore cannot open with ``O_NOFOLLOW``; docs/security.md says so.
Limits and their reasons are the module constants below.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from .errors import (  # InconsistentCheckpointError: also importable from here (its old home)
    CorruptCheckpointError,
    InconsistentCheckpointError,
    MetadataError,
)

#: Largest metadata file read (``.acp/metadata.json``; ``.metadata.json`` before format 3), in bytes. Format 1 stores one record per saved region; a 10,000-rank save
#: of a few thousand tensors stays far below this; anything larger is refused before it is read.
MAX_METADATA_BYTES = 256 << 20
#: Largest small JSON document of an array (``zarr.json``) or group.
MAX_ARRAY_JSON_BYTES = 1 << 20
#: JSON nesting limit: the deepest document arraycheckpoint writes is a user's extra state (a few levels);
#: Python's json parser recurses per level and fails near 1,000, so the limit stays well below that.
MAX_JSON_DEPTH = 100
#: Largest decoded chunk (one stored file). The planner's default is 64 MiB; a chunk is decoded whole in
#: memory by tensorstore, so this caps what one hostile file can make a reader allocate.
MAX_CHUNK_BYTES = 4 << 30
#: Largest single object a backend downloads whole (a chunk file: data, per inner chunk overheads, index).
MAX_OBJECT_BYTES = MAX_CHUNK_BYTES + (MAX_CHUNK_BYTES >> 4)
#: Most inner chunks per stored file: tensorstore reads a 16-byte index entry per inner chunk at once.
MAX_INNER_CHUNKS = 1 << 22
#: zstd block size limit (RFC 8878): no block decodes to more than this.
_ZSTD_BLOCK_MAX = 128 << 10
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

#: ``<array>/c.<i>.<j>...`` (format 3) or ``<array>/c/<i>/<j>...`` (formats 1, 2): zarr v3 default chunk keys
#: (``<array>/c`` for a 0-d array), by separator.
_CHUNK_KEYS = {sep: re.compile(r"^(.+)/c(?:" + re.escape(sep) + r"\d+)*$") for sep in "./"}
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


# JSON ------------------------------------------------------------------------------------------------------
def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays/objects in the JSON text ``raw`` (strings ignored); linear, no recursion."""
    bare = _STRING.sub(b'""', raw)
    codes = np.frombuffer(bare, dtype=np.uint8)
    if codes.size == 0:
        return 0
    step = np.zeros(codes.size, dtype=np.int64)
    step[(codes == ord("[")) | (codes == ord("{"))] = 1
    step[(codes == ord("]")) | (codes == ord("}"))] = -1
    return int(np.cumsum(step).max(initial=0))


def load_json_bounded(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH, what: str) -> Any:
    """Parse JSON from untrusted bytes with a size and a nesting-depth cap.

    Args:
        raw: the document.
        max_bytes: refuse a document longer than this.
        max_depth: refuse a document nested deeper than this (arrays and objects).
        what: what the document is (a path or a name), for the error.

    Returns:
        The parsed value.

    Raises:
        MetadataError: too long, too deep, or not valid JSON (the message names ``what``).
    """
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise MetadataError(
            f"{what} is {len(data)} bytes, above the limit of {max_bytes}: a valid checkpoint's file is far "
            "smaller; the checkpoint is damaged or was not written by arraycheckpoint"
        )
    depth = json_depth(data)
    if depth > max_depth:
        raise MetadataError(
            f"{what} nests JSON {depth} levels deep, above the limit of {max_depth}; the checkpoint is damaged "
            "or hostile (extra state this deep cannot be saved either)"
        )
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise MetadataError(f"{what} is not valid JSON ({e}); the checkpoint is damaged") from None


# Layouts ---------------------------------------------------------------------------------------------------
def check_tensor_layout(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    chunk_shape: tuple[int, ...],
    inner_chunk_shape: tuple[int, ...],
) -> None:
    """Refuse a declared array no valid checkpoint holds, before anything is sized from it.

    Every chunk dimension is >= 1 and at most the array dimension (a chunk of 1 on a zero-length dimension,
    as zarr requires); the inner chunk divides the chunk; one chunk decodes to at most
    :data:`MAX_CHUNK_BYTES`; a chunk holds at most :data:`MAX_INNER_CHUNKS` inner chunks.

    Raises:
        MetadataError: naming the tensor and the offending numbers.
    """
    from .codecs import numpy_dtype

    def bad(why: str) -> MetadataError:
        return MetadataError(
            f"tensor {name!r}: {why} (shape {list(shape)}, chunk {list(chunk_shape)}, inner chunk "
            f"{list(inner_chunk_shape)}); the checkpoint's metadata is damaged or hostile"
        )

    ndim = len(shape)
    if len(chunk_shape) != ndim or len(inner_chunk_shape) != ndim:
        raise bad("chunk and shape ranks differ")
    for s, c, i in zip(shape, chunk_shape, inner_chunk_shape):
        if c < 1 or i < 1:
            raise bad("a chunk dimension is below 1")
        if c > max(s, 1):
            raise bad("a chunk dimension exceeds the array dimension")
        if c % i:
            raise bad("the inner chunk does not divide the chunk")
    try:
        itemsize = numpy_dtype(dtype).itemsize
    except ValueError as e:
        raise bad(str(e)) from None
    nbytes = math.prod(chunk_shape) * itemsize
    if nbytes > MAX_CHUNK_BYTES:
        raise bad(f"one chunk decodes to {nbytes} bytes, above the limit of {MAX_CHUNK_BYTES}")
    inner = math.prod(c // i for c, i in zip(chunk_shape, inner_chunk_shape))
    if inner > MAX_INNER_CHUNKS:
        raise bad(f"one chunk holds {inner} inner chunks, above the limit of {MAX_INNER_CHUNKS}")


def chunk_count(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> int:
    """Chunks in the regular grid (0 for an empty array, 1 for a 0-d one)."""
    return math.prod(-(-s // c) for s, c in zip(shape, chunk_shape))


# Scanning -----------------------------------------------------------------------------------------------
def scan_local(path: str) -> dict[str, int]:
    """Every regular file below the directory ``path`` (relative key -> size), with ``os.scandir`` only.

    ``path`` itself may be a symlink (a checkpoint root often is); nothing below it may be one.

    Raises:
        CorruptCheckpointError: a symlink, FIFO, socket or device below ``path``, naming it.
    """
    out: dict[str, int] = {}
    stack = [("", path)]
    while stack:
        rel, directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            raise CorruptCheckpointError(
                f"{directory} is not a directory; the checkpoint is damaged"
            ) from None
        for e in entries:
            key = f"{rel}{e.name}"
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append((key + "/", e.path))
            elif stat.S_ISREG(st.st_mode):
                out[key] = st.st_size
            else:
                kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise CorruptCheckpointError(
                    f"{e.path} is {kind}; a checkpoint holds only regular files and directories, and nothing "
                    "is read through a link (replace it with the file itself, or re-save the checkpoint)"
                )
    return out


def _check_path_below(root: str, sub: str) -> None:
    """No component of ``root/sub`` below ``root`` is a symlink or a non-directory (``root`` may be a link)."""
    current = root.rstrip("/")
    for part in sub.strip("/").split("/"):
        current = f"{current}/{part}"
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise CorruptCheckpointError(
                f"{current} is {kind}; nothing in a checkpoint is read through a link (re-save the checkpoint)"
            )


def inventory(storage: Any, root: str) -> dict[str, int | None]:
    """Every object below ``root``: key -> size (None where the backend lists no sizes)."""
    if getattr(storage, "commit_strategy", "") == "rename":  # a POSIX file system
        return dict(scan_local(root))
    sized = getattr(storage, "list_sizes", None)
    if sized is not None:
        return sized(root)
    return dict.fromkeys(storage.list(root))


def check_checkpoint(storage: Any, root: str, meta: Any) -> dict[str, int | None]:
    """Validate a whole committed checkpoint against its metadata: :func:`check_layouts`, then
    :func:`check_chunk_files` of every array (one scan of the checkpoint; what the tools use).

    Returns:
        The inventory (key -> size) of the checkpoint's arrays.
    """
    check_layouts(meta)
    return check_chunk_files(storage, root, meta, None)


def check_layouts(meta: Any) -> None:
    """Every tensor's declared layout passes :func:`check_tensor_layout` (pure: no I/O).

    Raises:
        MetadataError: a layout no valid checkpoint has.
    """
    for name, t in meta.tensors.items():
        check_tensor_layout(name, t.shape, t.dtype, t.chunk_shape, t.inner_chunk_shape)


#: Keys one listing request returns (S3 and GCS pages), to weigh one listing per array against one of all.
_KEYS_PER_LISTING = 1000


def check_chunk_files(
    storage: Any, root: str, meta: Any, names: Collection[str] | None
) -> dict[str, int | None]:
    """The stored files of the arrays ``names`` (every array if None) match their metadata.

    Each array holds exactly as many chunk objects as its grid declares (every chunk has its file, also an
    all-zero one), none larger than a chunk can encode to, and, on local file systems, only regular files
    with no link anywhere on the path below ``root``. A load checks only the arrays it reads: at 10,000
    ranks, every rank scanning a whole checkpoint of 100,000 files would cost the file system a billion
    metadata operations per load; checking what one reads costs one directory listing per array read. On
    object stores, one listing of the whole checkpoint replaces the per-array ones when it takes fewer
    requests (a rank that reads most arrays).

    Returns:
        The inventory (key -> size) of the arrays checked.

    Raises:
        MetadataError: a declared shape the stored files do not hold.
        CorruptCheckpointError: a symlink or non-regular file, or an oversized chunk file.
    """
    from .codecs import numpy_dtype
    from .metadata import chunk_key_separator

    chunk_key = _CHUNK_KEYS[chunk_key_separator(meta.format_version)]
    selected = list(meta.tensors) if names is None else [n for n in dict.fromkeys(names) if n in meta.tensors]
    packed = [n for n in selected if meta.tensors[n].pack is not None]
    selected = [n for n in selected if meta.tensors[n].pack is None]
    items = _array_inventory(storage, root, meta, selected if names is not None else None)
    items.update(check_packs(storage, root, meta, packed))
    chunks: dict[str, list[int | None]] = {}
    for key, size in items.items():
        m = chunk_key.match(key)
        if m:
            chunks.setdefault(m.group(1), []).append(size)
    for name in selected:
        t = meta.tensors[name]
        expected = chunk_count(t.shape, t.chunk_shape)
        found = chunks.get(name, [])
        if len(found) != expected:
            raise InconsistentCheckpointError(
                f"tensor {name!r}: the metadata declares shape {list(t.shape)} in {expected} chunk(s) of "
                f"{list(t.chunk_shape)}, but the checkpoint holds {len(found)} chunk file(s) for it; the "
                "metadata does not describe this checkpoint (damaged, hostile, or partly deleted)"
            )
        limit = _max_file_bytes(t.chunk_shape, t.inner_chunk_shape, numpy_dtype(t.dtype).itemsize)
        too_big = [s for s in found if s is not None and s > limit]
        if too_big:
            raise CorruptCheckpointError(
                f"tensor {name!r}: a chunk file of {max(too_big)} bytes is larger than any encoding of its "
                f"{list(t.chunk_shape)} chunk ({limit} bytes at most); the checkpoint is damaged"
            )
    return items


def _array_inventory(storage: Any, root: str, meta: Any, names: list[str] | None) -> dict[str, int | None]:
    """Keys (relative to ``root``) and sizes of the arrays ``names``' files, or of everything if None."""
    if names is None:
        return inventory(storage, root)
    if getattr(storage, "commit_strategy", "") != "rename":
        stored = sum(chunk_count(t.shape, t.chunk_shape) + 1 for t in meta.tensors.values() if t.pack is None)
        if len(names) * _KEYS_PER_LISTING >= stored:  # one listing of everything takes fewer requests
            return inventory(storage, root)
    out: dict[str, int | None] = {}
    base = root.rstrip("/")
    for name in names:
        if getattr(storage, "commit_strategy", "") == "rename":
            _check_path_below(base, name)  # no link on the way down (the scan below refuses any beneath)
        out.update((f"{name}/{k}", n) for k, n in inventory(storage, f"{base}/{name}").items())
    return out


def _max_file_bytes(chunk: tuple[int, ...], inner: tuple[int, ...], itemsize: int) -> int:
    """Upper bound of one stored chunk file: data, per inner chunk crc + zstd worst-case overhead, index."""
    n_inner = math.prod(c // i for c, i in zip(chunk, inner))
    inner_bytes = math.prod(inner) * itemsize
    zstd_overhead = 32 + 3 * (inner_bytes // _ZSTD_BLOCK_MAX + 1)
    return n_inner * (inner_bytes + zstd_overhead + 4 + 16) + 4


# Arrays ------------------------------------------------------------------------------------------------
def check_arrays(
    storage: Any, root: str, meta: Any, wanted: Mapping[str, list[Any] | None]
) -> dict[str, dict[str, Any]]:
    """Check the arrays about to be opened; return each one's zarr v3 metadata to open it with.

    ``wanted`` maps each array's name to the regions about to be read of it (None: all of it). The arrays'
    files were scanned by :func:`check_checkpoint` (regular files only, as many chunks as declared). Here
    each ``zarr.json`` (when the codec preset is unknown, and on local file systems always, where it costs
    little) must agree with ``.metadata.json`` on shape, data type, chunk grid, chunk keys and compression,
    and must protect every inner chunk and the shard index with crc32c; the checkpoint cannot switch
    integrity checks off. The documents are read concurrently through one key-value store, and one that is
    byte-for-byte what arraycheckpoint writes for the array is accepted without parsing it. Compressed
    arrays: every zstd frame is checked against the declared inner chunk size before tensorstore inflates
    it (only in the chunks that intersect the wanted regions).

    Raises:
        MetadataError: a ``zarr.json`` is missing, malformed, disagrees with ``.metadata.json``, or lacks
            crc32c.
        CorruptCheckpointError: a zstd frame that does not decode to its declared chunk.
    """
    from .codecs import CODEC_PRESET
    from .metadata import chunk_key_separator

    sep = chunk_key_separator(meta.format_version)
    base = root.rstrip("/")
    generated = {name: _generated(meta.tensors[name], sep) for name in wanted}
    docs = {name: doc for name, (doc, _) in generated.items()}
    if getattr(storage, "commit_strategy", "") == "rename" or meta.codec_preset != CODEC_PRESET:
        kv = _kvstore(storage, base)
        packs = {
            key: _pack_kvstore(storage, base, key)
            for key in {meta.tensors[n].pack for n in wanted} - {None}
        }
        reads = {
            name: (packs[meta.tensors[name].pack] if meta.tensors[name].pack else kv).read(f"{name}/zarr.json")
            for name in wanted
        }
        for name, fut in reads.items():
            result = fut.result()
            pack = meta.tensors[name].pack
            where = f"{base}/{pack}:{name}" if pack else f"{base}/{name}"
            if result.state != "value":
                raise MetadataError(
                    f"tensor {name!r}: {where}/zarr.json is missing; the checkpoint is damaged"
                )
            raw = bytes(result.value)
            if raw == generated[name][1]:
                continue  # what this release writes for exactly this array
            stored = load_json_bounded(raw, max_bytes=MAX_ARRAY_JSON_BYTES, what=f"{where}/zarr.json")
            _cross_check(meta.tensors[name], stored, docs[name], where)
            if meta.codec_preset != CODEC_PRESET:
                docs[name] = stored
    for name, boxes in wanted.items():
        tm = meta.tensors[name]
        if tm.compression is not None:
            _check_zstd_chunks(_kvstore(storage, f"{base}/{name}"), tm, f"{base}/{name}", boxes, sep)
    return docs


def _generated(tm: Any, separator: str) -> tuple[dict[str, Any], bytes]:
    """The zarr v3 metadata arraycheckpoint writes for ``tm``, and its ``zarr.json`` bytes as the save path
    encodes them (``json.dumps`` defaults); shared between the arrays of one layout, never to be mutated."""
    leaf = tm.name.rsplit("/", 1)[-1]  # dimension names come from the last component
    return _generated_for(
        tuple(tm.shape),
        tm.dtype,
        tuple(tm.chunk_shape),
        tuple(tm.inner_chunk_shape),
        tm.compression,
        leaf,
        separator,
    )


@functools.lru_cache(maxsize=4096)
def _generated_for(
    shape: tuple[int, ...],
    dtype: str,
    chunk: tuple[int, ...],
    inner: tuple[int, ...],
    compression: str | None,
    leaf: str,
    separator: str,
) -> tuple[dict[str, Any], bytes]:
    from .codecs import array_metadata, numpy_dtype

    doc = array_metadata(shape, numpy_dtype(dtype), chunk, inner, compression, name=leaf, separator=separator)
    return doc, json.dumps(doc).encode()


def _has_byte(kv: Any, key: str, offset: int) -> bool:
    """Whether the value of ``key`` is longer than ``offset`` bytes, reading at most one byte of it."""
    try:
        result = kv.read(key, byte_range=slice(offset, offset + 1)).result()
    except ValueError as e:  # tensorstore: OUT_OF_RANGE for a range past the end of the value
        if "OUT_OF_RANGE" in str(e):
            return False
        raise
    return result.state == "value" and len(result.value) > 0


# Packs -----------------------------------------------------------------------------------------------------
#: Largest ``zarr.json`` member of a pack: what a save writes is about 1 KiB; this caps what one member can
#: make the reader allocate before its bounded parse.
MAX_PACKED_JSON_BYTES = 64 << 10


def check_packs(storage: Any, root: str, meta: Any, names: Collection[str]) -> dict[str, int | None]:
    """The packs holding the arrays ``names`` (format 5, :mod:`arraycheckpoint.packing`) are sound.

    Each pack must be a regular file (no link on the way, on local file systems) no larger than its declared
    arrays can be, and its ZIP central directory must name every member of the arrays read exactly once,
    stored uncompressed (nothing is inflated: no ZIP bomb) and no larger than the member can be: the array's
    ``zarr.json`` within :data:`MAX_PACKED_JSON_BYTES`, and exactly as many chunk members as its grid
    declares, each within its encoding's size. Only then does tensorstore's ``zip`` driver read a member.

    Returns:
        ``pack key -> size`` of the packs checked.

    Raises:
        InconsistentCheckpointError: a pack or a member is missing, or a chunk count is off.
        CorruptCheckpointError: a link, a non-regular or oversized pack, a compressed, duplicated or
            oversized member, or a pack that is no ZIP archive.
    """
    from .codecs import numpy_dtype
    from .metadata import chunk_key_separator
    from .packing import by_pack

    if not names:
        return {}
    chunk_key = _CHUNK_KEYS[chunk_key_separator(meta.format_version)]
    members_of = by_pack({n: t.pack for n, t in meta.tensors.items() if t.pack is not None})
    base = root.rstrip("/")
    out: dict[str, int | None] = {}
    for key, reading in by_pack({n: meta.tensors[n].pack for n in names}).items():
        every = members_of[key]
        limits = {
            n: _max_file_bytes(
                meta.tensors[n].chunk_shape,
                meta.tensors[n].inner_chunk_shape,
                numpy_dtype(meta.tensors[n].dtype).itemsize,
            )
            for n in every
        }
        chunk_bytes = [limits[n] * chunk_count(meta.tensors[n].shape, meta.tensors[n].chunk_shape) for n in every]
        from .packing import MEMBER_OVERHEAD, group_keys, max_pack_bytes

        json_bytes = [MAX_PACKED_JSON_BYTES] * (len(every) + len(group_keys(every)))
        entries = sum(chunk_count(meta.tensors[n].shape, meta.tensors[n].chunk_shape) for n in every)
        entries += len(json_bytes)
        bound = max_pack_bytes(chunk_bytes + json_bytes, entries, sum(len(n) + 32 for n in every) * entries)
        bound = min(bound, MAX_OBJECT_BYTES * 4)
        infos, size = _pack_directory(storage, base, key, bound)
        out[key] = size
        where = f"{base}/{key}"
        seen: dict[str, Any] = {}
        for info in infos:
            if info.filename in seen:
                raise CorruptCheckpointError(f"{where} names the member {info.filename!r} twice; the pack is damaged")
            seen[info.filename] = info
        chunks: dict[str, list[Any]] = {}
        for fname, info in seen.items():
            m = chunk_key.match(fname)
            if m:
                chunks.setdefault(m.group(1), []).append(info)
        for name in reading:
            t = meta.tensors[name]
            doc = seen.get(f"{name}/zarr.json")
            if doc is None:
                raise InconsistentCheckpointError(
                    f"tensor {name!r}: its pack {where} holds no {name}/zarr.json; the checkpoint is damaged"
                )
            found = chunks.get(name, [])
            expected = chunk_count(t.shape, t.chunk_shape)
            if len(found) != expected:
                raise InconsistentCheckpointError(
                    f"tensor {name!r}: the metadata declares {expected} chunk(s) of {list(t.chunk_shape)}, but its "
                    f"pack {where} holds {len(found)}; the metadata does not describe this checkpoint"
                )
            for info, limit in [(doc, MAX_PACKED_JSON_BYTES)] + [(i, limits[name]) for i in found]:
                if info.compress_type != 0 or info.compress_size != info.file_size:
                    raise CorruptCheckpointError(
                        f"tensor {name!r}: member {info.filename!r} of {where} is compressed (method "
                        f"{info.compress_type}); packs store members uncompressed, nothing is inflated"
                    )
                if info.file_size > limit:
                    raise CorruptCheckpointError(
                        f"tensor {name!r}: member {info.filename!r} of {where} is {info.file_size} bytes, more "
                        f"than its encoding can be ({limit}); the checkpoint is damaged"
                    )
    return out


def _pack_directory(storage: Any, base: str, key: str, bound: int) -> tuple[list[Any], int | None]:
    """The ZIP central directory of the pack ``key`` (its entries) and the pack's size, after checking that
    the pack is a regular object of at most ``bound`` bytes (never read through a link)."""
    import io
    import zipfile

    from .packing import PACK_DIR

    path = f"{base}/{key}"
    try:
        if getattr(storage, "commit_strategy", "") == "rename":
            _check_path_below(base, PACK_DIR)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise InconsistentCheckpointError(f"the pack {path} is missing; the checkpoint is damaged") from None
            except OSError as e:  # ELOOP: a symbolic link
                raise CorruptCheckpointError(
                    f"{path} cannot be opened without following a link ({e}); nothing in a checkpoint is read "
                    "through a link"
                ) from None
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptCheckpointError(f"{path} is not a regular file; the checkpoint is damaged")
                _check_pack_size(path, st.st_size, bound)
                return zipfile.ZipFile(f).infolist(), st.st_size
        kv = _kvstore(storage, f"{base}/{PACK_DIR}")
        leaf = key[len(PACK_DIR) + 1 :]
        try:
            result = kv.read(leaf, byte_range=slice(0, bound + 1)).result()
        except ValueError as e:  # OUT_OF_RANGE: the object is shorter than the bound, so read it whole
            if "OUT_OF_RANGE" not in str(e):
                raise
            result = kv.read(leaf).result()
        if result.state != "value":
            raise InconsistentCheckpointError(f"the pack {path} is missing; the checkpoint is damaged")
        data = bytes(result.value)
        _check_pack_size(path, len(data), bound)
        return zipfile.ZipFile(io.BytesIO(data)).infolist(), len(data)
    except zipfile.BadZipFile as e:
        raise CorruptCheckpointError(f"{path} is not a readable ZIP archive ({e}); the checkpoint is damaged") from None


def _check_pack_size(path: str, size: int, bound: int) -> None:
    if size > bound:
        raise CorruptCheckpointError(
            f"{path} is larger than its arrays can be stored in ({bound} bytes at most); the checkpoint is "
            "damaged or hostile"
        )


def _pack_kvstore(storage: Any, base: str, key: str) -> Any:
    import tensorstore as ts

    from ._tscontext import context

    spec = {"driver": "zip", "base": storage.object_kvstore_spec(base, key)}
    return ts.KvStore.open(spec, context=context()).result()


def _kvstore(storage: Any, root: str) -> Any:
    import tensorstore as ts

    from ._tscontext import context

    return ts.KvStore.open(storage.kvstore_spec(root), context=context()).result()


def _cross_check(tm: Any, stored: Any, generated: Mapping[str, Any], where: str) -> None:
    def bad(why: str) -> MetadataError:
        return MetadataError(
            f"tensor {tm.name!r}: {where}/zarr.json {why}; it must agree with the checkpoint metadata (the checkpoint "
            "is damaged or hostile: re-save it, or read the array with zarr directly if you trust it)"
        )

    if not isinstance(stored, dict):
        raise bad("is not a JSON object")
    for key in ("zarr_format", "node_type", "data_type", "shape", "chunk_grid"):
        if stored.get(key) != generated[key]:
            raise bad(
                f"has {key} {stored.get(key)!r} where the checkpoint metadata implies {generated[key]!r}"
            )
    encoding = stored.get("chunk_key_encoding")
    bare_default = {"name": "default"}  # means the "/" separator
    if encoding != generated["chunk_key_encoding"] and not (
        encoding == bare_default and generated["chunk_key_encoding"]["configuration"]["separator"] == "/"
    ):
        raise bad(f"has chunk_key_encoding {encoding!r}; arraycheckpoint writes the default one")
    codecs = stored.get("codecs")
    if not isinstance(codecs, list) or len(codecs) != 1 or not isinstance(codecs[0], dict):
        raise bad("does not hold exactly one sharding_indexed codec")
    sharding = codecs[0]
    config = sharding.get("configuration")
    if sharding.get("name") != "sharding_indexed" or not isinstance(config, dict):
        raise bad("does not hold exactly one sharding_indexed codec")
    want = generated["codecs"][0]["configuration"]
    if config.get("chunk_shape") != want["chunk_shape"]:
        raise bad(f"has inner chunk {config.get('chunk_shape')!r}, not {want['chunk_shape']!r}")
    inner = config.get("codecs")
    index = config.get("index_codecs")
    names = (
        [c.get("name") for c in inner]
        if isinstance(inner, list) and all(isinstance(c, dict) for c in inner)
        else None
    )
    index_names = (
        [c.get("name") for c in index]
        if isinstance(index, list) and all(isinstance(c, dict) for c in index)
        else None
    )
    if not names or names[-1] != "crc32c" or not index_names or index_names[-1] != "crc32c":
        raise bad(
            "does not protect every inner chunk and the shard index with crc32c; a native load always "
            "verifies checksums and the checkpoint's own files cannot turn that off"
        )
    if names != [c["name"] for c in want["codecs"]]:
        raise bad(f"has inner codecs {names}, not {[c['name'] for c in want['codecs']]}")


def _check_zstd_chunks(kv: Any, tm: Any, where: str, boxes: list[Any] | None, separator: str) -> None:
    """Walk every zstd frame of every chunk file that ``boxes`` touch (all when None): one frame per inner
    chunk, decoding to its declared size."""
    from .codecs import numpy_dtype
    from .regions import Box, intersect

    itemsize = numpy_dtype(tm.dtype).itemsize
    expected = math.prod(tm.inner_chunk_shape) * itemsize
    n_inner = math.prod(c // i for c, i in zip(tm.chunk_shape, tm.inner_chunk_shape))
    index_bytes = n_inner * 16 + 4
    limit = _max_file_bytes(tm.chunk_shape, tm.inner_chunk_shape, itemsize)
    keys = sorted(k.decode() if isinstance(k, bytes) else k for k in kv.list().result())
    for key in keys:
        m = re.fullmatch(r"c((?:" + re.escape(separator) + r"\d+)*)", key)
        if m is None:
            continue
        index_of = tuple(int(i) for i in m.group(1).split(separator)[1:])
        if boxes is not None and index_of and len(index_of) == len(tm.chunk_shape):
            lo = tuple(i * c for i, c in zip(index_of, tm.chunk_shape))
            chunk = Box(lo, tuple(min(c, s - o) for c, s, o in zip(tm.chunk_shape, tm.shape, lo)))
            if not any(intersect(chunk, b) for b in boxes):
                continue
        # at most one byte over the largest valid file: storage that lists no sizes (S3, memory) skipped the
        # size check of check_checkpoint, and a hostile chunk file must not be downloaded whole
        path = f"{where}/{key}"
        if _has_byte(kv, key, limit):  # a one-byte probe: tensorstore refuses ranges past the end of a value
            raise CorruptCheckpointError(
                f"tensor {tm.name!r}: {path} is larger than any encoding of its {list(tm.chunk_shape)} chunk "
                f"({limit} bytes at most); the checkpoint is damaged"
            )
        result = kv.read(key).result()
        if result.state != "value":
            continue
        data = bytes(result.value)
        if len(data) < index_bytes:
            raise CorruptCheckpointError(f"tensor {tm.name!r}: {path} is shorter than its shard index")
        index = np.frombuffer(data, dtype="<u8", count=n_inner * 2, offset=len(data) - index_bytes)
        for offset, length in index.reshape(-1, 2).tolist():
            if offset == length == 2**64 - 1:
                continue  # an absent inner chunk (fill value)
            if offset + length > len(data) - index_bytes:
                raise CorruptCheckpointError(
                    f"tensor {tm.name!r}: {path} has an index entry outside the file"
                )
            check_zstd_frame(
                memoryview(data)[offset : offset + length - 4], expected, f"tensor {tm.name!r}: {path}"
            )


def check_zstd_frame(frame: bytes | memoryview, expected: int, what: str) -> None:
    """Refuse a zstd frame that does not decode to exactly ``expected`` bytes, from its headers alone.

    The frame must be one zstd frame that declares its content size (tensorstore and zarr-python write it),
    equal to ``expected``, whose blocks cannot decode to more than ``expected`` plus one block, and which
    ends where the data ends. This bounds what the decoder allocates, whatever the bytes say.

    Raises:
        CorruptCheckpointError: naming ``what`` and the declared sizes.
    """
    data = bytes(frame)

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{what}: zstd frame {why} (an inner chunk decodes to {expected} bytes); refused before "
            "decompression: the checkpoint is damaged or hostile"
        )

    if len(data) < 6 or data[:4] != _ZSTD_MAGIC:
        raise bad("has no zstd magic number")
    fhd = data[4]
    fcs_flag, single, reserved, has_checksum, dict_flag = (
        fhd >> 6,
        (fhd >> 5) & 1,
        (fhd >> 3) & 1,
        (fhd >> 2) & 1,
        fhd & 3,
    )
    if reserved:
        raise bad("sets a reserved header bit")
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise bad("does not declare its content size")
    if pos + fcs_size > len(data):
        raise bad("is truncated")
    content = int.from_bytes(data[pos : pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    if content != expected:
        raise bad(f"declares {content} decoded bytes")
    pos += fcs_size
    blocks = 0
    literal = 0
    limit = max(1, -(-expected // _ZSTD_BLOCK_MAX))
    while True:
        if pos + 3 > len(data):
            raise bad("is truncated")
        header = int.from_bytes(data[pos : pos + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        pos += 3
        blocks += 1
        if blocks > limit or size > _ZSTD_BLOCK_MAX:
            raise bad(f"has more or larger blocks than {expected} bytes need")
        if kind == 0:  # raw
            literal += size
            pos += size
        elif kind == 1:  # RLE: one byte repeated `size` times
            literal += size
            pos += 1
        elif kind == 2:  # compressed: decodes to at most one block
            pos += size
        else:
            raise bad("uses the reserved block type")
        if literal > expected:
            raise bad(f"holds blocks decoding to more than {expected} bytes")
        if last:
            break
    pos += 4 if has_checksum else 0
    if pos != len(data):
        raise bad("is followed by other data (a second frame or garbage)")
