"""Hugging Face safetensors directories as a load source: ``acp.load("path/to/hf_model", state)``.

A directory holds ``model.safetensors`` or ``model.safetensors.index.json`` (``weight_map``: key -> file)
and the files it names. A safetensors file is an 8-byte little-endian header length ``N``, a JSON header of
``N`` bytes (``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the
data, each tensor C-order at ``8 + N + begin``. Every rank reads the headers (small) and then only the byte
ranges of its own regions (:mod:`arraycheckpoint.sources.ranges`).

Entry names: key ``k`` is the tensor ``model/k``, so ``acp.load(hf_dir, {"model": model})`` matches the
module's ``state_dict()`` names; ``key_map`` renames as for native checkpoints. The header is untrusted:
its size is bounded, every field is checked, and a tensor's byte count must equal its shape times its dtype.
"""

from __future__ import annotations

import math
import os
import posixpath
import struct
from collections.abc import Mapping
from typing import Any

from ..checks.bounds import load_json_bounded
from ..checks.files import open_regular, pread_exact, read_below
from ..codecs import numpy_dtype
from ..errors import InconsistentCheckpointError, MetadataError
from ..format.metadata import (
    MAX_ELEMENTS,
    MAX_NDIM,
    SAFETENSORS_FRAMEWORK,
    CheckpointMetadata,
    ObjectMeta,
    ShardMeta,
    TensorMeta,
    check_name,
)
from ..planning.items import LoadTensor
from ..runtime.monitoring import PhaseRecorder
from ..storage.reads import read_bounded
from . import LoadSource, _has, local_dir
from .hubcache import locate
from .ranges import RangeReader, StoredTensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
NAMESPACE = "model"
FRAMEWORK = SAFETENSORS_FRAMEWORK  # the ``framework`` of a safetensors directory's metadata
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
MAX_INDEX_BYTES = 256 << 20
CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 16 << 20
#: Hugging Face output-embedding name and the input-embedding names it is tied to (``tie_word_embeddings``)
OUTPUT_EMBEDDING = "lm_head.weight"
INPUT_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")

#: safetensors dtype -> zarr v3 data_type name
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _read_bounded(storage: Any, root: str, key: str, limit: int) -> bytes:
    local = local_dir(storage, root)
    raw = (
        read_below(*locate(local, key), limit)
        if local is not None
        else read_bounded(storage, root, key, limit)
    )
    if raw is None:
        raise MetadataError(f"{root}: {key} is missing")
    if len(raw) > limit:
        raise MetadataError(f"{root}: {key} is {len(raw)} bytes, more than the {limit} a valid one holds")
    return raw


def _json(raw: bytes, limit: int, what: str) -> Any:
    """A JSON document of the directory (its index, a file's header), parsed with the bounds of the native
    metadata (:func:`arraycheckpoint.checks.bounds.load_json_bounded`: size, nesting, containers); a document that
    fails them is damage: :class:`InconsistentCheckpointError` (a ``MetadataError`` and a
    ``CorruptCheckpointError``)."""
    try:
        return load_json_bounded(raw, max_bytes=limit, what=what)
    except MetadataError as e:
        raise InconsistentCheckpointError(str(e)) from None


def _header(kv: Any, root: str, key: str, local: str | None) -> tuple[int, dict[str, Any], int | None]:
    """(data start, header dict, file size where known) of one safetensors file.

    A local file is opened once (:func:`arraycheckpoint.checks.files.open_regular`: no link, no FIFO) and read
    with ``pread``; other storage with two byte-range reads. The header length is checked against the
    file's size before the header is read.
    """
    where = f"{root}/{key}"
    if local is not None:
        opened = open_regular(*locate(local, key))  # a hub cache snapshot's link: its blob
        if opened is None:
            raise MetadataError(f"{where} is missing")
        fd, size = opened
        try:
            if size < 8:
                raise InconsistentCheckpointError(
                    f"{where} is {size} bytes, shorter than a safetensors header; the file is truncated"
                )
            (n,) = struct.unpack("<Q", pread_exact(fd, 0, 8, where))
            _check_header_length(where, n, size)
            body = pread_exact(fd, 8, n, where)
        finally:
            os.close(fd)
    else:
        size = None
        head = _kv_read(kv, key, 0, 8)
        if head is None or len(head) != 8:
            raise MetadataError(f"{where} is missing or shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        _check_header_length(where, n, None)
        body = _kv_read(kv, key, 8, 8 + n)
        if body is None or len(body) != n:
            raise InconsistentCheckpointError(f"{where} is truncated inside its header")
    doc = _json(body, MAX_HEADER_BYTES, f"{where} (its header)")
    if not isinstance(doc, dict):
        raise MetadataError(f"{where} has a header that is not a JSON object")
    return 8 + n, doc, size


def _check_header_length(where: str, n: int, size: int | None) -> None:
    if n > MAX_HEADER_BYTES:
        raise MetadataError(f"{where} claims a {n}-byte header (limit {MAX_HEADER_BYTES}); not safetensors")
    if size is not None and 8 + n > size:
        raise InconsistentCheckpointError(
            f"{where} claims a {n}-byte header, but the file holds {size} bytes; the file is truncated or not "
            "safetensors"
        )


def _kv_read(kv: Any, key: str, begin: int, end: int) -> bytes | None:
    """Bytes ``[begin, end)`` of ``key`` (fewer at the end of the value), None when it is absent."""
    try:
        result = kv.read(key, byte_range=slice(begin, end)).result()
    except ValueError as e:  # tensorstore: OUT_OF_RANGE for a range starting past the end of the value
        if "OUT_OF_RANGE" not in str(e):
            raise
        return b""
    return bytes(result.value) if result.state == "value" else None


def _tensor(root: str, key: str, base: int, name: str, entry: Any, size: int | None = None) -> StoredTensor:
    where = f"{root}/{key}: tensor {name!r}"
    if not isinstance(entry, Mapping):
        raise MetadataError(f"{where}: header entry is not an object")
    st_dtype = entry.get("dtype")
    if st_dtype not in DTYPES:
        raise MetadataError(f"{where}: dtype {st_dtype!r} is not supported (supported: {sorted(DTYPES)})")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_ELEMENTS for s in shape)
        or math.prod(shape) > MAX_ELEMENTS
    ):
        raise MetadataError(f"{where}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
    ):
        raise MetadataError(f"{where}: bad data_offsets {offsets!r}")
    dtype = numpy_dtype(DTYPES[st_dtype])
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise MetadataError(
            f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but shape {shape} of "
            f"{st_dtype} needs {math.prod(shape) * dtype.itemsize}"
        )
    if size is not None and base + offsets[1] > size:
        raise InconsistentCheckpointError(
            f"{where}: data_offsets {offsets} end at byte {base + offsets[1]} of a {size}-byte file; the file is "
            "truncated"
        )
    return StoredTensor(name, key, base + offsets[0], tuple(shape), dtype)


def _check_layout(where: str, stored: Mapping[str, StoredTensor], base: int, size: int | None) -> None:
    """The data of a safetensors file as its format requires (and the ``safetensors`` library checks): the
    tensors' byte ranges tile the data from its first byte, without overlap or gap, to the end of the file
    (where its size is known). Two tensors sharing bytes, or bytes no tensor owns, are damage."""
    end = base
    for key, t in sorted(stored.items(), key=lambda kv: (kv[1].begin, kv[1].nbytes)):
        if t.begin != end:
            what = (
                "overlaps the tensor before it"
                if t.begin < end
                else f"leaves bytes [{end}, {t.begin}) unused"
            )
            raise InconsistentCheckpointError(
                f"{where}: tensor {key!r} at bytes [{t.begin}, {t.begin + t.nbytes}) {what}; a safetensors "
                "file's tensors tile its data without overlap or gap (the file is damaged or not safetensors)"
            )
        end += t.nbytes
    if size is not None and end != size:
        raise InconsistentCheckpointError(
            f"{where}: its tensors end at byte {end} of a {size}-byte file; a safetensors file holds nothing after "
            "its last tensor (the file is damaged or not safetensors)"
        )


def _check_file_name(root: str, fname: Any) -> str:
    if (
        not isinstance(fname, str)
        or any(ord(c) < 32 or c == "\x7f" for c in fname)  # NUL and control characters
        or not fname.endswith(".safetensors")
        or "/" in fname
        or "\\" in fname
        or fname.startswith(".")
        or posixpath.basename(fname) != fname
    ):
        raise MetadataError(f"{root}/{INDEX_FILE}: weight_map names an unsafe file {fname!r}")
    return fname


class SafetensorsSource(LoadSource):
    """A Hugging Face safetensors directory (see the module docstring)."""

    kind = "safetensors"

    def __init__(
        self, storage: Any, root: str, tensors: dict[str, StoredTensor], aliases: dict[str, str] | None = None
    ) -> None:
        super().__init__(storage, root)
        self.tensors = tensors
        objects = {}
        if aliases:
            name = f"{NAMESPACE}/~aliases"
            objects[name] = ObjectMeta(name, "global", dict(aliases))
        self._meta = CheckpointMetadata(
            framework=FRAMEWORK,
            world_size=1,
            tensors={
                n: TensorMeta(
                    n,
                    t.shape,
                    _zarr_name(t),
                    tuple(max(s, 1) for s in t.shape),
                    tuple(max(s, 1) for s in t.shape),
                    None,
                    (ShardMeta((0,) * len(t.shape), t.shape, 0),),
                )
                for n, t in tensors.items()
            },
            objects=objects,
        )

    @classmethod
    def open(cls, storage: Any, root: str) -> SafetensorsSource:
        """Read the index (if any) and every file's header; raises :class:`MetadataError` on bad input."""
        import tensorstore as ts

        from ..runtime.tscontext import context

        if _has(storage, root, INDEX_FILE):
            raw = _read_bounded(storage, root, INDEX_FILE, MAX_INDEX_BYTES)
            index = _json(raw, MAX_INDEX_BYTES, f"{root}/{INDEX_FILE}")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise MetadataError(f"{root}/{INDEX_FILE} has no weight_map object")
            files = sorted({_check_file_name(root, f) for f in weight_map.values()})
        else:
            weight_map = None
            files = [SINGLE_FILE]
        local = local_dir(storage, root)
        kv = (
            None
            if local is not None
            else ts.KvStore.open(storage.kvstore_spec(root), context=context()).result()
        )
        tensors: dict[str, StoredTensor] = {}
        for fname in files:
            base, header, size = _header(kv, root, fname, local)
            stored = {
                key: _tensor(root, fname, base, check_name(f"{NAMESPACE}/{key}"), entry, size)
                for key, entry in header.items()
                if key != "__metadata__"
            }
            _check_layout(f"{root}/{fname}", stored, base, size)
            for key, t in stored.items():
                if weight_map is not None and weight_map.get(key) != fname:
                    continue  # the index decides which file holds a key
                if t.name in tensors:
                    raise MetadataError(f"{root}: tensor {key!r} appears in two files")
                tensors[t.name] = t
        if weight_map is not None:
            absent = sorted(k for k in weight_map if f"{NAMESPACE}/{k}" not in tensors)
            if absent:
                raise MetadataError(
                    f"{root}/{INDEX_FILE} lists tensors its files do not hold: {', '.join(absent[:10])}"
                )
        return cls(storage, root, tensors, _tied_aliases(storage, root, tensors))

    @property
    def metadata(self) -> CheckpointMetadata:
        return self._meta

    def read(self, targets: list[LoadTensor], max_inflight_bytes: int, recorder: PhaseRecorder) -> None:
        with recorder.phase("read") as rec:
            reader = RangeReader(self.storage, self.root, max_inflight_bytes)
            for t in targets:
                stored = self.tensors[t.name]
                for shard in t.shards:
                    reader.submit(stored, shard)
            reader.finish()
            rec["bytes"] = reader.fetched
            rec["wanted_bytes"] = reader.wanted


def _tied_aliases(storage: Any, root: str, tensors: Mapping[str, StoredTensor]) -> dict[str, str]:
    """The tied output embedding the directory stores once: ``{"lm_head.weight": "<...>embed_tokens.weight"}``
    when its ``config.json`` says ``tie_word_embeddings`` (transformers' default) and only the input embedding
    is stored; empty otherwise (no config, untied, or no single input embedding)."""
    if f"{NAMESPACE}/{OUTPUT_EMBEDDING}" in tensors or not _has(storage, root, CONFIG_FILE):
        return {}
    raw = _read_bounded(storage, root, CONFIG_FILE, MAX_CONFIG_BYTES)
    config = _json(raw, MAX_CONFIG_BYTES, f"{root}/{CONFIG_FILE}")  # bounded like the index and headers
    if not isinstance(config, dict) or config.get("tie_word_embeddings", True) is not True:
        return {}
    prefix = f"{NAMESPACE}/"
    found = [n[len(prefix) :] for n in tensors if n.endswith(INPUT_EMBEDDINGS)]
    return {OUTPUT_EMBEDDING: found[0]} if len(found) == 1 else {}


def _zarr_name(t: StoredTensor) -> str:
    from ..codecs import zarr_dtype_name

    return zarr_dtype_name(t.dtype)
