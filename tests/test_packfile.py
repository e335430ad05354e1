"""The pack writer (``engine/packstream.py``): a pack streamed member by member has exactly the bytes of zipfile's
``write_zip`` (the reference every reader was tested against), and the result reads back with zipfile."""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from arraycheckpoint.engine import packfile, packstream, shardfile


def _members() -> list[packfile.Member]:
    rng = np.random.default_rng(0)
    chunk = rng.standard_normal((16, 8)).astype(np.float32)
    return [
        ("model/a/zarr.json", [b'{"zarr_format": 3}']),
        ("model/a/c.0.0", shardfile.encode(chunk, (8, 8))),  # arrays and bytes interleaved
        ("model/big/c.0.0", shardfile.encode(rng.standard_normal((64, 96)).astype(np.float32), (32, 96))),
        ("model/empty/c.0", [b""]),  # a zero-byte member
        ("model/ünï/c.0", [np.arange(7, dtype=np.uint8), b"tail"]),  # a UTF-8 name (flag bit 11)
        *(
            (f"model/s{i}/c.0", [rng.bytes(int(rng.integers(0, 64)))]) for i in range(700)
        ),  # > one batch of members
    ]


def _reference(members: list[packfile.Member]) -> bytes:
    buf = io.BytesIO()
    packfile.write_zip(buf, members)
    return buf.getvalue()


@pytest.mark.parametrize("count", [0, 1, 705])
def test_write_zip_file_writes_zipfiles_bytes(tmp_path: Path, count: int) -> None:
    members = _members()[:count]
    path = tmp_path / "0.0.zip"
    packstream.write_pack_file(str(path), members)
    assert path.read_bytes() == _reference(members)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every member's CRC-32 checks
        for key, parts in members:
            want = b"".join(
                bytes(memoryview(np.ascontiguousarray(p)).cast("B")) if isinstance(p, np.ndarray) else p
                for p in parts
            )
            assert zf.read(key) == want


def test_write_zip_file_zip64_records_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the ZIP64 limits (lowered here, so no 4 GiB file is needed) the end records match zipfile's."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 3)
    members = [(f"m{i}", [bytes(range(60))]) for i in range(5)]
    path = tmp_path / "0.0.zip"
    packstream.write_pack_file(str(path), members)
    assert path.read_bytes() == _reference(members)


def test_write_zip_file_refuses_an_existing_path(tmp_path: Path) -> None:
    path = tmp_path / "0.0.zip"
    path.write_bytes(b"x")
    with pytest.raises(FileExistsError):
        packstream.write_pack_file(str(path), [("a", [b"1"])])


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 100_003])
def test_crc32_is_zlibs(nbytes: int) -> None:
    """Members' CRC-32 (zlib-ng's) is zlib's, continued from any value."""
    data = np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes), dtype=np.uint8)
    for start in (0, 0x12345678):
        assert packfile._crc32(data, start) == zlib.crc32(data.tobytes(), start)
        assert packfile._crc32(data.tobytes(), start) == zlib.crc32(data.tobytes(), start)
