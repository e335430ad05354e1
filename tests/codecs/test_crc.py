"""The one CRC32C implementation (:mod:`arraycheckpoint.codecs.crc`): both libraries behind it give zarr's
values for every kind of buffer the writers and readers hand it."""

from __future__ import annotations

import numpy as np
import pytest

from arraycheckpoint.codecs import crc
from arraycheckpoint.engine import shardfile

#: CRC32C's check value (of b"123456789")
CHECK = 0xE3069283


@pytest.fixture(params=["crc32c", "google_crc32c"])
def impl(request, monkeypatch):
    """Each implementation in turn: the crc32c package's (the one used), then google_crc32c's."""
    if request.param == "google_crc32c":
        monkeypatch.setattr(crc, "_FAST", None)
    else:
        assert crc._FAST is not None, "the crc32c package is a dependency and computes in hardware here"
    return request.param


def _buffers() -> list[object]:
    a = np.random.default_rng(0).integers(0, 256, 300_007, dtype=np.uint8)
    ro = a.copy()
    ro.flags.writeable = False
    return [
        b"",
        b"123456789",
        a,  # uint8
        a[:300_000].view(np.float32).reshape(-1, 4),  # 2-D float32 (the chunks a save encodes)
        ro,  # read-only (a loaded chunk's bytes)
        memoryview(a)[5:70_000],
        bytearray(a[:1000].tobytes()),
        np.zeros(0, np.float64),
    ]


def test_check_value_and_chaining(impl) -> None:
    assert crc.crc32c(b"123456789") == CHECK
    assert crc.extend(crc.extend(0, b"1234"), b"56789") == CHECK
    assert crc.extend(crc.crc32c(b"12345"), np.frombuffer(b"6789", np.uint8)) == CHECK


def test_every_buffer_kind_gives_zarrs_crc32c(impl) -> None:
    """Against zarr-python's own CRC32C (google_crc32c over the bytes): whole, and extended in pieces."""
    import google_crc32c

    for buf in _buffers():
        raw = memoryview(buf).cast("B").tobytes() if not isinstance(buf, bytes) else buf
        want = google_crc32c.value(raw)
        assert crc.crc32c(buf) == want, type(buf)
        pieces = [raw[i : i + 65_536] for i in range(0, len(raw), 65_536)]
        got = 0
        for p in pieces:
            got = crc.extend(got, np.frombuffer(p, np.uint8))
        assert got == want


def test_arrays_of_dtypes_without_a_buffer_format_are_summed_as_bytes(impl) -> None:
    """bfloat16 and float8 arrays (no buffer-protocol format): summed over their bytes, not refused."""
    import google_crc32c
    import ml_dtypes

    for dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        a = np.arange(1000, dtype=np.float32).astype(dtype)
        assert crc.crc32c(a) == google_crc32c.value(a.tobytes()), dtype


def test_a_strided_array_is_refused_not_summed_wrongly(impl) -> None:
    a = np.arange(100, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        crc.crc32c(a)


def test_shard_files_encode_the_same_with_either_implementation(monkeypatch) -> None:
    """A chunk file's bytes (inner chunks, their CRC32C, the index and its CRC32C) do not depend on which
    library summed them."""
    data = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)

    def encoded() -> bytes:
        return b"".join(
            p.tobytes() if isinstance(p, np.ndarray) else bytes(p) for p in shardfile.encode(data, (32, 96))
        )

    fast = encoded()
    monkeypatch.setattr(crc, "_FAST", None)
    assert encoded() == fast
