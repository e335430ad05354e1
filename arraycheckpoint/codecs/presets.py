"""Zarr v3 array metadata presets shared by tensorstore (writer/reader) and zarr-python (reader).

Every tensor is one zarr v3 array whose outer chunk is one stored file: a ``sharding_indexed`` codec with
inner chunks ``bytes`` (+ optional ``zstd``), and a shard index ``bytes`` + ``crc32c`` at the end of the
file. Only core zarr v3 codecs that both tensorstore and zarr-python implement are used.

Format facts encoded here (checked against tensorstore 0.1.86 and zarr-python 3.1.6):

* ``bytes`` carries ``endian: little`` for multi-byte types. For 1-byte types (bool, int8, uint8, float8_*)
  it carries no configuration: that is what both libraries write for them (tensorstore accepts ``endian``
  there but drops it; zarr-python drops it too), so the metadata here equals what either one stores.
* ``fill_value`` must match the type's JSON kind in tensorstore: ``false`` for bool (``0`` is refused),
  ``[0.0, 0.0]`` for complex (a bare ``0`` is refused), ``0`` for integers, ``0.0`` for floats.
* Chunk dimensions must be >= 1 in both libraries, also for a zero-length array dimension; a 0-d array has
  ``chunk_shape: []``.
* ``float8_e8m0fnu`` is deliberately not supported: it has no zero, and tensorstore 0.1.86 converts JSON
  fill values for it differently from ml_dtypes (1.0 -> 2**-64, 0.0 -> bits 0x00 where ml_dtypes gives NaN).

This module imports only numpy and :mod:`arraycheckpoint.errors` (ml_dtypes on demand), never zarr,
tensorstore, torch or jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from arraycheckpoint.errors import UnsupportedDTypeError as _ProjectUnsupportedDTypeError

__all__ = [
    "ML_DTYPE_NAMES",
    "SUPPORTED_DTYPES",
    "UnsupportedDTypeError",
    "array_metadata",
    "dimension_names_for",
    "numpy_dtype",
    "zarr_dtype_name",
]

#: Types numpy knows natively, under their zarr v3 (= numpy) names.
_NUMPY_NAMES: tuple[str, ...] = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)

#: Types that come from ml_dtypes, under tensorstore's zarr3 names (= the ml_dtypes / numpy ``dtype.name``).
ML_DTYPE_NAMES: tuple[str, ...] = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
)

#: Every zarr v3 ``data_type`` name :func:`array_metadata` accepts.
SUPPORTED_DTYPES: tuple[str, ...] = _NUMPY_NAMES + ML_DTYPE_NAMES

_SUPPORTED = frozenset(SUPPORTED_DTYPES)
#: The ``compression=`` names a save accepts (besides None), lower case.
COMPRESSIONS = ("zstd",)
_COMPRESSIONS = COMPRESSIONS


class UnsupportedDTypeError(_ProjectUnsupportedDTypeError, ValueError):
    """A dtype with no zarr v3 representation both tensorstore and zarr-python read.

    It is an :class:`arraycheckpoint.UnsupportedDTypeError` (so also a ``TypeError``) and a ``ValueError``.
    """


def zarr_dtype_name(dtype: Any) -> str:
    """Return the zarr v3 ``data_type`` name for a numpy dtype (or anything ``numpy.dtype()`` accepts).

    The name ignores byte order (arrays are always stored little-endian). bfloat16 and float8 types are the
    ml_dtypes numpy types and map to tensorstore's names ("bfloat16", "float8_e4m3fn", ...).

    Raises:
        UnsupportedDTypeError: (a ``ValueError``) naming the dtype, if it is not in :data:`SUPPORTED_DTYPES`.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise UnsupportedDTypeError(f"unsupported dtype {dtype!r}: not a numpy dtype ({e})") from None
    name = dt.name
    if name not in _SUPPORTED or dt.fields is not None or dt.subdtype is not None:
        raise UnsupportedDTypeError(
            f"unsupported dtype {dt!r} ({name}); supported: {', '.join(SUPPORTED_DTYPES)}"
        )
    return name


def numpy_dtype(name: str) -> np.dtype[Any]:
    """Return the numpy dtype for a zarr v3 ``data_type`` name (ml_dtypes types for bfloat16 / float8_*).

    Raises:
        UnsupportedDTypeError: (a ``ValueError``) naming ``name``, if it is not in :data:`SUPPORTED_DTYPES`.
    """
    if not isinstance(name, str) or name not in _SUPPORTED:
        raise UnsupportedDTypeError(
            f"unsupported zarr data_type {name!r}; supported: {', '.join(SUPPORTED_DTYPES)}"
        )
    if name in ML_DTYPE_NAMES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _fill_value(dt: np.dtype[Any]) -> bool | int | float | list[float]:
    """The zero fill value in the JSON form tensorstore and zarr-python both accept for ``dt``."""
    if dt.kind == "b":
        return False
    if dt.kind in "iu":
        return 0
    if dt.kind == "c":
        return [0.0, 0.0]
    return 0.0


def _bytes_codec(dt: np.dtype[Any]) -> dict[str, Any]:
    if dt.itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


def _check_shape(label: str, value: Sequence[int], allow_zero: bool) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f"{label} must be a sequence of ints, got {value!r}") from None
    if any(int(v) != v for v in value):
        raise ValueError(f"{label} must be a sequence of ints, got {value!r}")
    low = 0 if allow_zero else 1
    if any(v < low for v in out):
        raise ValueError(f"{label} entries must be >= {low}, got {out}")
    return out


def dimension_names_for(name: str, ndim: int) -> list[str]:
    """Dimension names of the array stored as entry ``name``: ``<last component>.dim<axis>``.

    xarray refuses zarr v3 arrays without ``dimension_names`` and treats equal names in one group as one
    dimension (of one size), so the names are unique per array: the entry's last component (unique within
    its group) and the axis. ``model/layers.0.w`` (2-D) -> ``["layers.0.w.dim0", "layers.0.w.dim1"]``.
    """
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return [f"{base}.dim{axis}" for axis in range(ndim)]


#: Version of the codec pipeline :func:`array_metadata` builds. Checkpoints record it; a reader whose preset
#: matches can open arrays from the checkpoint metadata alone, others read each array's ``zarr.json``.
#: 1: sharding_indexed, bytes little-endian, optional zstd, crc32c per inner chunk, crc32c index.
CODEC_PRESET = 1


def array_metadata(
    shape: tuple[int, ...],
    dtype: Any,
    chunk_shape: tuple[int, ...],
    inner_chunk_shape: tuple[int, ...] | None = None,
    compression: str | None = None,
    compression_level: int = 3,
    *,
    dimension_names: Sequence[str | None] | None = None,
    name: str | None = None,
    separator: str = ".",
) -> dict[str, Any]:
    """Return zarr v3 array metadata (a JSON-able dict) for tensorstore's zarr3 ``"metadata"`` member.

    One outer chunk (``chunk_shape``) is one stored file: a ``sharding_indexed`` codec whose inner chunks
    are ``inner_chunk_shape`` (default: ``chunk_shape``, i.e. one inner chunk per shard), encoded with
    ``bytes`` (little-endian), then ``zstd`` at ``compression_level`` if ``compression == "zstd"``, then
    ``crc32c`` (every inner chunk is checksummed); the shard index is ``bytes`` + ``crc32c`` at the end of
    the file. The fill value is zero (``false`` for bool).

    A chunk dimension of 0 is accepted only where the array dimension is 0 and is stored as 1 (both
    libraries require chunk dimensions >= 1). A 0-d array (``shape == ()``) uses ``chunk_shape == ()``.

    Args:
        shape: global array shape.
        dtype: numpy dtype (anything ``numpy.dtype()`` accepts); see :data:`SUPPORTED_DTYPES`.
        chunk_shape: outer chunk (= shard = file) shape, same rank as ``shape``.
        inner_chunk_shape: inner chunk shape; every dimension must divide ``chunk_shape``'s.
        compression: ``None`` (or ``"none"``) or ``"zstd"``.
        compression_level: zstd level.
        dimension_names: optional names, one per dimension.
        name: the entry name of the array (``model/layers.0.w``); when given without ``dimension_names``,
            the names are :func:`dimension_names_for` it (what every array of a new checkpoint carries).
        separator: the chunk key separator (``"."``: ``c.0.1``, what format 3 writes; ``"/"``: ``c/0/1``,
            formats 1 and 2; see :func:`arraycheckpoint.format.metadata.chunk_key_separator`).

    Raises:
        UnsupportedDTypeError: for an unsupported dtype.
        ValueError: for inconsistent shapes, an inner chunk shape that does not divide the chunk shape, an
            unknown compression, or a bad compression level.
    """
    if separator not in ("/", "."):
        raise ValueError(f"separator must be '/' or '.', got {separator!r}")
    dt = np.dtype(dtype) if not isinstance(dtype, np.dtype) else dtype
    if dimension_names is None and name is not None:
        dimension_names = dimension_names_for(name, len(tuple(shape)))
    dtype_name = zarr_dtype_name(dt)
    shape_t = _check_shape("shape", shape, allow_zero=True)
    chunk_t = _check_shape("chunk_shape", chunk_shape, allow_zero=True)
    if len(chunk_t) != len(shape_t):
        raise ValueError(f"chunk_shape {chunk_t} must have the rank of shape {shape_t}")
    for s, c in zip(shape_t, chunk_t):
        if c == 0 and s != 0:
            raise ValueError(f"chunk_shape {chunk_t} has a 0 where shape {shape_t} does not")
    chunk_t = tuple(max(c, 1) for c in chunk_t)
    if inner_chunk_shape is None:
        inner_t = chunk_t
    else:
        inner_t = _check_shape("inner_chunk_shape", inner_chunk_shape, allow_zero=True)
        if len(inner_t) != len(chunk_t):
            raise ValueError(f"inner_chunk_shape {inner_t} must have the rank of chunk_shape {chunk_t}")
        inner_t = tuple(max(i, 1) for i in inner_t)
        if any(c % i for c, i in zip(chunk_t, inner_t)):
            raise ValueError(f"inner_chunk_shape {inner_t} does not divide chunk_shape {chunk_t}")

    if compression is not None and compression.lower() == "none":
        compression = None
    inner_codecs: list[dict[str, Any]] = [_bytes_codec(dt)]
    if compression is not None:
        if compression.lower() not in _COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; use None or one of {_COMPRESSIONS}")
        if isinstance(compression_level, bool) or not isinstance(compression_level, int | np.integer):
            raise ValueError(f"compression_level must be an int, got {compression_level!r}")
        if not -131072 <= int(compression_level) <= 22:
            raise ValueError(f"zstd compression_level must be in [-131072, 22], got {compression_level}")
        inner_codecs.append(
            {"name": "zstd", "configuration": {"level": int(compression_level), "checksum": False}}
        )
    # The index crc32c only protects the offsets; this one makes a flipped data byte fail its read.
    inner_codecs.append({"name": "crc32c"})

    metadata: dict[str, Any] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape_t),
        "data_type": dtype_name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_t)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": _fill_value(dt),
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner_t),
                    "codecs": inner_codecs,
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ],
    }
    if dimension_names is not None:
        names = list(dimension_names)
        if len(names) != len(shape_t) or not all(n is None or isinstance(n, str) for n in names):
            raise ValueError(f"dimension_names {names!r} must be one str or None per dimension of {shape_t}")
        metadata["dimension_names"] = names
    return metadata
