"""A local commit makes the metadata, the commit marker and its directory entry durable with one ``syncfs``
after the marker is written and before the rename publishes the checkpoint (it took a flush after the
metadata and two ``fsync`` calls after the marker: three device flushes, one now)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import arraycheckpoint as acp
from arraycheckpoint.storage import local


def test_the_marker_and_the_metadata_are_synced_once_before_the_rename(tmp_path: Path, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    real_open, real_syncfs, real_rename, real_fsync = os.open, local._syncfs, os.rename, os.fsync

    def opened(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_CREAT:
            events.append(("create", os.fspath(path)))
        return fd

    def syncfs(fd):
        events.append(("syncfs", ""))
        return real_syncfs(fd)

    def renamed(src, dst):
        events.append(("rename", os.fspath(dst)))
        return real_rename(src, dst)

    def fsync(fd):
        events.append(("fsync", ""))
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(local, "_syncfs", syncfs)
    monkeypatch.setattr(os, "rename", renamed)
    monkeypatch.setattr(os, "fsync", fsync)
    final = str(tmp_path / "step")
    state = {"w": np.arange(1000, dtype=np.float32)}
    acp.save(final, {"model": state})
    monkeypatch.undo()
    marker = max(i for i, (what, p) in enumerate(events) if what == "create" and p.endswith("/committed"))
    metadata = max(
        i for i, (what, p) in enumerate(events) if what == "create" and p.endswith("metadata.json")
    )
    commit = next(i for i, (what, p) in enumerate(events) if what == "rename" and p == final)
    assert metadata < marker < commit
    between = [what for what, _p in events[metadata + 1 : commit]]
    assert between.count("syncfs") == 1 and "fsync" not in between, events
    assert events.index(("syncfs", ""), marker) < commit  # after the marker: it covers it
    assert events[commit + 1 :][:1] == [("fsync", "")]  # the parent's entry of the renamed checkpoint
    out = {"w": np.zeros(1000, np.float32)}
    acp.load(final, {"model": out})
    assert np.array_equal(out["w"], state["w"])
