"""An HTTP server that ignores ``Range`` (Python's ``http.server`` does), or lies about it, never makes an
fsspec read hold or fetch more than the range it asked for.

Before: every read went through ``fs.cat_file``, which reads the whole reply body into memory before
anything looks at it, so a read of a pack member's 4 KiB, of a pack's last 64 KiB or of a capped metadata
document held the whole object the server sent (64 MiB here; as much as a hostile server streams, in
general), and a range read made the server send all of it. Now HTTP replies are streamed: a reply that is the
whole object is read only up to the range's end (a suffix keeps only its last bytes), and a ``206`` longer
than the range asked for is refused after one byte more than it.
"""

from __future__ import annotations

import http.server
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="fsspec's HTTP file system needs aiohttp (s3fs brings it)")

from arraycheckpoint.errors import StorageError  # noqa: E402
from arraycheckpoint.storage.fsspec_store import FsspecStorage  # noqa: E402

_BIG = 64 << 20
_BLOCK = bytes(range(256)) * 256  # 64 KiB: the object is this block repeated


def _byte(i: int) -> int:
    return i % 256


class _Server:
    """Serves ``/whole`` (200 and the whole object, whatever ``Range`` asks) and ``/lying`` (206, but the whole
    object), counting the bytes each reply got out before the client hung up."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.done = threading.Condition()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(_BIG))
                self.end_headers()

            def do_GET(self) -> None:
                self.send_response(206 if self.path == "/lying" else 200)
                self.send_header("Content-Length", str(_BIG))
                if self.path == "/lying":
                    self.send_header("Content-Range", f"bytes 0-{_BIG - 1}/{_BIG}")
                self.end_headers()
                sent = 0
                try:
                    while sent < _BIG:
                        self.wfile.write(_BLOCK)
                        sent += len(_BLOCK)
                except OSError:
                    pass
                finally:
                    with owner.done:
                        owner.sent[self.path] = owner.sent.get(self.path, 0) + sent
                        owner.done.notify_all()
                    self.close_connection = True

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sent_for(self, path: str) -> int:
        """The bytes the reply to ``path`` got out, once it ended (the client hung up, or all was sent)."""
        with self.done:
            assert self.done.wait_for(lambda: path in self.sent, timeout=60), "the reply never ended"
            return self.sent[path]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    try:
        yield s
    finally:
        s.stop()


def _peak(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the most memory Python allocated meanwhile (every thread's)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_range_read_from_a_server_ignoring_range_stops_at_the_range_end(server: _Server) -> None:
    storage = FsspecStorage("http", {})
    reads = storage.ranged_reads(server.url)
    got, peak = _peak(lambda: reads.read("whole", byte_range=slice(1000, 5096)).result().value)
    assert got == bytes(_byte(i) for i in range(1000, 5096))
    assert peak < 16 << 20, peak  # before: the 64 MiB body, held (twice)
    assert server.sent_for("/whole") < 32 << 20, server.sent  # before: all 64 MiB sent for 4 KiB


def test_a_suffix_read_from_a_server_ignoring_range_keeps_only_the_suffix(server: _Server) -> None:
    storage = FsspecStorage("http", {})
    got, peak = _peak(lambda: storage.read_suffix(server.url, "whole", 65536))
    assert got is not None and got[0] == _BLOCK
    assert peak < 16 << 20, peak  # before: the 64 MiB body, held (twice)


def test_a_206_reply_longer_than_the_range_is_refused_without_reading_it(server: _Server) -> None:
    storage = FsspecStorage("http", {})
    storage.stall_timeout = 5.0
    reads = storage.ranged_reads(server.url)
    with pytest.raises(StorageError, match="lying.*not the range asked for"):
        reads.read("lying", byte_range=slice(0, 4096)).result()
    assert server.sent_for("/lying") < 32 << 20, server.sent  # before: all 64 MiB sent and held, then refused
