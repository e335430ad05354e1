"""Array documents: every ``zarr.json`` read is cross-checked against the checkpoint's metadata.

:func:`check_arrays` runs just before the arrays are opened: every ``zarr.json`` read in one concurrent batch
and cross-checked against the metadata (bounded parse; the exact bytes this release writes are accepted as
they are), crc32c required on every inner chunk and on the shard index (whatever the checkpoint says about
its codec preset), and the zstd frame headers of every chunk read checked before tensorstore inflates them.
It returns the validated array metadata, which the engine opens with ``assume_metadata``.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..checks.bounds import MAX_ARRAY_JSON_BYTES, load_json_bounded
from ..checks.zstd import _max_file_bytes, check_zstd_frame
from ..errors import (
    CorruptCheckpointError,
    MetadataError,
)
from .packdir import _kvstore, _pack_kvstore


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
    from ..codecs import CODEC_PRESET
    from ..format.metadata import chunk_key_separator

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


def check_packed_doc(tm: Any, raw: bytes, where: str, separator: str) -> bytes:
    """The ``zarr.json`` bytes ``raw`` of the packed array ``tm`` (read from ``where``) agree with the checkpoint
    metadata (:func:`check_arrays`' check, for the readers of format-6 packs); returns the document this
    release writes for ``tm``, which a reader is given in its place (as the load opens arrays with it).

    Raises:
        MetadataError: a malformed document, or one that disagrees with the metadata or lacks crc32c.
    """
    doc, exact = _generated(tm, separator)
    if raw != exact:
        _cross_check(
            tm, load_json_bounded(raw, max_bytes=MAX_ARRAY_JSON_BYTES, what=f"{where}/zarr.json"), doc, where
        )
    return exact


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
    from ..codecs import array_metadata, numpy_dtype

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
    if config.get("index_location", "end") != "end" or any(  # zarr-python reads what it says: other values
        not isinstance(c.get("configuration", {}), dict)
        or c.get("configuration", {}).get("endian", "little") != "little"
        for c in inner + index
    ):
        raise bad("is not little-endian with its shard index at the end, as the chunks were written")


def _check_zstd_chunks(kv: Any, tm: Any, where: str, boxes: list[Any] | None, separator: str) -> None:
    """Walk every zstd frame of every chunk file that ``boxes`` touch (all when None): one frame per inner
    chunk, decoding to its declared size."""
    from ..codecs import numpy_dtype
    from ..planning.regions import Box, intersect

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
