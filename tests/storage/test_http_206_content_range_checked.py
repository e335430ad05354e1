"""A ``206`` reply over HTTP is taken only for the range its ``Content-Range`` says it is.

Before (review23c S1): an HTTP ranged read checked a ``206`` reply's length only: a server answering
``bytes=50-149`` with a ``206`` of another range of at most 100 bytes (``bytes 0-99``: a cache serving the
wrong slice, a broken proxy) had those bytes returned as bytes 50..149 of the object. Now the reply's
``Content-Range`` must name the range asked for (a shorter one only where the object ends), and a mismatch is
refused naming the URL.
"""

from __future__ import annotations

import http.server
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="fsspec's HTTP file system needs aiohttp (s3fs brings it)")

from fsspec_helpers import http_server, send_206  # noqa: E402

from arraycheckpoint.errors import StorageError  # noqa: E402
from arraycheckpoint.storage.fsspec_store import FsspecStorage  # noqa: E402

OBJECT = bytes(range(256)) * 4  # 1 KiB


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves :data:`OBJECT` at ``/honest`` (206 of the range asked for) and ``/shifted`` (206 of the range asked
    for moved 50 bytes back, its Content-Range saying so)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(OBJECT)))
        self.end_headers()

    def do_GET(self) -> None:
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        assert m is not None, self.headers.get("Range")
        if m[1] == "":  # a suffix
            first, last = len(OBJECT) - int(m[2]), len(OBJECT) - 1
        else:
            first, last = int(m[1]), min(int(m[2] or len(OBJECT) - 1), len(OBJECT) - 1)
        if self.path == "/shifted":
            first, last = max(0, first - 50), max(0, first - 50) + (last - first)
        send_206(self, OBJECT, first, last, str(len(OBJECT)))


@pytest.fixture
def url() -> Iterator[str]:
    with http_server(_Handler) as served:
        yield served


def test_a_206_of_another_range_is_refused(url: str) -> None:
    storage = FsspecStorage("http", {})
    reads = storage.ranged_reads(url)
    with pytest.raises(StorageError, match=r"shifted.*starts at byte 0, not 50"):
        reads.read("shifted", byte_range=slice(50, 150)).result()  # before: bytes 0..99 returned as 50..149
    with pytest.raises(StorageError, match=r"shifted.*starts at byte 874, not 924"):
        storage.read_suffix(url, "shifted", 100)  # before: bytes 874..973 returned as the last 100


def test_a_206_of_the_range_asked_for_is_read(url: str) -> None:
    storage = FsspecStorage("http", {})
    reads = storage.ranged_reads(url)
    assert reads.read("honest", byte_range=slice(50, 150)).result().value == OBJECT[50:150]
    # past the object's end: the 206 holds what the object has (its Content-Range ends with the object)
    assert reads.read("honest", byte_range=slice(1000, 1100)).result().value == OBJECT[1000:]
    got = storage.read_suffix(url, "honest", 100)
    assert got is not None and got[0] == OBJECT[-100:]
