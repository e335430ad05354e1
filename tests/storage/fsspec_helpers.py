"""Helpers of the fsspec tests: a local file system under a protocol of its own (a store whose calls a test
slows, stops or records, with a state of its own in :mod:`arraycheckpoint.storage.ranged`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from typing import Any

from fsspec.implementations.local import LocalFileSystem


class LocalUnder(LocalFileSystem):
    """Local files under the protocol a subclass names first in ``protocol`` (register it with
    ``fsspec.register_implementation``)."""

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return LocalFileSystem._strip_protocol(str(path).removeprefix(f"{cls.protocol[0]}://"))


@contextmanager
def http_server(handler: type) -> Iterator[str]:
    """A stdlib HTTP server on loopback answering with ``handler`` (a ``BaseHTTPRequestHandler``), its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def send_206(handler: Any, whole: bytes, first: int, last: int, total: str) -> None:
    """Answer on ``handler`` (a ``BaseHTTPRequestHandler``) with a ``206`` of bytes ``first..last`` of
    ``whole``, its ``Content-Range`` saying that range and ``total`` as the object's length (``*``: unknown)."""
    body = whole[first : last + 1]
    handler.send_response(206)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Content-Range", f"bytes {first}-{last}/{total}")
    handler.end_headers()
    handler.wfile.write(body)
