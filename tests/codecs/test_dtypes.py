"""dtype names, array metadata presets, zarr-python dtype classes, and tensorstore round trips."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from arraycheckpoint.codecs import (
    ML_DTYPE_NAMES,
    SUPPORTED_DTYPES,
    UnsupportedDTypeError,
    array_metadata,
    numpy_dtype,
    zarr_dtype_name,
)
from arraycheckpoint.testing import chunk_files

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bits of ``a`` as unsigned ints (complex128 as pairs of uint64)."""
    a = np.array(a, order="C", copy=True)  # keeps 0-d shape (ascontiguousarray makes it 1-d)
    if a.dtype.itemsize == 16:
        return a.reshape(a.shape + (1,)).view(np.uint64)
    return a.view(UINT[a.dtype.itemsize])


def random_values(dt: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bit patterns (NaN payloads, infinities, subnormals, -0.0 included) of dtype ``dt``."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    out = raw.view(dt).reshape(shape).copy()
    if dt.kind in "fcV" and n >= 4:  # make sure the interesting values are present
        flat = out.reshape(-1)
        flat[0] = -0.0
        flat[1] = np.nan
        flat[2] = 0.0
    return out


def ts_write_read(path: Path, metadata: dict[str, Any], data: np.ndarray) -> tuple[np.ndarray, Any]:
    """Create an array from ``metadata`` with tensorstore, write ``data``, re-open and read it back."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, "metadata": metadata}
    store = ts.open(spec, create=True).result()
    store.write(data).result()
    reopened = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
    return reopened.read().result(), reopened


# -- names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_name_round_trip(name: str) -> None:
    dt = numpy_dtype(name)
    assert isinstance(dt, np.dtype)
    assert zarr_dtype_name(dt) == name
    assert zarr_dtype_name(dt.type) == name


def test_ml_dtypes_names() -> None:
    assert numpy_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert numpy_dtype("float8_e4m3fn") == np.dtype(ml_dtypes.float8_e4m3fn)
    assert numpy_dtype("float8_e5m2") == np.dtype(ml_dtypes.float8_e5m2)
    assert zarr_dtype_name(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"
    assert zarr_dtype_name(ml_dtypes.float8_e4m3fn) == "float8_e4m3fn"
    assert set(ML_DTYPE_NAMES) <= set(SUPPORTED_DTYPES)
    for required in ("bool", "int8", "uint8", "float16", "float32", "float64", "complex64", "complex128"):
        assert required in SUPPORTED_DTYPES


def test_byte_order_is_not_part_of_the_name() -> None:
    assert zarr_dtype_name(np.dtype(">f4")) == "float32"
    assert zarr_dtype_name(np.dtype("<i8")) == "int64"


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype("U3"),
        np.dtype("S4"),
        np.dtype("V2"),
        np.dtype("M8[ns]"),
        np.dtype("O"),
        np.dtype([("a", "f4")]),
        np.dtype(("f4", (2,))),
        np.dtype(ml_dtypes.float8_e8m0fnu),
        np.dtype(ml_dtypes.int4),
        np.dtype(np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else np.dtype("U1"),
    ],
    ids=str,
)
def test_unsupported_dtype(dtype: np.dtype) -> None:
    import arraycheckpoint

    with pytest.raises(UnsupportedDTypeError) as info:
        zarr_dtype_name(dtype)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, arraycheckpoint.UnsupportedDTypeError)
    assert dtype.name in str(info.value)
    with pytest.raises(ValueError):
        array_metadata((2,), dtype, (2,))


def test_unsupported_name() -> None:
    with pytest.raises(UnsupportedDTypeError, match="float8_e8m0fnu"):
        numpy_dtype("float8_e8m0fnu")
    with pytest.raises(ValueError, match="float128"):
        numpy_dtype("float128")


# -- metadata ------------------------------------------------------------------------------------------


def test_metadata_layout() -> None:
    md = array_metadata((10, 6), np.float32, (4, 6), (2, 3), compression="zstd", compression_level=5)
    json.dumps(md, allow_nan=False)
    assert md["shape"] == [10, 6]
    assert md["data_type"] == "float32"
    assert md["chunk_grid"] == {"name": "regular", "configuration": {"chunk_shape": [4, 6]}}
    assert md["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}
    assert md["fill_value"] == 0.0
    (shard,) = md["codecs"]
    assert shard["name"] == "sharding_indexed"
    cfg = shard["configuration"]
    assert cfg["chunk_shape"] == [2, 3]
    assert cfg["codecs"] == [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "zstd", "configuration": {"level": 5, "checksum": False}},
        {"name": "crc32c"},
    ]
    assert cfg["index_codecs"] == [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "crc32c"},
    ]
    assert cfg["index_location"] == "end"
    assert "dimension_names" not in md


def test_metadata_defaults_and_dimension_names() -> None:
    md = array_metadata((3, 4), "int16", (3, 4), dimension_names=["row", None])
    assert md["codecs"][0]["configuration"]["chunk_shape"] == [3, 4]
    assert md["codecs"][0]["configuration"]["codecs"] == [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "crc32c"},
    ]
    assert md["dimension_names"] == ["row", None]
    with pytest.raises(ValueError, match="dimension_names"):
        array_metadata((3, 4), "int16", (3, 4), dimension_names=["row"])


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_metadata_fill_value_and_endian(name: str) -> None:
    dt = numpy_dtype(name)
    md = array_metadata((4,), dt, (4,))
    fill = md["fill_value"]
    if name == "bool":
        assert fill is False
    elif dt.kind in "iu":
        assert fill == 0 and type(fill) is int
    elif dt.kind == "c":
        assert fill == [0.0, 0.0]
    else:
        assert fill == 0.0 and type(fill) is float
    inner, checksum = md["codecs"][0]["configuration"]["codecs"]
    assert checksum == {"name": "crc32c"}
    if dt.itemsize == 1:
        assert inner == {"name": "bytes"}
    else:
        assert inner == {"name": "bytes", "configuration": {"endian": "little"}}


def test_metadata_edge_shapes() -> None:
    md0 = array_metadata((), np.float64, ())
    assert md0["shape"] == [] and md0["chunk_grid"]["configuration"]["chunk_shape"] == []
    assert md0["codecs"][0]["configuration"]["chunk_shape"] == []
    md_empty = array_metadata((0, 3), np.int32, (0, 3))
    assert md_empty["chunk_grid"]["configuration"]["chunk_shape"] == [1, 3]
    assert md_empty["codecs"][0]["configuration"]["chunk_shape"] == [1, 3]
    big_chunk = array_metadata((3,), np.int32, (8,), (4,))
    assert big_chunk["chunk_grid"]["configuration"]["chunk_shape"] == [8]


def test_metadata_validation() -> None:
    with pytest.raises(ValueError, match=r"\(3, 3\).*\(4, 4\)"):
        array_metadata((8, 8), np.float32, (4, 4), (3, 3))
    with pytest.raises(ValueError, match="rank"):
        array_metadata((8, 8), np.float32, (4,))
    with pytest.raises(ValueError, match="rank"):
        array_metadata((8, 8), np.float32, (4, 4), (2,))
    with pytest.raises(ValueError, match="chunk_shape"):
        array_metadata((8,), np.float32, (0,))
    with pytest.raises(ValueError, match=">= 0"):
        array_metadata((-1,), np.float32, (1,))
    with pytest.raises(ValueError, match="compression"):
        array_metadata((8,), np.float32, (8,), compression="gzip")
    with pytest.raises(ValueError, match="compression_level"):
        array_metadata((8,), np.float32, (8,), compression="zstd", compression_level=99)
    assert array_metadata((8,), np.float32, (8,), compression="none") == array_metadata(
        (8,), np.float32, (8,)
    )


# -- tensorstore round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_tensorstore_round_trip(tmp_path: Path, name: str, compression: str | None) -> None:
    dt = numpy_dtype(name)
    data = random_values(dt, (5, 7), seed=len(name))
    md = array_metadata((5, 7), dt, (4, 4), (2, 2), compression=compression)
    out, store = ts_write_read(tmp_path / "a", md, data)
    assert out.dtype == dt
    assert out.shape == data.shape
    np.testing.assert_array_equal(bits(out), bits(data))
    stored = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert stored["data_type"] == name
    # one file per outer chunk: ceil(5/4) * ceil(7/4) = 4
    assert len(chunk_files(tmp_path / "a")) == 4


@pytest.mark.parametrize(
    "name", ["float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
)
def test_nan_payloads_and_negative_zero(tmp_path: Path, name: str) -> None:
    dt = numpy_dtype(name)
    uint = UINT[dt.itemsize]
    nbits = dt.itemsize * 8
    sign = 1 << (nbits - 1)
    patterns = {sign}  # -0.0
    for v in (np.nan, -np.nan, np.inf, -np.inf):
        try:
            patterns.add(int(np.array(v, dtype=np.float64).astype(dt).view(uint)))
        except (OverflowError, ValueError):
            pass
    # every NaN bit pattern for 1- and 2-byte types, a sample of payloads for wider ones
    all_bits = np.arange(1 << nbits, dtype=np.uint64) if nbits <= 16 else None
    if all_bits is not None:
        vals = all_bits.astype(uint).view(dt)
        patterns.update(int(b) for b in all_bits[np.isnan(vals.astype(np.float32))][:4096])
    else:
        exp_all = ((1 << (nbits - 1)) - 1) & ~((1 << (23 if nbits == 32 else 52)) - 1)
        patterns.update(exp_all | p for p in (1, 2, 3, 0x1234, (1 << (22 if nbits == 32 else 51)) + 7))
        patterns.update((exp_all | sign) | p for p in (1, 5))
    data = np.array(sorted(patterns), dtype=np.uint64).astype(uint).view(dt)
    for compression in (None, "zstd"):
        md = array_metadata(data.shape, dt, (64,), (16,), compression=compression)
        out, _ = ts_write_read(tmp_path / str(compression), md, data)
        np.testing.assert_array_equal(bits(out), bits(data))


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_zero_dim_round_trip(tmp_path: Path, name: str) -> None:
    dt = numpy_dtype(name)
    data = random_values(dt, (), seed=3)
    out, _ = ts_write_read(tmp_path / "a", array_metadata((), dt, ()), data)
    assert out.shape == ()
    np.testing.assert_array_equal(bits(out), bits(data))


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("name", ["bool", "int8", "float32", "bfloat16", "float8_e5m2", "complex128"])
def test_empty_round_trip(tmp_path: Path, name: str, compression: str | None) -> None:
    dt = numpy_dtype(name)
    data = np.zeros((0, 3), dtype=dt)
    out, _ = ts_write_read(tmp_path / "a", array_metadata((0, 3), dt, (0, 3), compression=compression), data)
    assert out.shape == (0, 3) and out.dtype == dt


@pytest.mark.parametrize("name", SUPPORTED_DTYPES)
def test_unwritten_reads_fill_zero(tmp_path: Path, name: str) -> None:
    dt = numpy_dtype(name)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(tmp_path / "a")},
        "metadata": array_metadata((3, 2), dt, (2, 2)),
    }
    store = ts.open(spec, create=True).result()
    out = store.read().result()
    np.testing.assert_array_equal(bits(out), bits(np.zeros((3, 2), dtype=dt)))


# -- the zarr-python dtype classes (in process) --------------------------------------------------------


def test_zarr_dtype_classes_protocol() -> None:
    from zarr.core.dtype import parse_dtype
    from zarr.core.dtype.common import HasEndianness

    from arraycheckpoint.codecs import dtypes

    dtypes.register_zarr_dtypes()
    bf = parse_dtype(np.dtype(ml_dtypes.bfloat16), zarr_format=3)
    assert isinstance(bf, dtypes.BFloat16) and isinstance(bf, HasEndianness)
    assert bf.to_json(zarr_format=3) == "bfloat16"
    assert bf.to_native_dtype() == np.dtype(ml_dtypes.bfloat16)
    assert bf.item_size == 2
    assert parse_dtype("bfloat16", zarr_format=3) == bf
    assert parse_dtype("float8_e4m3fn", zarr_format=3) == dtypes.Float8E4M3FN()
    f8 = parse_dtype(np.dtype(ml_dtypes.float8_e5m2), zarr_format=3)
    assert isinstance(f8, dtypes.Float8E5M2) and not isinstance(f8, HasEndianness)
    assert f8.item_size == 1
    # built-in types still resolve to zarr's own classes
    assert type(parse_dtype(np.dtype("float16"), zarr_format=3)).__name__ == "Float16"
    assert type(parse_dtype(np.dtype("V2"), zarr_format=3)).__name__ == "RawBytes"
    with pytest.raises(ValueError):
        bf.to_json(zarr_format=2)
    with pytest.raises(ValueError):
        dtypes.BFloat16(endianness="big").to_native_dtype()


def test_zarr_dtype_scalars() -> None:
    from arraycheckpoint.codecs import dtypes

    bf = dtypes.BFloat16()
    assert bits(np.asarray(bf.default_scalar())) == 0
    assert bf.to_json_scalar(bf.default_scalar(), zarr_format=3) == 0.0
    assert bf.to_json_scalar(1.5, zarr_format=3) == 1.5
    assert bf.to_json_scalar(-0.0, zarr_format=3) == 0.0
    assert math.copysign(1.0, bf.to_json_scalar(-0.0, zarr_format=3)) == -1.0
    assert bf.to_json_scalar(float("nan"), zarr_format=3) == "NaN"
    assert bf.to_json_scalar(float("-inf"), zarr_format=3) == "-Infinity"
    # a NaN payload survives as raw-bit hex, 4 digits for bfloat16 (not read as float16)
    payload = np.array(0x7FC1, dtype=np.uint16).view(ml_dtypes.bfloat16)[()]
    assert bf.to_json_scalar(payload, zarr_format=3) == "0x7fc1"
    assert bits(np.asarray(bf.from_json_scalar("0x7fc1", zarr_format=3))) == 0x7FC1
    assert bits(np.asarray(bf.from_json_scalar("0x3fc0", zarr_format=3))) == 0x3FC0  # 1.5, not float16
    assert float(bf.from_json_scalar("Infinity", zarr_format=3)) == math.inf
    assert float(bf.from_json_scalar(2, zarr_format=3)) == 2.0
    assert bf.cast_scalar(payload) is payload
    assert float(bf.cast_scalar(np.float32(3.0))) == 3.0
    assert float(bf.cast_scalar("0.5")) == 0.5
    with pytest.raises(TypeError):
        bf.cast_scalar("not a number")
    with pytest.raises(TypeError):
        bf.from_json_scalar([1.0], zarr_format=3)
    with pytest.raises(ValueError):
        bf.from_json_scalar("0x7f", zarr_format=3)

    f8 = dtypes.Float8E4M3FN()
    assert (
        f8.to_json_scalar(np.array(0xFF, np.uint8).view(ml_dtypes.float8_e4m3fn)[()], zarr_format=3) == "0xff"
    )
    assert (
        f8.to_json_scalar(np.array(0x7F, np.uint8).view(ml_dtypes.float8_e4m3fn)[()], zarr_format=3) == "NaN"
    )
    assert bits(np.asarray(f8.from_json_scalar("0x7e", zarr_format=3))) == 0x7E
    assert f8.to_json_scalar(448, zarr_format=3) == 448.0


def test_entry_points_declared() -> None:
    from importlib.metadata import entry_points

    eps = {e.name: e for e in entry_points(group="zarr.data_type")}
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", *ML_DTYPE_NAMES):
        assert name in eps, f"zarr.data_type entry point {name} missing (pip install -e . ?)"
        assert eps[name].load()._zarr_v3_name == name


@pytest.mark.parametrize("name", ML_DTYPE_NAMES)
def test_zarr_python_in_process_all_ml_dtypes(tmp_path: Path, name: str) -> None:
    """Every ml_dtypes type crosses tensorstore <-> zarr-python both ways (registered in process)."""
    import zarr

    from arraycheckpoint.codecs import register_zarr_dtypes

    register_zarr_dtypes()
    dt = numpy_dtype(name)
    data = random_values(dt, (5, 7), seed=7)
    ts_write_read(tmp_path / "ts", array_metadata((5, 7), dt, (4, 4), (2, 2), compression="zstd"), data)
    got = zarr.open_array(str(tmp_path / "ts"), mode="r")[...]
    assert got.dtype == dt
    np.testing.assert_array_equal(bits(got), bits(data))

    arr = zarr.create_array(
        store=str(tmp_path / "zp"), shape=data.shape, dtype=dt, chunks=(2, 2), shards=(4, 4), compressors=None
    )
    arr[...] = data
    back = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "zp")}}).result()
    np.testing.assert_array_equal(bits(back.read().result()), bits(data))


@pytest.mark.parametrize(
    "name,shape,compression",
    [
        ("model/layers.0.w", (4, 6), None),
        ('model/we"ird\\name/é ∑', (3,), "zstd"),
        ("optim/state/\u0001ctl/x", (2, 3, 4), None),
        ("scalar", (), None),
    ],
)
def test_zarr_json_template_matches_whole_encoding(
    name: str, shape: tuple[int, ...], compression: str | None
) -> None:
    """The save's shared zarr.json template, joined with one array's names, is that array's whole encoding."""
    import dataclasses
    import json

    from arraycheckpoint.codecs.presets import array_metadata
    from arraycheckpoint.engine.packwrite import create_arrays, zarr_json_template
    from arraycheckpoint.planning.plan import ArrayLayout

    chunk = tuple(max(1, s // 2) for s in shape)
    layout = ArrayLayout(name, shape, "float32", chunk, chunk, compression)
    whole = json.dumps(array_metadata(shape, np.float32, chunk, chunk, compression, name=name)).encode()
    parts = zarr_json_template(dataclasses.replace(layout, name=""))
    assert len(parts) == len(shape) + 1

    class Writer:
        def __init__(self) -> None:
            self.docs: dict[str, bytes] = {}

        def write(self, key: str, parts: list[bytes]) -> None:
            self.docs[key] = b"".join(parts)

    class Job:
        storage = None
        staging = ""

    w = Writer()
    other = dataclasses.replace(layout, name=name + "2")
    create_arrays(Job(), w, [layout, other])  # type: ignore[arg-type]
    assert w.docs[f"{name}/zarr.json"] == whole
    assert (
        w.docs[f"{name}2/zarr.json"]
        == json.dumps(array_metadata(shape, np.float32, chunk, chunk, compression, name=name + "2")).encode()
    )
