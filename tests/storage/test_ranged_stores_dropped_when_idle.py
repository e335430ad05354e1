"""The table of stores of the ranged reads drops a store once nothing uses it (no worker, no read's future,
no call in flight), so loads with options that differ every time (rotated credentials) do not pile up entries.

Before (review23a P4): ``ranged._stores`` kept one entry per distinct options for good."""

from __future__ import annotations

import gc
import time
import uuid
import weakref
from pathlib import Path

import pytest

from arraycheckpoint.storage import ranged
from arraycheckpoint.storage.fsspec_store import FsspecStorage


def test_idle_stores_are_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranged, "_IDLE_SECONDS", 0.2)  # workers end soon once idle
    (tmp_path / "obj").write_bytes(b"x" * 64)
    gone = []
    for _ in range(20):  # 20 loads, each with a session token of its own
        storage = FsspecStorage("file", {"acp_test_session": uuid.uuid4().hex})
        read = storage.ranged_reads(f"file://{tmp_path}").read("obj", byte_range=slice(1, 5))
        assert read.result().value == b"xxxx"
        gone.append(weakref.ref(ranged._store_of(storage.fs, f"file://{tmp_path}/obj")))
        del read, storage
    for _ in range(300):  # until their workers ended (polled: no wall-clock assertion)
        gc.collect()
        if all(ref() is None for ref in gone):
            break
        time.sleep(0.1)
    assert [ref() for ref in gone] == [None] * 20
