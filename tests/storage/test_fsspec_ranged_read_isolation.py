"""fsspec ranged reads (:mod:`arraycheckpoint.storage.ranged`) of one store neither wait on nor fail because
of another's, and a slow but live store's queued reads wait for it instead of failing as stalls.

Before (review22c, review22e): the cap on calls left unanswered and the workers were one per process, so a
hung mount's 64 calls made every later read of a healthy store fail as a stall, and its reads in flight made
a healthy store's reads wait behind them and fail; a read's bound started when it was asked, so reads queued
behind a live store's answers (40 ms each, 1,200 reads at ``timeout=1``) failed as stalls (432 of them); and an
HTTP server that ignores ``Range`` gave the object's first bytes for a range at an offset reaching past its
end."""

from __future__ import annotations

import functools
import http.server
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from arraycheckpoint.errors import StorageError
from arraycheckpoint.storage.fsspec_store import FsspecStorage

_HUNG = threading.Event()  # cleared: the hung store never answers


class _HungFS(LocalFileSystem):
    protocol = ("acphung",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return LocalFileSystem._strip_protocol(str(path).removeprefix("acphung://"))

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> Any:
        _HUNG.wait()
        return super().cat_file(path, start=start, end=end, **kw)


class _SlowFS(LocalFileSystem):
    protocol = ("acpslow",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return LocalFileSystem._strip_protocol(str(path).removeprefix("acpslow://"))

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> Any:
        time.sleep(0.04)  # a live store answering every read in 40 ms
        return super().cat_file(path, start=start, end=end, **kw)


def test_a_hung_store_does_not_stop_another_stores_reads(tmp_path: Path) -> None:
    fsspec.register_implementation("acphung", _HungFS, clobber=True)
    (tmp_path / "obj").write_bytes(bytes(range(256)))
    hung, healthy = FsspecStorage("acphung", {}), FsspecStorage("file", {})
    hung.stall_timeout = healthy.stall_timeout = 1.0
    on_hung, on_healthy = (
        hung.ranged_reads(f"acphung://{tmp_path}"),
        healthy.ranged_reads(f"file://{tmp_path}"),
    )
    _HUNG.clear()
    try:
        for _wave in range(3):  # a load of the hung store failing, retried: its calls stay unanswered
            reads = [on_hung.read("obj", byte_range=slice(i, i + 4)) for i in range(64)]
            for f in reads:
                with pytest.raises(StorageError, match="stalls"):
                    f.result()
        running = [on_hung.read("obj", byte_range=slice(i, i + 4)) for i in range(64)]  # in flight now
        assert on_healthy.read("obj", byte_range=slice(3, 7)).result().value == bytes(range(3, 7))
        for f in running:
            with pytest.raises(StorageError, match="stalls"):
                f.result()
        assert healthy.read_suffix(f"file://{tmp_path}", "obj", 16) == (bytes(range(240, 256)), None)
    finally:
        _HUNG.set()


def test_reads_queued_behind_a_slow_live_store_wait_for_it(tmp_path: Path) -> None:
    fsspec.register_implementation("acpslow", _SlowFS, clobber=True)
    (tmp_path / "obj").write_bytes(bytes(range(256)) * 512)
    slow = FsspecStorage("acpslow", {})
    slow.stall_timeout = 1.0
    reads = slow.ranged_reads(f"acpslow://{tmp_path}")
    queued = [
        reads.read("obj", byte_range=slice(i * 100, i * 100 + 30)) for i in range(1200)
    ]  # ~1.5 s of answers
    time.sleep(0.05)
    late = reads.read("obj", byte_range=slice(5, 10))  # another load's read, behind them
    data = bytes(range(256)) * 512
    assert [f.result().value for f in queued] == [data[i * 100 : i * 100 + 30] for i in range(1200)]
    assert late.result().value == data[5:10]


def test_an_http_server_ignoring_range_is_read_as_asked_past_the_end(tmp_path: Path) -> None:
    data = bytes(range(100))
    (tmp_path / "obj").write_bytes(data)

    class Quiet(http.server.SimpleHTTPRequestHandler):  # sends the whole file whatever Range says
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reads = FsspecStorage("http", {}).ranged_reads(f"http://127.0.0.1:{server.server_address[1]}")
        for r in (slice(60, 90), slice(60, 200), slice(10, 110), slice(0, 150), slice(-30, None)):
            assert reads.read("obj", byte_range=r).result().value == data[r], r
    finally:
        server.shutdown()


class _SteadyFS(LocalFileSystem):
    protocol = ("acpsteady",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return LocalFileSystem._strip_protocol(str(path).removeprefix("acpsteady://"))

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> Any:
        time.sleep(1.1)  # every call answered, a little faster than the stall bound
        return super().cat_file(path, start=start, end=end, **kw)


def test_a_read_queued_on_a_store_that_answers_just_within_the_stall_bound_is_not_refused(
    tmp_path: Path,
) -> None:
    """A wait on a queued read judged the store's last answer as of its previous wake-up: an answer landing
    during its last short wait was not seen, and a live store's read was refused as a stall (review22f)."""
    fsspec.register_implementation("acpsteady", _SteadyFS, clobber=True)
    (tmp_path / "big").write_bytes(b"x" * (1 << 16))
    steady = FsspecStorage("acpsteady", {})
    steady.stall_timeout = 1.2
    reads = steady.ranged_reads(f"acpsteady://{tmp_path}")
    first = [reads.read("big", byte_range=slice(0, 1024)) for _ in range(64)]  # 32 run, 32 queue
    late = reads.read("big", byte_range=slice(0, 1024))  # starts with the third wave, ~2.2 s from now
    assert late.result().value == b"x" * 1024
    assert all(f.result().value == b"x" * 1024 for f in first)
