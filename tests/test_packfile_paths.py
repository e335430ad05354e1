"""Both CRC-32 paths of the pack writer (zlib-ng's, a dependency, and zlib's where it is not installed) write
the same bytes as zipfile; ZIP64 members read back with zipfile and ``unzip``; a failed write leaves no
file and no descriptor behind."""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from arraycheckpoint.engine import packfile, packstream, shardfile


def _members() -> list[packfile.Member]:
    rng = np.random.default_rng(7)
    big = rng.standard_normal((64, 96)).astype(np.float32)
    return [
        ("model/a/zarr.json", [b'{"zarr_format": 3}']),
        ("model/a/c.0.0", shardfile.encode(big, (32, 96))),  # ndarray parts above the foreign-call threshold
        ("model/e/c.0", [np.zeros(0, np.uint8)]),  # empty ndarray
        ("model/t/c.0", [big[:, ::2]]),  # a strided source (flattened into a copy first)
        ("model/z/c.0", [np.zeros(1 << 16, np.uint8), b""]),
    ]


def _reference(members: list[packfile.Member]) -> bytes:
    buf = io.BytesIO()
    packfile.write_zip(buf, members)
    return buf.getvalue()


def _zlib_ng() -> object:
    from zlib_ng.zlib_ng import crc32

    return crc32


@pytest.fixture(params=["zlib", "zlib-ng"])
def crc_path(request, monkeypatch) -> str:
    monkeypatch.setattr(packfile, "_ZIP_CRC32", zlib.crc32 if request.param == "zlib" else _zlib_ng())
    return request.param


def test_the_writer_uses_zlib_ng() -> None:
    """The dependency is installed and chosen (a fallback to zlib would be 5-16x slower, silently)."""
    assert packfile._ZIP_CRC32 is _zlib_ng()


def test_both_crc_paths_write_zipfiles_bytes(tmp_path: Path, crc_path: str) -> None:
    members = _members()
    path = tmp_path / "0.0.zip"
    packstream.write_pack_file(str(path), members)
    assert path.read_bytes() == _reference(members)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
    if shutil.which("unzip"):
        subprocess.run(["unzip", "-tqq", str(path)], check=True)


@pytest.mark.parametrize("nbytes", [4096, 100_003, 1 << 20])
def test_both_crc_paths_are_zlibs_crc32(crc_path: str, nbytes: int) -> None:
    data = np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes), dtype=np.uint8)
    for start in (0, 0xFFFFFFFF, 0x12345678):
        assert packfile._crc32(data, start) == zlib.crc32(data.tobytes(), start)
    strided = np.arange(2 * nbytes, dtype=np.uint8)[::2]  # never summed by address: refused, as zlib does
    with pytest.raises(ValueError):
        packfile._crc32(strided, 5)


def test_zip64_members_match_zipfile_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A member above the ZIP64 limit (lowered: no 4 GiB file needed) gets zipfile's zip64 local header and
    directory extra field, and zipfile reads every member back."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    members = [("small", [b"x" * 10]), ("big", [np.arange(150, dtype=np.uint8)]), ("after", [b"y" * 99])]
    path = tmp_path / "0.0.zip"
    packstream.write_pack_file(str(path), members)
    assert path.read_bytes() == _reference(members)
    with zipfile.ZipFile(path) as zf:
        assert zf.read("big") == bytes(range(150)) and zf.read("after") == b"y" * 99
        assert zf.testzip() is None


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_failed_write_leaves_no_file_and_no_descriptor(tmp_path: Path, monkeypatch) -> None:
    before = len(os.listdir("/proc/self/fd"))
    real = os.pwritev
    calls = []

    def pwritev(fd, bufs, offset):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(packstream, "BATCH_BYTES", 1 << 10)  # several batches
    monkeypatch.setattr(os, "pwritev", pwritev)
    path = tmp_path / "0.0.zip"
    with pytest.raises(OSError, match="No space"):
        packstream.write_pack_file(str(path), _members())
    monkeypatch.undo()
    assert not path.exists()
    assert len(os.listdir("/proc/self/fd")) == before
    packstream.write_pack_file(str(path), _members())  # the same path can be written again
    assert path.read_bytes() == _reference(_members())


@pytest.mark.timeout(60)
def test_a_writev_that_writes_nothing_is_an_error_not_a_loop(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, offset: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        packstream.write_pack_file(str(tmp_path / "0.0.zip"), _members())
    monkeypatch.setattr(os, "writev", lambda fd, bufs: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        shardfile._write_file(str(tmp_path / "c.0"), [b"abc"])
    assert not (tmp_path / "0.0.zip").exists()
