"""A ranged read on a process that cannot start a thread (at its thread limit) fails, and leaves nothing
behind: its store call's slots are given back, and its queued job is never sent later.

Before (review23a P1): a store call whose thread could not start (``Thread.start`` raising "can't start new
thread" in :func:`~arraycheckpoint.storage.retry.call_within`) kept one of its store's 64 call slots and one of
the process's 256 for good: after 64 such failures every read of that store failed as a stall, though threads
started again and the store answered. And (suspicion (a)) a read whose worker thread could not start raised,
but its job stayed queued: the next read's worker sent it, a read nobody waited for, holding a call slot."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec_helpers import LocalUnder

from arraycheckpoint.errors import StorageError
from arraycheckpoint.storage import ranged
from arraycheckpoint.storage.fsspec_store import FsspecStorage

_SENT: list[tuple[Any, Any]] = []  # the ranges the recording store was asked for


class _RecordingFS(LocalUnder):
    protocol = ("acprecord",)

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> Any:
        _SENT.append((start, end))
        return super().cat_file(path, start=start, end=end, **kw)


def _no_threads_named(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """The process at its thread limit, for the threads whose name starts with ``prefix``."""
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def test_store_calls_that_cannot_start_give_their_slots_back(tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(bytes(range(256)))
    storage = FsspecStorage("file", {"acp_test_session": uuid.uuid4().hex})  # a store of its own
    storage.stall_timeout = 1.0
    reads = storage.ranged_reads(f"file://{tmp_path}")
    store = ranged._store_of(storage.fs, f"file://{tmp_path}/obj")
    with pytest.MonkeyPatch.context() as mp:
        _no_threads_named(mp, "acp-store-call")
        for i in range(ranged._CALLS + 1):
            with pytest.raises(StorageError, match="can't start new thread"):
                reads.read("obj", byte_range=slice(i, i + 4)).result()
    # threads start again: so does every read of the store (before: each failed as a stall, all 64 slots taken)
    assert reads.read("obj", byte_range=slice(3, 7)).result().value == bytes(range(3, 7))
    assert store.calls.acquire(blocking=False)
    store.calls.release()


def test_a_read_without_a_worker_is_never_sent_later(tmp_path: Path) -> None:
    fsspec.register_implementation("acprecord", _RecordingFS, clobber=True)
    (tmp_path / "obj").write_bytes(bytes(range(256)))
    storage = FsspecStorage("acprecord", {"acp_test_session": uuid.uuid4().hex})  # no worker runs yet
    storage.stall_timeout = 1.0
    reads = storage.ranged_reads(f"acprecord://{tmp_path}")
    _SENT.clear()
    with pytest.MonkeyPatch.context() as mp:
        _no_threads_named(mp, "acp-ranged-read")
        with pytest.raises(RuntimeError, match="can't start new thread"):
            reads.read("obj", byte_range=slice(10, 20))
    assert reads.read("obj", byte_range=slice(3, 7)).result().value == bytes(range(3, 7))
    assert _SENT == [(3, 7)]  # the failed read's job was not sent by the later read's worker
