"""Zarr v3 dtype extensions (bfloat16, float8_*) and the codec presets every stored array uses.

Importing this package is cheap (numpy only). The zarr-python data-type classes live in
:mod:`arraycheckpoint.codecs.dtypes`, which imports zarr; they are reachable here lazily
(``arraycheckpoint.codecs.BFloat16``, ``arraycheckpoint.codecs.register_zarr_dtypes()``).

Layer ``codecs``: just above ``arraycheckpoint.errors``, the only module it may import.
"""

from __future__ import annotations

from typing import Any

from arraycheckpoint.codecs.presets import (
    CODEC_PRESET,
    ML_DTYPE_NAMES,
    SUPPORTED_DTYPES,
    UnsupportedDTypeError,
    array_metadata,
    dimension_names_for,
    numpy_dtype,
    zarr_dtype_name,
)

__all__ = [
    "CODEC_PRESET",
    "ML_DTYPE_NAMES",
    "SUPPORTED_DTYPES",
    "UnsupportedDTypeError",
    "array_metadata",
    "dimension_names_for",
    "numpy_dtype",
    "register_zarr_dtypes",
    "zarr_dtype_name",
]

_LAZY_FROM_DTYPES = frozenset(
    {
        "BFloat16",
        "Float8E3M4",
        "Float8E4M3B11FNUZ",
        "Float8E4M3FN",
        "Float8E4M3FNUZ",
        "Float8E5M2",
        "Float8E5M2FNUZ",
        "Float8E8M0FNU",
        "ML_DTYPE_CLASSES",
        "register_zarr_dtypes",
    }
)


def __getattr__(name: str) -> Any:
    if name in _LAZY_FROM_DTYPES:
        from arraycheckpoint.codecs import dtypes

        return getattr(dtypes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
