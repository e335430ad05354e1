"""A ranged read through fsspec is bounded from its call, not from when a worker takes it, and a failed load
leaves no reads behind it (:mod:`arraycheckpoint.storage.ranged`).

The reads run on one pool of :data:`~arraycheckpoint.storage.ranged._WORKERS` threads per process. Before,
a read's bound started when a worker took it, and a failed load's reads stayed queued: on a stalled store each
held a worker for its full bound and left a thread hung, so concurrent loads and a load after a failed one
waited behind them (4 loads with ``timeout=1`` failed after 2.2, 4.4, 8.6 and 12.8 s, leaving 245 threads).
Here a local file system that stops answering ranged reads of packs over 64 KiB stands for the stalled store.

Also: a server that ignores ``Range`` (it sends the whole object) is read correctly, its bytes cut to the
range asked for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

import arraycheckpoint as acp
from arraycheckpoint import storage
from arraycheckpoint.engine import coalesce
from arraycheckpoint.errors import StorageError
from arraycheckpoint.storage import ranged
from arraycheckpoint.storage.fsspec_store import FsspecStorage

_STALL = threading.Event()  # set: ranged reads of packs over 64 KiB wait for _RELEASE
_RELEASE = threading.Event()


class _StallFS(LocalFileSystem):
    protocol = ("acpstall",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        return LocalFileSystem._strip_protocol(path.removeprefix("acpstall://"))

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> Any:
        big = start is not None and start >= 0 and (end is None or end - start > (64 << 10))
        if _STALL.is_set() and "/.acp/packs/" in str(path) and big:
            _RELEASE.wait()
        return super().cat_file(path, start=start, end=end, **kw)


class _NoRangeFS(LocalFileSystem):
    """A server that ignores ``Range``: every read returns the whole object."""

    protocol = ("acpnorange",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return LocalFileSystem._strip_protocol(str(path).removeprefix("acpnorange://"))

    extra = b""  # bytes sent besides: not the whole object then

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> Any:
        return super().cat_file(path, **kw) + self.extra


@pytest.fixture
def stalls() -> Iterator[None]:
    fsspec.register_implementation("acpstall", _StallFS, clobber=True)
    storage.register_scheme("acpstall", lambda: FsspecStorage("acpstall", {}))
    _STALL.clear()
    _RELEASE.clear()
    try:
        yield
    finally:
        _RELEASE.set()  # the calls left hung end (and give their slots back)
        storage.register_scheme("acpstall", None)


def test_concurrent_loads_on_a_stalled_store_each_fail_within_their_bound_and_threads_stay_bounded(
    stalls: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coalesce, "GAP", 0)  # every tensor a span of its own (80 KB: it stalls)
    state = {"m": {f"t{i:03d}": np.full(20_000, i, np.float32) for i in range(130)}}
    acp.save(tmp_path / "ck", state)
    url = f"acpstall://{tmp_path}/ck"

    def target() -> dict[str, Any]:
        return {"m": {k: np.zeros_like(v) for k, v in list(state["m"].items())[::2]}}

    back = target()
    acp.load(url, back, strict=False)  # a healthy store: bit-exact
    assert all(np.array_equal(v, state["m"][k]) for k, v in back["m"].items())
    before = threading.active_count()
    _STALL.set()
    took: dict[int, tuple[float, BaseException | None]] = {}

    def one(i: int) -> None:
        start = time.monotonic()
        try:
            acp.load(url, target(), strict=False, timeout=1)
            took[i] = (time.monotonic() - start, None)
        except BaseException as e:  # noqa: BLE001 - checked below
            took[i] = (time.monotonic() - start, e)

    loads = [threading.Thread(target=one, args=(i,)) for i in range(6)]  # 6 x 64 spans issued ahead
    for t in loads:
        t.start()
    for t in loads:
        t.join(60)
    # each read's bound: 1 s + 80 KB at a MiB a second; before, the last load waited ~12 waves of them
    for seconds, error in took.values():
        assert isinstance(error, StorageError) and "stalls" in str(error) and "/.acp/packs/" in str(error)
        assert seconds < 4, took
    # every load's reads not started were cancelled; at most _CALLS calls are left hung (plus the workers)
    assert threading.active_count() <= before + ranged._WORKERS + ranged._CALLS + 2, threading.active_count()
    start = time.monotonic()  # a load after the failed ones is bounded by its own timeout, not behind theirs
    with pytest.raises(StorageError, match="stalls"):
        acp.load(url, target(), strict=False, timeout=1)
    assert time.monotonic() - start < 5


def test_a_read_queued_behind_a_stalled_store_fails_by_its_own_deadline(stalls: None, tmp_path: Path) -> None:
    packs = tmp_path / "x" / ".acp" / "packs"
    packs.mkdir(parents=True)
    (packs / "0.0.zip").write_bytes(bytes(4 << 20))
    backend, root = storage.storage_for(f"acpstall://{tmp_path}/x")
    backend.stall_timeout = 1
    reads = backend.ranged_reads(f"{root}/.acp/packs")
    _STALL.set()
    span = 65537
    queued = [reads.read("0.0.zip", byte_range=slice(i * span, (i + 1) * span)) for i in range(256)]
    with pytest.raises(StorageError, match="stalls"):
        queued[0].result()
    start = time.monotonic()  # before: answered after 8.5 s, behind the 256 reads queued
    with pytest.raises(StorageError, match="stalls"):
        reads.read("0.0.zip", byte_range=slice(0, span)).result()
    assert time.monotonic() - start < 5
    for f in queued:  # nobody waits on them: cancelled, none runs
        f.cancel()
    _RELEASE.set()
    assert reads.read("0.0.zip", byte_range=slice(0, span)).result().value == bytes(span)


def test_a_server_that_ignores_range_is_read_as_asked(tmp_path: Path) -> None:
    fsspec.register_implementation("acpnorange", _NoRangeFS, clobber=True)
    storage.register_scheme("acpnorange", lambda: FsspecStorage("acpnorange", {}))
    try:
        rng = np.random.default_rng(3)
        state = {"m": {f"w{i:02d}": rng.standard_normal(4096).astype(np.float32) for i in range(40)}}
        acp.save(tmp_path / "ck", state)
        back = {"m": {k: np.zeros(4096, np.float32) for k in ("w03", "w20", "w39")}}
        acp.load(f"acpnorange://{tmp_path}/ck", back, strict=False)
        assert all(np.array_equal(v, state["m"][k]) for k, v in back["m"].items())
        (tmp_path / "obj").write_bytes(bytes(range(256)) * 4)
        backend, root = storage.storage_for(f"acpnorange://{tmp_path}")
        reads = backend.ranged_reads(root)
        assert reads.read("obj", byte_range=slice(10, 20)).result().value == bytes(range(10, 20))
        assert reads.read("obj", byte_range=slice(-6, None)).result().value == bytes(range(250, 256))
        _NoRangeFS.extra = b"?"
        with pytest.raises(StorageError, match="1025 bytes came back for a range of 10 bytes"):
            reads.read("obj", byte_range=slice(10, 20)).result()
    finally:
        _NoRangeFS.extra = b""
        storage.register_scheme("acpnorange", None)
