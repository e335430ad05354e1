"""zarr-python v3 data types for the ``ml_dtypes`` floats tensorstore's zarr3 driver stores natively.

tensorstore writes ``bfloat16`` and the ``float8_*`` family under these exact zarr v3 ``data_type`` names;
zarr-python 3.1 does not know them. The classes below teach zarr-python the same names so that arrays cross
between the two libraries in both directions, bit for bit.

Format facts these classes encode:

* ``bfloat16`` is a multi-byte type, so it mixes in zarr's :class:`HasEndianness`; zarr-python then writes a
  ``bytes`` codec with ``endian: little`` (tensorstore refuses a multi-byte type without it).
* The 1-byte float8 types deliberately do *not* mix it in, like zarr's own ``int8``/``uint8``: zarr-python
  then drops ``endian`` from the ``bytes`` codec, which matches what tensorstore writes for 1-byte types
  (tensorstore accepts ``endian`` there but normalises it away), and zarr-python accepts a ``bytes`` codec
  with or without ``endian`` for them.
* Fill values use the zarr v3 float encoding: a JSON number, ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, or
  a ``"0x..."`` hex string of exactly ``2 * item_size`` digits holding the raw bits (the only way to keep a
  non-canonical NaN payload, and what tensorstore writes for one). zarr's generic float helper reads a
  4-digit hex string as IEEE float16, which would be wrong for bfloat16, so the parsing here is per type.
* Big-endian storage is not supported for bfloat16: ``ml_dtypes`` has no working byte-swapped dtype.

This module imports zarr; :mod:`arraycheckpoint.codecs` imports it only on demand.

Registration: the classes are declared under the ``zarr.data_type`` entry-point group in ``pyproject.toml``
and importing this module registers them (:func:`register_zarr_dtypes`). zarr-python 3.1.x collects that
entry-point group at ``import zarr`` but never loads it on its own (``DataTypeRegistry._lazy_load`` has no
caller there, and metadata is parsed before any other plugin registry is touched), so a process that
imports only zarr must run ``zarr.core.dtype.data_type_registry._lazy_load()`` once; that loads this module
through the installed entry points, without the caller importing arraycheckpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, TypeGuard, overload

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import (
    DataTypeValidationError,
    DTypeConfig_V2,
    DTypeJSON,
    HasEndianness,
    HasItemSize,
)
from zarr.core.dtype.wrapper import TBaseDType, ZDType

if TYPE_CHECKING:
    from zarr.core.common import JSON, ZarrFormat

__all__ = [
    "ML_DTYPE_CLASSES",
    "BFloat16",
    "Float8E3M4",
    "Float8E4M3B11FNUZ",
    "Float8E4M3FN",
    "Float8E4M3FNUZ",
    "Float8E5M2",
    "Float8E5M2FNUZ",
    "Float8E8M0FNU",
    "register_zarr_dtypes",
]

_SPECIAL_FLOATS: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_UINT_FOR_SIZE: dict[int, type[np.unsignedinteger[Any]]] = {1: np.uint8, 2: np.uint16}


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType[TBaseDType, np.generic], HasItemSize):
    """Shared implementation of a zarr v3 data type backed by an ``ml_dtypes`` scalar type."""

    _ml_type: ClassVar[type[np.generic]]
    _zarr_v3_name: ClassVar[str]

    # -- native dtype ------------------------------------------------------------------------------------
    @classmethod
    def _native(cls) -> np.dtype[Any]:
        return np.dtype(cls._ml_type)

    @classmethod
    def _check_native_dtype(cls, dtype: TBaseDType) -> TypeGuard[TBaseDType]:
        return type(dtype) is type(cls._native()) and dtype.type is cls._ml_type

    @classmethod
    def from_native_dtype(cls, dtype: TBaseDType) -> Self:
        """Wrap the numpy dtype of the matching ``ml_dtypes`` type (little-endian or native order only)."""
        if not cls._check_native_dtype(dtype):
            raise DataTypeValidationError(
                f"Invalid data type: {dtype}. Expected the ml_dtypes dtype {cls._native()}."
            )
        if dtype.byteorder == ">":
            raise ValueError(
                f"big-endian {cls._zarr_v3_name} is not supported (ml_dtypes cannot byte-swap it)"
            )
        return cls()

    def to_native_dtype(self) -> np.dtype[Any]:
        """The ``ml_dtypes`` numpy dtype (native byte order)."""
        return self._native()

    # -- dtype JSON ---------------------------------------------------------------------------------------
    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        raise DataTypeValidationError(f"{cls._zarr_v3_name} has no zarr v2 representation (got {data!r})")

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Self:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(
            f"Invalid JSON representation of {cls.__name__}. Got {data!r}, expected {cls._zarr_v3_name!r}."
        )

    @overload
    def to_json(self, zarr_format: Literal[2]) -> DTypeConfig_V2[str, None]: ...

    @overload
    def to_json(self, zarr_format: Literal[3]) -> str: ...

    def to_json(self, zarr_format: ZarrFormat) -> DTypeConfig_V2[str, None] | str:
        """The zarr v3 ``data_type`` name; zarr v2 is not supported."""
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"{self._zarr_v3_name} is only defined for zarr_format 3, got {zarr_format}")

    # -- scalars ------------------------------------------------------------------------------------------
    @property
    def item_size(self) -> int:
        """Bytes per element."""
        return self._native().itemsize

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, self._ml_type | bool | int | float | np.integer | np.floating | np.bool_):
            return True
        if isinstance(data, str):
            try:
                self._from_str(data)
            except (ValueError, OverflowError):
                return False
            return True
        return isinstance(data, np.generic) and data.dtype.kind in "biuf"

    def _from_str(self, data: str) -> np.generic:
        if data in _SPECIAL_FLOATS:
            return self._ml_type(_SPECIAL_FLOATS[data])
        if data.startswith("0x"):
            digits = data[2:]
            if len(digits) != 2 * self.item_size:
                raise ValueError(
                    f"hex fill value {data!r} for {self._zarr_v3_name} needs {2 * self.item_size} hex digits"
                )
            bits = np.array(int(digits, 16), dtype=_UINT_FOR_SIZE[self.item_size])
            return bits.view(self._native())[()]
        return self._ml_type(float(data))

    def cast_scalar(self, data: object) -> np.generic:
        """Cast a Python/numpy number or a float string to this type's scalar; exact for own scalars."""
        if isinstance(data, self._ml_type):
            return data
        if not self._check_scalar(data):
            raise TypeError(
                f"Cannot convert object {data!r} with type {type(data)} to a scalar compatible with the "
                f"data type {self}."
            )
        if isinstance(data, str):
            return self._from_str(data)
        if isinstance(data, np.generic):
            return np.asarray(data).astype(self._native())[()]
        return self._ml_type(float(data))  # type: ignore[arg-type]

    def default_scalar(self) -> np.generic:
        """Zero as this type (``float8_e8m0fnu`` has no zero; ml_dtypes turns 0 into its NaN, 0xff)."""
        return self._ml_type(0.0)

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> np.generic:
        """Read a zarr v3 float fill value: number, ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` or raw-bit hex."""
        if zarr_format != 3:
            raise ValueError(f"{self._zarr_v3_name} is only defined for zarr_format 3, got {zarr_format}")
        if isinstance(data, bool) or not isinstance(data, int | float | str):
            raise TypeError(
                f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected a float encoding"
            )
        if isinstance(data, str):
            return self._from_str(data)
        return self._ml_type(float(data))

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        """Encode a value as a zarr v3 float: a number, a special string, or hex bits for a NaN payload."""
        if zarr_format != 3:
            raise ValueError(f"{self._zarr_v3_name} is only defined for zarr_format 3, got {zarr_format}")
        value = self.cast_scalar(data)
        as_float = float(value)  # type: ignore[arg-type]
        if math.isnan(as_float):
            uint = _UINT_FOR_SIZE[self.item_size]
            bits = int(np.asarray(value).view(uint))
            canonical = int(np.asarray(self._ml_type(math.nan)).view(uint))
            return "NaN" if bits == canonical else f"0x{bits:0{2 * self.item_size}x}"
        if math.isinf(as_float):
            return "Infinity" if as_float > 0 else "-Infinity"
        return as_float


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """zarr v3 ``bfloat16`` (tensorstore's name), numpy dtype ``ml_dtypes.bfloat16``."""

    _ml_type = ml_dtypes.bfloat16
    _zarr_v3_name = "bfloat16"

    def to_native_dtype(self) -> np.dtype[Any]:
        """The ``ml_dtypes`` dtype; a big-endian configuration cannot be represented and raises."""
        if self.endianness != "little":
            raise ValueError("big-endian bfloat16 is not supported (ml_dtypes cannot byte-swap it)")
        return self._native()


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """zarr v3 ``float8_e4m3fn``, numpy dtype ``ml_dtypes.float8_e4m3fn``."""

    _ml_type = ml_dtypes.float8_e4m3fn
    _zarr_v3_name = "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """zarr v3 ``float8_e5m2``, numpy dtype ``ml_dtypes.float8_e5m2``."""

    _ml_type = ml_dtypes.float8_e5m2
    _zarr_v3_name = "float8_e5m2"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FNUZ(_MLFloat):
    """zarr v3 ``float8_e4m3fnuz``, numpy dtype ``ml_dtypes.float8_e4m3fnuz``."""

    _ml_type = ml_dtypes.float8_e4m3fnuz
    _zarr_v3_name = "float8_e4m3fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2FNUZ(_MLFloat):
    """zarr v3 ``float8_e5m2fnuz``, numpy dtype ``ml_dtypes.float8_e5m2fnuz``."""

    _ml_type = ml_dtypes.float8_e5m2fnuz
    _zarr_v3_name = "float8_e5m2fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3B11FNUZ(_MLFloat):
    """zarr v3 ``float8_e4m3b11fnuz``, numpy dtype ``ml_dtypes.float8_e4m3b11fnuz``."""

    _ml_type = ml_dtypes.float8_e4m3b11fnuz
    _zarr_v3_name = "float8_e4m3b11fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E3M4(_MLFloat):
    """zarr v3 ``float8_e3m4``, numpy dtype ``ml_dtypes.float8_e3m4``."""

    _ml_type = ml_dtypes.float8_e3m4
    _zarr_v3_name = "float8_e3m4"


@dataclass(frozen=True, kw_only=True)
class Float8E8M0FNU(_MLFloat):
    """zarr v3 ``float8_e8m0fnu`` (exponent only, no zero), numpy dtype ``ml_dtypes.float8_e8m0fnu``.

    Data crosses bit-exactly, but tensorstore 0.1.86 reads JSON fill values for this type differently from
    ml_dtypes (``1.0`` -> 2**-64, ``0.0`` -> bits 0x00 where ml_dtypes gives NaN); the presets therefore
    do not offer it for checkpoints.
    """

    _ml_type = ml_dtypes.float8_e8m0fnu
    _zarr_v3_name = "float8_e8m0fnu"


ML_DTYPE_CLASSES: tuple[type[_MLFloat], ...] = (
    BFloat16,
    Float8E4M3FN,
    Float8E5M2,
    Float8E4M3FNUZ,
    Float8E5M2FNUZ,
    Float8E4M3B11FNUZ,
    Float8E3M4,
    Float8E8M0FNU,
)


def register_zarr_dtypes() -> None:
    """Register every class in :data:`ML_DTYPE_CLASSES` with zarr-python's data-type registry (idempotent)."""
    for cls in ML_DTYPE_CLASSES:
        data_type_registry.register(cls._zarr_v3_name, cls)  # type: ignore[arg-type]


register_zarr_dtypes()
