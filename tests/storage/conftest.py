"""Fixtures for the storage tests: a real S3-compatible server (moto's server mode) on loopback, and a real
HTTP proxy in front of it that can answer with throttling/5xx/403 errors to exercise retries."""

from __future__ import annotations

import http.client
import os
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "acp-test",
    "AWS_SECRET_ACCESS_KEY": "acp-test-secret",
    "AWS_REGION": "us-east-1",
}


class S3Server:
    """A moto S3 server on 127.0.0.1 with one bucket; ``client`` is a boto3 client for checks."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.bucket = "acp-test-bucket"
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        )
        self.client.create_bucket(Bucket=self.bucket)

    def keys(self, prefix: str) -> list[str]:
        out: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out.extend(o["Key"] for o in page.get("Contents", []))
        return sorted(out)

    def zarr_store(self, root: str) -> Any:
        """zarr-python's own store of ``root`` (an ``s3://`` URL) on this server: ``FsspecStore`` through s3fs,
        what a user of zarr-python reads S3 with; each read is a request to the server."""
        pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")
        import zarr

        return zarr.storage.FsspecStore.from_url(
            root, read_only=True, storage_options={"endpoint_url": self.endpoint}
        )

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    saved = {k: os.environ.get(k) for k in (*AWS_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")}
    os.environ.update(AWS_ENV)
    server = S3Server()
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_prefix(s3_server: S3Server) -> str:
    """A fresh ``s3://bucket/<unique>`` location."""
    return f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:10]}"


class FaultProxy:
    """An HTTP proxy to the S3 server that fails the next ``fail_next`` requests with ``status``, and logs
    every request it forwards in ``requests``: ``(method, path, Range header or None, body bytes sent)``.

    ``delay``: seconds each request waits before it is forwarded (a far store's round trip); ``peak``: the
    most GETs of packs (``/.acp/packs/``) answered at once (``timed``: when each request was received and
    answered, to count other sets of requests at once: :meth:`peak_of`); with ``stall`` set, those wait for ``release``
    (a store that stops answering)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.fail_next = 0
        self.status = 503
        self.body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
        self.failed = 0
        self.forwarded = 0
        self.requests: list[tuple[str, str, str | None, int]] = []
        self.delay = 0.0
        self.in_flight = self.peak = 0
        self.timed: list[tuple[str, str, float, float]] = []  # (method, path, received, answered)
        self.stall, self.release = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    fail = proxy.fail_next > 0
                    if fail:
                        proxy.fail_next -= 1
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                if fail:
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(proxy.body)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD response has no body (exists() sends HEAD)
                        self.wfile.write(proxy.body)
                    return
                pack = self.command == "GET" and "/.acp/packs/" in self.path
                started = time.monotonic()
                with proxy._lock:
                    proxy.in_flight += pack
                    proxy.peak = max(proxy.peak, proxy.in_flight)
                try:
                    if pack and proxy.stall.is_set():
                        proxy.release.wait(60)
                    if proxy.delay:
                        time.sleep(proxy.delay)
                    self._forward(body)
                finally:
                    with proxy._lock:
                        proxy.in_flight -= pack
                        proxy.timed.append((self.command, self.path, started, time.monotonic()))

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items()}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                # a HEAD answer has no body but says the object's length (what a file system's size is)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, self.headers.get("Range"), len(data)))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def peak_of(self, spans: list[tuple[float, float]]) -> int:
        """The most of the requests answered in ``spans`` (``(received, answered)`` of each, from ``timed``)
        in progress at once."""
        events = sorted([(t0, 1) for t0, _t1 in spans] + [(t1, -1) for _t0, t1 in spans])
        peak = now = 0
        for _t, step in events:
            now += step
            peak = max(peak, now)
        return peak

    def first_pack_gets(self) -> list[tuple[float, float]]:
        """``(received, answered)`` of the first GET of each pack (its end: its directory's read)."""
        first: dict[str, tuple[float, float]] = {}
        for method, path, t0, t1 in sorted(self.timed, key=lambda r: r[2]):
            if method == "GET" and "/.acp/packs/" in path:
                first.setdefault(path.partition("?")[0], (t0, t1))
        return list(first.values())

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def proxied(fault_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """``s3://`` and ``s3a://`` (fsspec: s3fs) to the loopback server through the counting proxy."""
    from arraycheckpoint import storage
    from arraycheckpoint.storage import configure
    from arraycheckpoint.storage.fsspec_store import FsspecStorage

    storage.register_scheme("s3a", lambda: FsspecStorage("s3a", {"endpoint_url": fault_proxy.endpoint}))
    configure("s3", endpoint=fault_proxy.endpoint)
    try:
        yield fault_proxy
    finally:
        configure("s3", endpoint=None)
        storage.register_scheme("s3a", None)
