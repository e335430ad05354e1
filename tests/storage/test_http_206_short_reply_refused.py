"""A ``206`` reply over HTTP holding fewer bytes than the range asked for is refused, also where the range is
open (``stop=None``) or the server says the object's length is unknown (``Content-Range: bytes a-b/*``).

Before (review23e D4): the "short of the range" check needed both the range's end and the object's length, so
a ``206`` of 10 bytes answering ``bytes=0-`` of a 100-byte object, or ``bytes=0-49`` with a length of ``*``,
was returned as the whole range (truncated bytes read as the object's). Now the reply must end where the range
(or the object, where its length is said) ends, and a mismatch is refused naming the URL.
"""

from __future__ import annotations

import http.server
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="fsspec's HTTP file system needs aiohttp (s3fs brings it)")

import fsspec  # noqa: E402
from fsspec_helpers import http_server, send_206  # noqa: E402

from arraycheckpoint.errors import StorageError  # noqa: E402
from arraycheckpoint.storage.httpread import read_range  # noqa: E402

OBJECT = bytes(range(100))
LIMIT = 1 << 20


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves :data:`OBJECT`: ``/short*`` answer any range with its first 10 bytes only (``/short``: the
    object's length said, ``/shortstar``: ``*``); ``/star`` the range asked for, its length said as ``*``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        assert m is not None, self.headers.get("Range")
        first = int(m[1])
        if first >= len(OBJECT):  # past the end: unsatisfiable, as RFC 9110 says
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(OBJECT)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        last = min(int(m[2] or len(OBJECT) - 1), len(OBJECT) - 1)
        if self.path.startswith("/short"):
            last = min(last, first + 9)
        send_206(self, OBJECT, first, last, "*" if self.path.endswith("star") else str(len(OBJECT)))


@pytest.fixture
def url() -> Iterator[str]:
    with http_server(_Handler) as served:
        yield served


@pytest.mark.parametrize(
    ("path", "start", "stop", "why"),
    [
        ("/short", 0, None, r"ends at byte 9, short of 99 \(the object holds 100\)"),
        ("/short", 20, None, r"ends at byte 29, short of 99"),
        ("/shortstar", 0, 50, r"ends at byte 9 and the object goes on"),
        ("/shortstar", 0, None, r"ends at byte 9 and the object goes on"),
    ],
)
def test_a_short_206_is_refused(url: str, path: str, start: int, stop: int | None, why: str) -> None:
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    with pytest.raises(StorageError, match=re.escape(path) + r".*" + why):  # before: 10 bytes returned
        read_range(fs, url + path, start, stop, LIMIT)


def test_a_full_206_is_read(url: str) -> None:
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    assert read_range(fs, url + "/short", 90, None, LIMIT) == OBJECT[90:]  # the object ends there
    # past the object's end: what the object holds
    assert read_range(fs, url + "/short", 95, 120, LIMIT) == OBJECT[95:]
    assert read_range(fs, url + "/star", 0, 50, LIMIT) == OBJECT[:50]
    assert read_range(fs, url + "/star", 30, 31, LIMIT) == OBJECT[30:31]


def test_a_206_of_unsaid_length_ending_with_the_object_is_read(url: str) -> None:
    """A server saying ``*`` for the length (RFC 9110 allows it) answers an open range, or one running past the
    object's end, with what the object holds: read, once a range from the reply's end is refused as past the
    object's end (416). Before (review23f D1): refused, so no checkpoint loaded from such a server (every
    metadata read asks ``bytes=0-<limit>``)."""
    from arraycheckpoint.storage.fsspec_store import _bounded_cat

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    assert read_range(fs, url + "/star", 95, 120, LIMIT) == OBJECT[95:]
    assert read_range(fs, url + "/star", 0, None, LIMIT) == OBJECT
    assert read_range(fs, url + "/star", 40, None, LIMIT) == OBJECT[40:]
    assert _bounded_cat(fs, url + "/star", LIMIT) == OBJECT
