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
* :func:`check_packs` (within :func:`check_chunk_files`): the packs (format 5, ZIP files of small arrays)
  holding the arrays read are regular files laid out as a save writes them, with exactly the members their
  arrays declare, stored uncompressed, bounded, and with local headers that agree with the central directory
  (tensorstore's ``zip`` driver decodes by the local header), so nothing is ever inflated;
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

import dataclasses
import functools
import itertools
import json
import math
import os
import re
import stat
import struct
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

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
#: JSON containers (arrays and objects) any document may hold regardless of its size: about 64 MiB of
#: parsed dicts at most; user extra state of a million small lists stays under it.
JSON_CONTAINERS_FREE = 1 << 20
#: Bytes of JSON text per further container: a saved metadata document holds about one array or object per
#: 24 bytes (8 per tensor entry of about 190 bytes), empty objects ``{},`` one per 3 bytes.
JSON_BYTES_PER_CONTAINER = 16
#: Block of JSON text scanned at once by :func:`json_shape`.
_SCAN_BLOCK = 1 << 20
#: Largest decoded chunk (one stored file). The planner's default is 64 MiB; a chunk is decoded whole in
#: memory by tensorstore, so this caps what one hostile file can make a reader allocate.
MAX_CHUNK_BYTES = 4 << 30
#: Largest single object a backend downloads whole (a chunk file: data, per inner chunk overheads, index).
MAX_OBJECT_BYTES = MAX_CHUNK_BYTES + (MAX_CHUNK_BYTES >> 4)
#: Most inner chunks per stored file: tensorstore reads a 16-byte index entry per inner chunk at once.
MAX_INNER_CHUNKS = 1 << 22
#: Most chunks (stored files, or pack members) of one array: a file system holds at most 2^32 files (inode
#: numbers of ext4 and xfs), and listing that many objects takes millions of requests.
MAX_CHUNKS_PER_ARRAY = 1 << 32
#: Most chunks of one packed array: every member of a pack takes at least 154 bytes (132 of ZIP records, its
#: name twice, 24 bytes of encoding around one element), and a pack is at most 4 x MAX_OBJECT_BYTES.
MAX_PACKED_CHUNKS = 4 * MAX_OBJECT_BYTES // 154
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
    return json_shape(raw)[0]


def json_shape(raw: bytes) -> tuple[int, int]:
    """``(deepest nesting, number of arrays and objects)`` of the JSON text ``raw`` (strings ignored).

    Linear and in bounded memory: one copy of the text with its strings emptied, then blocks of
    :data:`_SCAN_BLOCK` bytes (about 9 bytes per byte of one block), never an integer per byte of a document of
    hundreds of MiB. No recursion, nothing parsed.
    """
    bare = _STRING.sub(b'""', raw)
    level = deepest = containers = 0
    for start in range(0, len(bare), _SCAN_BLOCK):
        codes = np.frombuffer(bare, dtype=np.uint8, count=min(_SCAN_BLOCK, len(bare) - start), offset=start)
        opens = (codes == ord("[")) | (codes == ord("{"))
        step = opens.view(np.int8) - ((codes == ord("]")) | (codes == ord("}"))).view(np.int8)
        levels = np.cumsum(step, dtype=np.int32)  # within a block: at most _SCAN_BLOCK levels
        deepest = max(deepest, level + int(levels.max()))
        level += int(levels[-1])
        containers += int(np.count_nonzero(opens))
    return deepest, containers


def max_json_containers(nbytes: int) -> int:
    """Most arrays and objects a JSON document of ``nbytes`` may hold (:data:`JSON_CONTAINERS_FREE` plus one
    per :data:`JSON_BYTES_PER_CONTAINER` bytes); a parsed container costs 56-64 bytes or more, so this bounds
    what a document can make its reader allocate, whatever its size limit."""
    return JSON_CONTAINERS_FREE + nbytes // JSON_BYTES_PER_CONTAINER


def load_json_bounded(raw: bytes | str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH, what: str) -> Any:
    """Parse JSON from untrusted bytes with a size cap, a nesting-depth cap and a cap on its containers.

    Args:
        raw: the document.
        max_bytes: refuse a document longer than this.
        max_depth: refuse a document nested deeper than this (arrays and objects).
        what: what the document is (a path or a name), for the error.

    Returns:
        The parsed value.

    Raises:
        MetadataError: too long, too deep, holding more arrays and objects than :func:`max_json_containers`
            allows for its size, or not valid JSON (the message names ``what``). Nothing is parsed before
            the size, depth and container checks pass.
    """
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise MetadataError(
            f"{what} is {len(data)} bytes, above the limit of {max_bytes}: a valid checkpoint's file is far "
            "smaller; the checkpoint is damaged or was not written by arraycheckpoint"
        )
    depth, containers = json_shape(data)
    if depth > max_depth:
        raise MetadataError(
            f"{what} nests JSON {depth} levels deep, above the limit of {max_depth}; the checkpoint is damaged "
            "or hostile (extra state this deep cannot be saved either)"
        )
    if containers > max_json_containers(len(data)):
        raise MetadataError(
            f"{what} holds {containers} JSON arrays and objects in {len(data)} bytes, above the limit of "
            f"{max_json_containers(len(data))} (a valid checkpoint's metadata holds about one per 24 bytes); "
            "refused before parsing: the checkpoint is damaged or hostile"
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
    chunks = chunk_count(shape, chunk_shape)
    if chunks > MAX_CHUNKS_PER_ARRAY:
        raise bad(f"the array has {chunks} chunks, more than any storage holds ({MAX_CHUNKS_PER_ARRAY})")


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


def _check_path_below(
    root: str, sub: str, why: str = "nothing in a checkpoint is read through a link (re-save the checkpoint)"
) -> None:
    """No component of ``root/sub`` below ``root`` is a symlink or a non-directory (``root`` may be a link);
    ``why`` ends the error."""
    current = root.rstrip("/")
    for part in sub.strip("/").split("/"):
        current = f"{current}/{part}"
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise CorruptCheckpointError(f"{current} is {kind}; {why}")


def _check_member(e: Any, name: str, where: str, limit: int) -> None:
    """A pack member ``e`` of tensor ``name`` is stored uncompressed and at most ``limit`` bytes."""
    if e.compress_type != 0 or e.compress_size != e.file_size:
        raise CorruptCheckpointError(
            f"tensor {name!r}: member {e.filename!r} of {where} is compressed (method "
            f"{e.compress_type}); packs store members uncompressed, nothing is inflated"
        )
    if e.file_size > limit:
        raise CorruptCheckpointError(
            f"tensor {name!r}: member {e.filename!r} of {where} is {e.file_size} bytes, more "
            f"than its encoding can be ({limit}); the checkpoint is damaged"
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
        chunks = chunk_count(t.shape, t.chunk_shape)
        if t.pack is not None and chunks > MAX_PACKED_CHUNKS:
            raise MetadataError(
                f"tensor {name!r}: packed in {t.pack} as {chunks} chunks of {list(t.chunk_shape)} (shape "
                f"{list(t.shape)}), more than any pack holds ({MAX_PACKED_CHUNKS}); the checkpoint's metadata "
                "is damaged or hostile"
            )


#: Keys one listing request returns (S3 and GCS pages), to weigh one listing per array against one of all.
_KEYS_PER_LISTING = 1000


def check_chunk_files(
    storage: Any,
    root: str,
    meta: Any,
    names: Collection[str] | None,
    directories: dict[str, list[Any]] | None = None,
    regions: Mapping[str, list[Any] | None] | None = None,
) -> dict[str, int | None]:
    """The stored files of the arrays ``names`` (every array if None) match their metadata.

    Each array holds exactly as many chunk objects as its grid declares (every chunk has its file, also an
    all-zero one), none larger than a chunk can encode to, and, on local file systems, only regular files
    with no link anywhere on the path below ``root``. A load checks only the arrays it reads: at 10,000
    ranks, every rank scanning a whole checkpoint of 100,000 files would cost the file system a billion
    metadata operations per load; checking what one reads costs one directory listing per array read. On
    object stores, one listing of the whole checkpoint replaces the per-array ones when it takes fewer
    requests (a rank that reads most arrays).

    ``directories`` receives the ZIP directories of the packs checked (:func:`check_packs`,
    :func:`check_rank_packs`); ``regions`` (name -> regions read) limits the format-6 packs checked to those
    holding chunks that meet them.

    Returns:
        The inventory (key -> size) of the arrays checked.

    Raises:
        MetadataError: a declared shape the stored files do not hold.
        CorruptCheckpointError: a symlink or non-regular file, or an oversized chunk file.
    """
    from .codecs import numpy_dtype
    from .format.metadata import chunk_key_separator

    chunk_key = _CHUNK_KEYS[chunk_key_separator(meta.format_version)]
    selected = list(meta.tensors) if names is None else [n for n in dict.fromkeys(names) if n in meta.tensors]
    packed = [n for n in selected if meta.tensors[n].pack is not None]
    by_rank = [n for n in packed if meta.tensors[n].pack_rank is not None]
    packed = [n for n in packed if meta.tensors[n].pack_rank is None]
    selected = [n for n in selected if meta.tensors[n].pack is None]
    items = _array_inventory(storage, root, meta, selected if names is not None else None)
    items.update(check_packs(storage, root, meta, packed, directories))
    items.update(check_rank_packs(storage, root, meta, by_rank, regions, directories))
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
    if not names:  # only packed arrays are read: their packs are checked, nothing is listed
        return {}
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
    from .format.metadata import chunk_key_separator

    sep = chunk_key_separator(meta.format_version)
    base = root.rstrip("/")
    generated = {name: _generated(meta.tensors[name], sep) for name in wanted}
    docs = {name: doc for name, (doc, _) in generated.items()}
    if getattr(storage, "commit_strategy", "") == "rename" or meta.codec_preset != CODEC_PRESET:
        kv = _kvstore(storage, base)
        # format 6: a packed array's zarr.json is checked where its pack is read (check_packed_doc)
        own = [n for n in wanted if meta.tensors[n].pack_rank is None]
        packs = {
            key: _pack_kvstore(storage, base, key) for key in {meta.tensors[n].pack for n in own} - {None}
        }
        reads = {
            name: (packs[meta.tensors[name].pack] if meta.tensors[name].pack else kv).read(
                f"{name}/zarr.json"
            )
            for name in own
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


def check_packed_doc(tm: Any, raw: bytes, where: str, separator: str) -> None:
    """The ``zarr.json`` bytes ``raw`` of the packed array ``tm`` (read from ``where``) agree with the checkpoint
    metadata (:func:`check_arrays`' check, for the readers of format-6 packs).

    Raises:
        MetadataError: a malformed document, or one that disagrees with the metadata or lacks crc32c.
    """
    doc, exact = _generated(tm, separator)
    if raw == exact:
        return
    stored = load_json_bounded(raw, max_bytes=MAX_ARRAY_JSON_BYTES, what=f"{where}/zarr.json")
    _cross_check(tm, stored, doc, where)


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


def check_packs(
    storage: Any,
    root: str,
    meta: Any,
    names: Collection[str],
    directories: dict[str, list[Any]] | None = None,
) -> dict[str, int | None]:
    """The packs holding the arrays ``names`` (format 5, :mod:`arraycheckpoint.planning.packing`) are sound.

    A pack must be a regular file (no link on the way, never a FIFO, on local file systems) no larger than its
    declared arrays can be, laid out as a save writes it (:func:`_pack_directory`: the end record at the very
    end, the central directory right before it and no larger than its arrays' entries take, no member
    overlapping another). Every entry must be a member its arrays can have: a group ``zarr.json``, an
    array's ``zarr.json``, or a chunk key inside that array's grid; none twice. For each array read: its
    ``zarr.json`` (within :data:`MAX_PACKED_JSON_BYTES`) and every chunk of its grid are present, stored
    uncompressed, each chunk no larger than its uncompressed encoding, and, since tensorstore's ``zip`` driver
    takes a member's compression method and sizes from its *local* header, every local header of these
    members says the same as the central directory (stored, same sizes, same name, no data descriptor, no
    encryption). Nothing is inflated: no ZIP bomb. Only then does tensorstore read a member.

    ``directories``, when given, receives each checked pack's directory (``pack key -> [PackMember]``), so a
    reader of the members needs no second parse.

    Returns:
        ``pack key -> size`` of the packs checked.

    Raises:
        InconsistentCheckpointError: a pack or a member of an array read is missing.
        CorruptCheckpointError: a link, a FIFO, an oversized pack, a pack that is not a ZIP archive as a save
            writes it, a member no array of the pack has, or a compressed, duplicated or oversized member.
    """
    from .format.metadata import chunk_key_separator
    from .planning.packing import by_pack, group_keys

    if not names:
        return {}
    separator = chunk_key_separator(meta.format_version)
    members_of = by_pack({n: t.pack for n, t in meta.tensors.items() if t.pack is not None})
    base = root.rstrip("/")
    out: dict[str, int | None] = {}
    for key, reading in by_pack({n: meta.tensors[n].pack for n in names}).items():
        every = members_of[key]
        limits = {n: _packed_chunk_bytes(meta.tensors[n]) for n in every}
        grids = {n: _chunk_grid(meta.tensors[n]) for n in every}
        groups = group_keys(every)
        # the directory's size from the metadata alone (members counted, never enumerated)
        max_directory = sum(_CD_ENTRY_BYTES + len(g.encode()) for g in groups) + sum(
            (1 + math.prod(g)) * (_CD_ENTRY_BYTES + len(n.encode()) + 1 + max(9, _longest_chunk_key(g)))
            for n, g in grids.items()
        )
        check_members = functools.partial(
            _check_pack_members,
            meta,
            reading=reading,
            every=every,
            grids=grids,
            limits=limits,
            groups=set(groups),
            separator=separator,
            where=f"{base}/{key}",
        )
        try:
            entries, size = _pack_directory(
                storage,
                base,
                key,
                _pack_bound(meta, every, limits),
                max_directory_bytes=max_directory,
                check_members=check_members,
            )
        except CorruptCheckpointError as e:  # name the tensors the pack was read for
            if str(e).startswith("tensor '"):
                raise
            named = ", ".join(repr(n) for n in reading[:3])
            more = f" (and {len(reading) - 3} more)" if len(reading) > 3 else ""
            raise type(e)(f"tensor{'s' if len(reading) > 1 else ''} {named}{more}: {e}") from None
        out[key] = size
        if directories is not None:
            directories[key] = entries
    return out


def chunks_wanted(t: Any, boxes: list[Any] | None) -> np.ndarray:
    """Flat (row-major) indices of the chunks of the array ``t`` that meet any region of ``boxes`` (every
    chunk when None), sorted."""
    grid = _chunk_grid(t)
    if boxes is None:
        return np.arange(math.prod(grid), dtype=np.int64)
    hit: set[int] = set()
    for b in boxes:
        if not math.prod(b.lengths):
            continue
        ranges = [range(o // c, -(-(o + n) // c)) for o, n, c in zip(b.offsets, b.lengths, t.chunk_shape)]
        for idx in itertools.product(*ranges):
            hit.add(int(np.ravel_multi_index(idx, grid)) if grid else 0)
    return np.asarray(sorted(hit), dtype=np.int64)


def _rank_members(meta: Any) -> dict[int, tuple[list[str], dict[str, int]]]:
    """Format 6: what each rank's packs hold: ``rank -> (arrays whose zarr.json it holds, array -> number of
    its chunks)`` over every packed array of ``meta``."""
    out: dict[int, tuple[list[str], dict[str, int]]] = {}
    for name, t in meta.tensors.items():
        creator = t.pack_rank
        if creator is None:
            continue
        out.setdefault(creator, ([], {}))[0].append(name)
        if t.writers:
            ranks, counts = np.unique(np.asarray(t.writers, dtype=np.int64), return_counts=True)
            for r, n in zip(ranks.tolist(), counts.tolist()):
                out.setdefault(r, ([], {}))[1][name] = n
    return out


def check_rank_packs(
    storage: Any,
    root: str,
    meta: Any,
    names: Collection[str],
    regions: Mapping[str, list[Any] | None] | None = None,
    directories: dict[str, list[Any]] | None = None,
) -> dict[str, int | None]:
    """The packs holding what is read of the format-6 packed arrays ``names`` are sound
    (:mod:`arraycheckpoint.planning.packing`: chunk ``i`` of an array is in a pack of ``writers[i]``, its
    ``zarr.json`` in a pack of its creator).

    For every rank whose packs hold a member read (the chunks meeting ``regions[name]``, every chunk when
    absent, and the ``zarr.json``), its packs ``<rank>.0.zip``, ``<rank>.1.zip``, ... are read until the first
    that does not exist, each with the checks of :func:`check_packs`: a regular file (no link, no FIFO), no
    larger than what that rank's packed members can take, a ZIP archive as a save writes it, every entry a
    member that rank holds (an array's ``zarr.json`` it created, a chunk key inside the grid of an array whose
    chunk it wrote; none twice across its packs), stored uncompressed, bounded, and, for each member read,
    a local header that agrees with the central directory. Every member read must be present.

    ``directories``, when given, receives each checked pack's directory.

    Returns:
        ``pack key -> size`` of the packs checked.

    Raises:
        InconsistentCheckpointError: a member read is in no pack of its rank.
        CorruptCheckpointError: what :func:`check_packs` refuses, for the packs of a format-6 checkpoint.
    """
    from .format.metadata import chunk_key_separator
    from .planning.packing import MEMBER_OVERHEAD, TRAILER_BYTES, pack_key

    if not names:
        return {}
    separator = chunk_key_separator(meta.format_version)
    base = root.rstrip("/")
    needed: dict[int, dict[str, tuple[str, int]]] = {}  # rank -> member read -> (array, chunk or -1)
    writers_of = {
        n: np.asarray(t.writers, dtype=np.int64) for n, t in meta.tensors.items() if t.pack_rank is not None
    }
    for name in names:
        t = meta.tensors[name]
        needed.setdefault(t.pack_rank, {})[f"{name}/zarr.json"] = (name, -1)
        grid = _chunk_grid(t)
        writers = writers_of[name]
        for flat in chunks_wanted(t, None if regions is None else regions.get(name)).tolist():
            idx = np.unravel_index(flat, grid) if grid else ()
            key = f"{name}/" + separator.join(["c", *(str(int(i)) for i in idx)])
            needed.setdefault(int(writers[flat]), {})[key] = (name, flat)
    holds = _rank_members(meta)
    out: dict[str, int | None] = {}
    for rank in sorted(needed):
        docs, chunks = holds.get(rank, ([], {}))
        limits = {n: _packed_chunk_bytes(meta.tensors[n]) for n in set(docs) | set(chunks)}
        grids = {n: _chunk_grid(meta.tensors[n]) for n in limits}
        entries_bound = sum(_CD_ENTRY_BYTES + len(n.encode()) + 10 for n in docs) + sum(
            k * (_CD_ENTRY_BYTES + len(n.encode()) + 1 + max(9, _longest_chunk_key(grids[n])))
            for n, k in chunks.items()
        )
        members = len(docs) + sum(chunks.values())
        bound = min(
            TRAILER_BYTES * (members + 1)
            + sum(MAX_PACKED_JSON_BYTES + MEMBER_OVERHEAD + 2 * (len(n.encode()) + 10) for n in docs)
            + sum(
                k * (limits[n] + MEMBER_OVERHEAD + 2 * (len(n.encode()) + 1 + _longest_chunk_key(grids[n])))
                for n, k in chunks.items()
            ),
            MAX_OBJECT_BYTES * 4,
        )
        seen: set[str] = set()
        reading = set(needed[rank])
        check = functools.partial(
            _check_rank_pack_members,
            meta,
            rank=rank,
            docs=set(docs),
            grids=grids,
            limits=limits,
            reading=reading,
            seen=seen,
            separator=separator,
        )
        # the packs the metadata says hold what is read (packing.PackFill) first; every pack of the rank, in
        # order up to the first absent one, only when a member read is not there
        where_of = _predicted_packs(meta, rank, needed[rank], writers_of)
        probe = [(k, False) for k in sorted(set(where_of.values()))] + [(k, True) for k in range(members + 1)]
        opened: set[int] = set()
        for k, probing in probe:
            if k in opened:
                continue
            if probing and not reading - seen:
                break
            opened.add(k)
            key = pack_key(rank, k)
            try:
                entries, size = _pack_directory(
                    storage,
                    base,
                    key,
                    bound,
                    max_directory_bytes=entries_bound,
                    check_members=functools.partial(check, where=f"{base}/{key}"),
                    missing_ok=True,
                )
            except CorruptCheckpointError as e:  # name the tensors the pack was read for
                if str(e).startswith("tensor '"):
                    raise
                # the members this pack was opened for (all not found yet when probing past the predicted ones)
                concerned = reading - seen if probing else {m for m, at in where_of.items() if at == k}
                raise _naming(type(e), concerned or reading, str(e)) from None
            if size is None and not entries:
                if probing:
                    break
                continue  # reported below as missing members
            if k == members:
                raise CorruptCheckpointError(
                    f"{base}/{key} exists, but rank {rank}'s {members} packed member(s) fill at most "
                    f"{members} pack(s); the checkpoint is damaged or hostile"
                )
            out[key] = size
            if directories is not None:
                directories[key] = entries
        missing = sorted(reading - seen)
        if missing:
            at = where_of.get(missing[0])
            expected = f", expected in {base}/{pack_key(rank, at)}" if at is not None else ""
            more = f" (and {len(missing) - 1} more members)" if len(missing) > 1 else ""
            err = _naming(
                InconsistentCheckpointError,
                missing,
                f"{missing[0]} is missing: in none of rank {rank}'s packs ({base}/.acp/packs/{rank}.<k>.zip"
                f"{expected}){more}; the checkpoint is damaged (a pack lost or cut short)",
            )
            for member in reversed(missing):  # each array's own first missing member
                err.tensors[member.rpartition("/")[0]] = (  # type: ignore[attr-defined]
                    f"{member} is missing: in none of rank {rank}'s packs ({base}/.acp/packs/{rank}.<k>.zip); "
                    "the checkpoint is damaged (a pack lost or cut short)"
                )
            raise err
    return out


def _predicted_packs(
    meta: Any, rank: int, reading: Mapping[str, tuple[str, int]], writers_of: Mapping[str, np.ndarray]
) -> dict[str, int]:
    """Format 6: the index of the pack of ``rank`` holding each member of ``reading`` (``member -> (array,
    chunk or -1 for its zarr.json)``), as a save fills its packs (:class:`arraycheckpoint.planning.packing.PackFill`);
    empty when the metadata records no fill target."""
    from .planning.packing import DOC_BYTES, PackFill, packs_target

    names = sorted(writers_of)
    targets = {packs_target(meta.tensors[n].pack) for n in names}
    if len(targets) != 1 or 0 in targets:
        return {}
    fill = PackFill(targets.pop())
    by_array: dict[str, list[tuple[str, int]]] = {}
    for member, (name, flat) in reading.items():
        by_array.setdefault(name, []).append((member, flat))
    out: dict[str, int] = {}
    for name in names:  # by array name: its document (where this rank created it), then its chunks
        mine = writers_of[name] == rank
        count = int(np.count_nonzero(mine))
        size = _packed_chunk_bytes(meta.tensors[name])
        created = meta.tensors[name].pack_rank == rank
        if created and not count:  # the document alone
            for member, _flat in by_array.get(name, []):
                out[member] = fill.where(0, DOC_BYTES)
            fill.add(1, DOC_BYTES)
            continue
        if not count:
            continue
        first = (
            size + DOC_BYTES if created else size
        )  # the document counted with (and kept by) the first chunk
        for member, flat in by_array.get(name, []):
            j = 0 if flat < 0 else int(np.count_nonzero(mine[:flat]))
            out[member] = fill.where(0, first) if j == 0 else _after_first(fill, first, j - 1, size)
        fill.add(1, first)
        fill.add(count - 1, size)
    return out


def _after_first(fill: Any, first: int, j: int, size: int) -> int:
    """The pack of the ``j``-th member of a run of ``size`` bytes that follows one member of ``first``."""
    from .planning.packing import PackFill

    probe = PackFill(fill.target)
    probe.index, probe.held = fill.index, fill.held
    probe.add(1, first)
    return probe.where(j, size)


#: an error type :func:`_naming` builds
E = TypeVar("E", bound=Exception)


def _naming(kind: type[E], members: Collection[str], detail: str) -> E:
    """An error of ``kind`` about the arrays of the pack members ``members``: its message names them
    (:func:`_tensors_named`); its ``tensors`` attribute maps every one of them to what is wrong (``detail``),
    so a tool reports each array without checking them one by one (``arraycheckpoint verify``)."""
    err = kind(f"{_tensors_named(members)}: {detail}")
    err.tensors = dict.fromkeys(sorted({m.rpartition("/")[0] for m in members}), detail)  # type: ignore[attr-defined]
    return err


def _tensors_named(members: Collection[str]) -> str:
    """``tensor 'a'`` / ``tensors 'a', 'b', 'c' (and 4 more)``: the arrays of the pack members ``members``."""
    names = sorted({m.rpartition("/")[0] for m in members})
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return f"tensor{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names[:3])}{more}"


def _check_rank_pack_members(
    meta: Any,
    entries: list[PackMember],
    rank: int,
    docs: Collection[str],
    grids: Mapping[str, tuple[int, ...]],
    limits: Mapping[str, int],
    reading: Collection[str],
    seen: set[str],
    separator: str,
    where: str,
) -> list[PackMember]:
    """Check the directory ``entries`` of one of ``rank``'s packs (``where``) against the metadata (see
    :func:`check_rank_packs`); ``seen`` collects the member names over all of that rank's packs. Returns the
    entries read, whose local headers the caller checks next."""
    checked: list[PackMember] = []
    for e in entries:
        if e.filename in seen:
            raise CorruptCheckpointError(
                f"{where} holds the member {e.filename!r} a second time (in this or another of rank {rank}'s "
                "packs); the pack is damaged or hostile"
            )
        seen.add(e.filename)
        array, _, leaf = e.filename.rpartition("/")
        if leaf == "zarr.json" and array in docs:
            limit = MAX_PACKED_JSON_BYTES
        else:
            owner = _chunk_owner(e.filename, grids, grids, separator)
            flat = _chunk_flat(e.filename, owner, grids, separator) if owner is not None else None
            if owner is None or flat is None or meta.tensors[owner].writers[flat] != rank:
                near = next((n for n in grids if e.filename.startswith(n + "/")), None)
                about = f"tensor {near!r}: " if near is not None else ""
                raise CorruptCheckpointError(
                    f"{about}{where} holds the member {e.filename!r}, which none of its arrays has (rank {rank} "
                    "wrote no such chunk: outside the grid, of another writer, or a foreign file); the pack is "
                    "damaged or hostile"
                )
            limit = limits[owner]
        _check_member(e, e.filename.rpartition("/")[0], where, limit)
        if e.filename in reading:
            checked.append(e)
    return checked


def _chunk_flat(
    filename: str, array: str, grids: Mapping[str, tuple[int, ...]], separator: str
) -> int | None:
    """The flat (row-major) index of the chunk key ``filename`` of ``array`` (checked by :func:`_chunk_owner`)."""
    grid = grids[array]
    rest = filename[len(array) + 2 :]
    parts = [int(p) for p in rest.split(separator)[1:]] if rest else []
    return int(np.ravel_multi_index(parts, grid)) if grid else 0


def _check_pack_members(
    meta: Any,
    entries: list[PackMember],
    reading: Collection[str],
    every: Collection[str],
    grids: Mapping[str, tuple[int, ...]],
    limits: Mapping[str, int],
    groups: Collection[str],
    separator: str,
    where: str,
) -> list[PackMember]:
    """Check the directory ``entries`` of the pack ``where`` holding the arrays ``every`` against the
    metadata (see :func:`check_packs`); return the entries of the arrays ``reading``, whose local headers the
    caller checks next."""
    members = set(every)
    reading = set(reading)
    seen: set[str] = set()
    docs: dict[str, PackMember] = {}
    chunks: dict[str, list[PackMember]] = {}
    for e in entries:
        if e.filename in seen:
            raise CorruptCheckpointError(
                f"{where} names the member {e.filename!r} twice; the pack is damaged"
            )
        seen.add(e.filename)
        if e.filename in groups:
            continue
        array, _, leaf = e.filename.rpartition("/")
        if array in members and leaf == "zarr.json":
            docs[array] = e
            continue
        owner = _chunk_owner(e.filename, members, grids, separator)
        if owner is not None:
            chunks.setdefault(owner, []).append(e)
            continue
        near = next((n for n in members if e.filename.startswith(n + "/")), None)
        about = f"tensor {near!r}: " if near is not None else ""
        raise CorruptCheckpointError(
            f"{about}{where} holds the member {e.filename!r}, which none of its arrays has (a chunk outside "
            "the grid, or a foreign file); the pack is damaged or hostile"
        )
    checked: list[PackMember] = []
    for name in sorted(reading):
        t = meta.tensors[name]
        doc = docs.get(name)
        if doc is None:
            raise InconsistentCheckpointError(
                f"tensor {name!r}: its pack {where} holds no {name}/zarr.json; the checkpoint is damaged"
            )
        found = chunks.get(name, [])
        expected = math.prod(grids[name])
        if len(found) != expected:  # unique and inside the grid: as many as the grid has means all of them
            raise InconsistentCheckpointError(
                f"tensor {name!r}: the metadata declares {expected} chunk(s) of {list(t.chunk_shape)}, but "
                f"its pack {where} holds {len(found)}; the metadata does not describe this checkpoint"
            )
        for e, limit in [(doc, MAX_PACKED_JSON_BYTES)] + [(c, limits[name]) for c in found]:
            _check_member(e, name, where, limit)
            checked.append(e)
    return checked


def _chunk_owner(
    filename: str, members: Collection[str], grids: Mapping[str, tuple[int, ...]], separator: str
) -> str | None:
    """The array of ``members`` whose grid has the chunk key ``filename`` (canonical decimal indices, one per
    dimension, each inside the grid), or None."""
    m = _CHUNK_KEYS[separator].match(filename)
    if m is None or m.group(1) not in members:
        return None
    array = m.group(1)
    rest = filename[len(array) + 2 :]  # after "<array>/c"
    parts = rest.split(separator)[1:] if rest else []
    grid = grids[array]
    if len(parts) != len(grid):
        return None
    for p, g in zip(parts, grid):
        if p != str(int(p)) or int(p) >= g:
            return None
    return array


def _chunk_grid(t: Any) -> tuple[int, ...]:
    """Chunks per dimension of the array ``t`` (``()`` for a 0-d array: one chunk)."""
    return tuple(-(-s // c) for s, c in zip(t.shape, t.chunk_shape))


def _longest_chunk_key(grid: tuple[int, ...]) -> int:
    """Length of the longest chunk key of ``grid`` (``c`` and one separator and index per dimension)."""
    return 1 + sum(1 + len(str(max(g - 1, 0))) for g in grid)


def _packed_chunk_bytes(t: Any) -> int:
    """Size of one chunk member of the packed array ``t``: packs hold uncompressed arrays of whole chunks
    (the metadata parser refuses anything else), so a chunk file is its data, a crc32c per inner chunk and
    the shard index (16 bytes per inner chunk and its crc32c), and never more."""
    from .codecs import numpy_dtype

    inner = math.prod(c // i for c, i in zip(t.chunk_shape, t.inner_chunk_shape))
    return math.prod(t.chunk_shape) * numpy_dtype(t.dtype).itemsize + inner * 20 + 4


def _pack_bound(meta: Any, every: Collection[str], limits: Mapping[str, int]) -> int:
    """Upper bound of the size of the pack holding exactly the arrays ``every`` (``limits``: each one's
    largest chunk file): every member's bytes (a ``zarr.json`` within :data:`MAX_PACKED_JSON_BYTES`), its
    local and central records and its name twice, and the end records."""
    from .planning.packing import MEMBER_OVERHEAD, TRAILER_BYTES, group_keys

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
    then checked (:func:`_check_local_headers`).
    Local files are read with ``pread``; object stores with ranged reads (the last
    :data:`_PACK_TAIL_BYTES` first, which usually hold the directory, then one small read per local header),
    so a pack is never downloaded whole to be checked.

    Raises:
        InconsistentCheckpointError: the pack is missing (with ``missing_ok``: ``([], None)`` is returned).
        CorruptCheckpointError: a link, a non-regular or oversized pack, a pack that is no ZIP archive as a
            save writes it, or what ``check_members`` and the local headers refuse.
    """
    from .planning.packing import PACK_DIR

    path = f"{base}/{key}"
    if getattr(storage, "commit_strategy", "") == "rename":
        from .checks.files import open_regular

        opened = open_regular(base, key)  # no link on the way, never a FIFO (O_NONBLOCK), a regular file
        if opened is None:
            if missing_ok:
                return [], None
            raise InconsistentCheckpointError(f"the pack {path} is missing; the checkpoint is damaged")
        fd, size = opened
        try:
            _check_pack_size(path, size, bound)
            reader = _PackReader(path, lambda ranges: [os.pread(fd, n, o) for o, n in ranges], size)
            last = min(size, _PACK_TAIL_BYTES)
            (tail,) = reader.read_many([(size - last, last)])
            return _read_pack(path, tail, size, bound, reader, max_directory_bytes, check_members)
        finally:
            os.close(fd)
    kv = _kvstore(storage, f"{base}/{PACK_DIR}")
    leaf = key[len(PACK_DIR) + 1 :]
    want = min(bound + 1, _PACK_TAIL_BYTES)
    size: int | None = None
    try:
        result = kv.read(leaf, byte_range=slice(-want, None)).result()
    except ValueError as e:  # OUT_OF_RANGE: the object is shorter than the suffix asked for: read it whole
        if "OUT_OF_RANGE" not in str(e):
            raise
        result = kv.read(leaf).result()
        if result.state == "value":
            size = len(result.value)
    if result.state != "value":
        if missing_ok:
            return [], None
        raise InconsistentCheckpointError(f"the pack {path} is missing; the checkpoint is damaged")
    tail = bytes(result.value)
    if size is not None:
        _check_pack_size(path, size, bound)
    elif want == bound + 1:  # the object holds at least bound + 1 bytes
        _check_pack_size(path, bound + 1, bound)

    def read_remote(ranges: list[tuple[int, int]]) -> list[bytes]:
        futures = [kv.read(leaf, byte_range=slice(o, o + n) if n is not None else None) for o, n in ranges]
        out = []
        for f in futures:
            try:
                r = f.result()
            except ValueError as e:  # OUT_OF_RANGE: shorter than its end records say
                if "OUT_OF_RANGE" not in str(e):
                    raise
                raise CorruptCheckpointError(f"{path} is shorter than its end records say") from None
            if r.state != "value":
                raise InconsistentCheckpointError(f"the pack {path} vanished while it was checked")
            out.append(bytes(r.value))
        return out

    reader = _PackReader(path, read_remote, size, tail, whole_when_cheaper=True)
    return _read_pack(path, tail, size, bound, reader, max_directory_bytes, check_members)


class _PackReader:
    """Reads of byte ranges of one pack (``read(ranges)``: ``pread`` on a local file, concurrent ranged reads
    on an object store), serving what the first read of its end (``tail``) holds from memory. With
    ``whole_when_cheaper``, a batch of more ranges than the pack's size in first reads (``n x``
    :data:`_PACK_TAIL_BYTES` >= size: many members read from a small pack) fetches the pack once instead."""

    def __init__(
        self,
        path: str,
        read: Callable[[list[tuple[int, int | None]]], list[bytes]],
        size: int | None,
        tail: bytes = b"",
        whole_when_cheaper: bool = False,
    ) -> None:
        self.path, self._read, self.size, self._tail = path, read, size, tail
        self._whole: bytes | None = None
        self._cheaper = whole_when_cheaper

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        if self.size is None:
            return self._read(list(ranges))
        cheaper = self._cheaper and len(ranges) * _PACK_TAIL_BYTES >= self.size > len(self._tail)
        if cheaper and self._whole is None:
            (self._whole,) = self._read([(0, None)])
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
) -> tuple[list[PackMember], int]:
    """:func:`_pack_directory` once the pack's last bytes ``tail`` (and its ``size`` where known) are read."""
    entries, size, cd_offset = _parse_zip_directory(
        path, tail, size, bound, reader.read_many, max_directory_bytes
    )
    reader.size = size
    if check_members is not None:
        _check_local_headers(path, check_members(entries), entries, cd_offset, reader.read_many)
    return entries, size


def _check_pack_size(path: str, size: int, bound: int) -> None:
    if size > bound:
        raise CorruptCheckpointError(
            f"{path} is larger than its arrays can be stored in ({bound} bytes at most); the checkpoint is "
            "damaged or hostile"
        )


@dataclasses.dataclass(frozen=True)
class PackMember:
    """One entry of a pack's ZIP central directory (the attribute names of :class:`zipfile.ZipInfo`)."""

    filename: str
    compress_type: int
    compress_size: int
    file_size: int
    header_offset: int
    flag_bits: int
    raw_name: bytes


#: Bytes of a pack's end read first: the end records and the directory of a pack of a few thousand members.
_PACK_TAIL_BYTES = 256 << 10
#: A directory entry's bytes besides its name: the 46-byte record and at most a zip64 extra field (28 bytes);
#: a save writes no entry comment.
_CD_ENTRY_BYTES = 46 + 32
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record (22 bytes)
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator (20 bytes)
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record, no extensible data (56)
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header (30 bytes)
_U32 = 0xFFFFFFFF
_EOCD_SIG, _LOCATOR_SIG, _ZIP64_EOCD_SIG = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_CENTRAL_SIG, _LOCAL_SIG = b"PK\x01\x02", b"PK\x03\x04"
#: General-purpose flag bits a member may have: only bit 11 (UTF-8 name). Refused: encryption (bits 0, 6,
#: 13) and a data descriptor (bit 3: the sizes follow the data, and a reader would take them from there).
_ALLOWED_FLAGS = 0x0800
#: Info-ZIP Unicode Path extra field: a second name for a member, which tensorstore checks and uses and
#: Python's zipfile (before 3.12) ignores; refused in every pack, so that every reader sees one name.
UNICODE_PATH_TAG = 0x7075


def _parse_zip_directory(
    path: str,
    tail: bytes,
    size: int | None,
    bound: int,
    read_many: Callable[[list[tuple[int, int]]], list[bytes]],
    max_directory_bytes: int | None,
) -> tuple[list[PackMember], int, int]:
    """The central directory of the ZIP archive whose last bytes are ``tail``: ``(entries, archive size,
    directory offset)``.

    Only the layout :mod:`zipfile` writes for a save is accepted, strictly enough that every reader finds the
    same directory: the end record is the archive's last 22 bytes (no comment, and the last end signature in
    the file, which is the record tensorstore looks for), a zip64 locator and record (if any) sit right before
    it, the directory ends where they start (nothing prepended: Python's :mod:`zipfile` would shift every
    offset by what was, tensorstore would not), the record's entry count is the number of entries the
    directory holds and they fill it exactly, every name is ASCII (or flagged UTF-8) without NUL (Python cuts
    a name at NUL, tensorstore does not), and no member's header and data overlap the next one's. Sizes and
    offsets in zip64 extra fields are read as tensorstore reads them.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path} is not a ZIP archive as a save writes it: {why}; the checkpoint is damaged or hostile"
        )

    if len(tail) < _EOCD.size:
        raise bad(f"{len(tail)} bytes are too few for an end-of-central-directory record")
    at = len(tail) - _EOCD.size
    sig, disk, cd_disk, n_disk, n, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    if sig != _EOCD_SIG or tail.rfind(_EOCD_SIG) != at:
        raise bad("no end-of-central-directory record as its last 22 bytes")
    if comment or disk or cd_disk or n_disk != n:
        raise bad("a comment, several disks or inconsistent entry counts in its end record")
    trailer = _EOCD.size
    loc_at = at - _ZIP64_LOCATOR.size
    if loc_at >= 0 and tail[loc_at : loc_at + 4] == _LOCATOR_SIG:
        _sig, z_disk, z_offset, disks = _ZIP64_LOCATOR.unpack_from(tail, loc_at)
        rec_at = loc_at - _ZIP64_EOCD.size
        if rec_at < 0 or z_disk or disks > 1:
            raise bad("a zip64 locator without its record, or several disks")
        sig, rec_size, _made, _need, disk, cd_disk, n_disk, n, cd_size, cd_offset = _ZIP64_EOCD.unpack_from(
            tail, rec_at
        )
        if sig != _ZIP64_EOCD_SIG or rec_size != _ZIP64_EOCD.size - 12 or disk or cd_disk or n_disk != n:
            raise bad("a zip64 end record that is not the plain one right before its locator")
        trailer += _ZIP64_LOCATOR.size + _ZIP64_EOCD.size
        if z_offset != cd_offset + cd_size:
            raise bad("its zip64 locator and record are not right after its central directory")
    elif n == 0xFFFF or cd_size == _U32 or cd_offset == _U32:
        raise bad("zip64 values in its end record but no zip64 record")
    archive = cd_offset + cd_size + trailer
    if size is None:
        if archive > bound:
            raise CorruptCheckpointError(
                f"{path} declares {archive} bytes, more than its arrays can be stored in ({bound} bytes at "
                "most); the checkpoint is damaged or hostile"
            )
        if archive < len(tail):
            raise bad("its directory does not end where its end records begin")
        size = archive
    elif archive != size:
        raise bad("its directory does not end where its end records begin (data before or after the archive)")
    if max_directory_bytes is not None and cd_size > max_directory_bytes:
        raise bad(f"a directory of {cd_size} bytes, more than its arrays' take ({max_directory_bytes})")
    if cd_size < n * _CENTRAL.size:
        raise bad(f"{n} entries cannot fit in a central directory of {cd_size} bytes")
    start = size - len(tail)
    if cd_offset >= start:
        directory = tail[cd_offset - start : cd_offset - start + cd_size]
    else:
        (directory,) = read_many([(cd_offset, cd_size)])
    if len(directory) != cd_size:
        raise bad("its central directory is cut short")
    entries: list[PackMember] = []
    pos = 0
    for _ in range(n):
        if pos + _CENTRAL.size > cd_size:
            raise bad("its central directory is cut short")
        (
            sig,
            _made,
            _need,
            flags,
            method,
            _time,
            _date,
            _crc,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            disk,
            _internal,
            _external,
            offset,
        ) = _CENTRAL.unpack_from(directory, pos)
        pos += _CENTRAL.size
        end = pos + name_len + extra_len + comment_len
        if sig != _CENTRAL_SIG or end > cd_size:
            raise bad("a damaged central directory entry")
        raw = bytes(directory[pos : pos + name_len])
        usize, csize, offset = _zip64_fields(
            bytes(directory[pos + name_len : pos + name_len + extra_len]), usize, csize, offset, bad
        )
        pos = end
        if flags & ~_ALLOWED_FLAGS or disk:
            raise bad(f"member {raw!r} is encrypted, has a data descriptor or another disk ({flags:#x})")
        entries.append(PackMember(_member_name(raw, flags, bad), method, csize, usize, offset, flags, raw))
    if pos != cd_size:
        raise bad(f"its central directory holds {cd_size - pos} bytes after its {n} entries")
    ordered = sorted(entries, key=lambda e: e.header_offset)
    for e, after in zip(ordered, ordered[1:] + [None]):
        limit = after.header_offset if after is not None else cd_offset
        if e.header_offset + _LOCAL.size + len(e.raw_name) + e.compress_size > limit:
            raise bad(f"member {e.filename!r} overlaps the next one or the central directory")
    return entries, size, cd_offset


def _member_name(raw: bytes, flags: int, bad: Callable[[str], Exception]) -> str:
    """A member's name from its stored bytes: UTF-8 when flagged so, else ASCII; never with a NUL."""
    if b"\0" in raw:
        raise bad(f"the member name {raw!r} holds a NUL byte")
    try:
        return raw.decode("utf-8" if flags & 0x0800 else "ascii")
    except UnicodeDecodeError:
        raise bad(f"the member name {raw!r} is neither ASCII nor flagged UTF-8") from None


def _zip64_fields(
    extra: bytes, usize: int, csize: int, offset: int | None, bad: Callable[[str], Exception]
) -> tuple[int, int, int | None]:
    """Sizes (and header offset) of an entry after its extra field, read as tensorstore reads them: a zip64
    field (at most one) supplies, in this order, each 32-bit value that is 0xFFFFFFFF. The extra fields must
    tile the extra data exactly, and every 0xFFFFFFFF value must be supplied."""
    pos, seen = 0, False
    values = [usize, csize] + ([] if offset is None else [offset])
    while pos < len(extra):
        if pos + 4 > len(extra):
            raise bad("a damaged extra field")
        tag, length = struct.unpack_from("<HH", extra, pos)
        pos += 4
        if pos + length > len(extra):
            raise bad("a damaged extra field")
        if tag == UNICODE_PATH_TAG:
            raise bad(
                "a Unicode Path extra field (0x7075), which some readers (tensorstore) take as the member's "
                "name and others (Python's zipfile) ignore; a save writes none"
            )
        if tag == 1:
            if seen:
                raise bad("two zip64 extra fields in one header")
            seen = True
            body, used = extra[pos : pos + length], 0
            for i, v in enumerate(values):
                if v == _U32:
                    if used + 8 > len(body):
                        raise bad("a zip64 extra field without the value its header defers to it")
                    (values[i],) = struct.unpack_from("<Q", body, used)
                    used += 8
        pos += length
    if not seen and _U32 in values:
        raise bad("a size or offset deferred to a zip64 extra field that is not there")
    return values[0], values[1], (values[2] if offset is not None else None)


def _check_local_headers(
    path: str,
    members: list[PackMember],
    entries: list[PackMember],
    cd_offset: int,
    read_many: Callable[[list[tuple[int, int]]], list[bytes]],
) -> None:
    """Every local header of ``members`` says what the central directory says.

    tensorstore's ``zip`` driver finds a member through the central directory but decodes it as its *local*
    header says (method, sizes): a member stored in the directory but deflated in its local header would be
    inflated. Each header must be there, stored, with the directory's sizes and name, no data descriptor, no
    encryption, and its data must end before the next member's header (tensorstore reads only up to there).
    """

    if not members:
        return
    offsets = sorted({e.header_offset for e in entries} | {cd_offset})
    following = {o: offsets[i + 1] for i, o in enumerate(offsets[:-1])}
    ranges = []
    for e in members:
        room = following[e.header_offset] - e.header_offset - _LOCAL.size - len(e.raw_name) - e.compress_size
        ranges.append((e.header_offset, _LOCAL.size + len(e.raw_name) + min(room, 64)))
    heads = read_many(ranges)
    for e, head in zip(members, heads):
        what = f"the local header of member {e.filename!r}"
        array = e.filename.rpartition("/")[0]  # the members checked are an array's zarr.json and chunks

        def bad(why: str, array: str = array) -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"tensor {array!r}: {path}: {why}; the pack is damaged or hostile (nothing was inflated)"
            )

        if len(head) < _LOCAL.size:
            raise bad(f"{what} is cut short")
        sig, _need, flags, method, _time, _date, _crc, csize, usize, name_len, extra_len = _LOCAL.unpack_from(
            head
        )
        if sig != _LOCAL_SIG:
            raise bad(f"{what} is missing (no local header signature at offset {e.header_offset})")
        if flags & ~_ALLOWED_FLAGS:
            raise bad(f"{what} declares encryption or a data descriptor (flags {flags:#x})")
        if method != 0:
            raise bad(
                f"{what} declares compression method {method} where the central directory says stored (0)"
            )
        end = _LOCAL.size + name_len + extra_len
        if end > len(head):
            room = following[e.header_offset] - e.header_offset - e.compress_size
            if end > room:
                raise bad(f"{what} runs into the next member")
            (head,) = read_many([(e.header_offset, end)])
            if len(head) < end:
                raise bad(f"{what} is cut short")
        if bytes(head[_LOCAL.size : _LOCAL.size + name_len]) != e.raw_name:
            raise bad(f"{what} names another member")
        extra = bytes(head[_LOCAL.size + name_len : end])
        usize, csize, _ = _zip64_fields(extra, usize, csize, None, lambda w, what=what: bad(f"{what}: {w}"))
        if csize != e.file_size or usize != e.file_size:
            raise bad(
                f"{what} declares {csize} stored and {usize} decoded bytes, the central directory "
                f"{e.file_size}"
            )
        if e.header_offset + end + e.file_size > following[e.header_offset]:
            raise bad(f"the data of member {e.filename!r} runs into the next member")


def _pack_kvstore(storage: Any, base: str, key: str) -> Any:
    import tensorstore as ts

    from .runtime.tscontext import context

    spec = {"driver": "zip", "base": storage.object_kvstore_spec(base, key)}
    return ts.KvStore.open(spec, context=context()).result()


def _kvstore(storage: Any, root: str) -> Any:
    import tensorstore as ts

    from .runtime.tscontext import context

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
    from .planning.regions import Box, intersect

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
