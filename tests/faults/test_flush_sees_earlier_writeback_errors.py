"""Linux reports a write-back error to ``syncfs(2)`` only when it happened after the descriptor passed to it was
opened (the file system's error sequence is sampled at ``open``). The flush must therefore sync on a
descriptor opened before the save's first write: one opened at the flush misses an error from write-back the
writer started earlier, and the save committed data the disk never took.

Proven with a real write-back error where this machine allows it (root: an ext4 file system on a loop device
whose backing file lives on a small tmpfs, so write-back fails while the tmpfs is full; before the flush the
space is freed, as a storage path that recovers would, and another process syncs the file system, which makes
the error "seen": Linux tells a descriptor opened after that nothing), and everywhere by the order of the
calls."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import ArrayCheckpointError, CheckpointNotFoundError
from arraycheckpoint.storage import local
from arraycheckpoint.storage.local import LocalStorage

MiB = 1 << 20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def _failing_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``(mount point, filler)``: ext4 on a loop device over a sparse 128 MiB file on a 24 MiB tmpfs, the
    tmpfs filled but for 2 MiB by ``filler`` (removing it lets write-back succeed again). Skips where this
    process may not mount."""
    tools = ("mkfs.ext4", "losetup", "sync")
    if os.geteuid() != 0 or not os.path.exists("/dev/loop-control") or not all(map(shutil.which, tools)):
        pytest.skip("needs root, loop devices and mkfs.ext4 to produce a real write-back error")
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    loop = None
    mounted: list[Path] = []
    try:
        try:
            _run("mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(backing))
            mounted.append(backing)
            image = backing / "disk.img"
            with open(image, "wb") as f:
                f.truncate(128 * MiB)
            loop = subprocess.run(
                ["losetup", "-f", "--show", str(image)],
                check=True,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.strip()
            _run("mkfs.ext4", "-q", "-O", "^has_journal", "-E", "lazy_itable_init=0", loop)
            _run("mount", "-o", "errors=continue", loop, str(mnt))
            mounted.append(mnt)
        except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot mount a loop device here: {e}")
        free = os.statvfs(backing)
        filler = backing / "filler"
        with open(filler, "wb") as f:
            f.write(b"\xff" * (free.f_bavail * free.f_frsize - 2 * MiB))
        yield mnt, filler
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", "-l", str(m)], capture_output=True, timeout=60)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True, timeout=60)


def test_a_writeback_error_before_the_flush_fails_the_save(tmp_path: Path, monkeypatch) -> None:
    with _failing_disk(tmp_path) as (mnt, filler):
        small = {"w": np.arange(1024, dtype=np.float32)}
        acp.save(str(mnt / "step_1"), {"model": small})  # fits: committed (and warms up descriptors)
        real = LocalStorage.flush
        state = {"freed": False}

        def recover_then_flush(self: LocalStorage, root: str) -> None:
            if not state["freed"]:
                os.sync()  # the write-back of every file has been tried, and failed, by now
                filler.unlink()  # the disk recovers
                # another process syncs this file system (a second job, a rank of another save, `sync -f`):
                # it is told of the error, which is from then on "seen", and a descriptor opened after that
                # is never told of it
                subprocess.run(["sync", "-f", str(mnt)], capture_output=True, timeout=60)
                state["freed"] = True
            real(self, root)

        monkeypatch.setattr(LocalStorage, "flush", recover_then_flush)
        before = _fds()
        big = {"w": np.random.default_rng(0).random(2 * MiB, dtype=np.float32)}  # 8 MiB: 2 MiB fit
        with pytest.raises(ArrayCheckpointError) as info:
            acp.save(str(mnt / "step_2"), {"model": big})
        assert state["freed"], "the flush never ran"
        text = str(info.value)
        assert "a write did not reach the disk" in text and "step_2" in text, text
        assert not (mnt / "step_2").exists()
        assert [n for n in os.listdir(mnt) if "step_2" in n] == [], os.listdir(mnt)  # staging removed
        with pytest.raises(CheckpointNotFoundError):
            acp.load(str(mnt / "step_2"), {"model": {"w": np.zeros(2 * MiB, np.float32)}})
        assert _fds() == before, "a descriptor outlived the failed save"
        back = {"w": np.zeros(1024, np.float32)}
        acp.load(str(mnt / "step_1"), {"model": back})
        assert np.array_equal(back["w"], small["w"])


def _recorded_save(path: str, state: dict, options: acp.PlanOptions) -> list[tuple[str, str, int]]:
    """Every ``os.open``, ``os.close`` and ``syncfs`` of ``acp.save(path, state)``, in order."""
    return _recorded(lambda: acp.save(path, state, plan_options=options))


def _recorded(save) -> list[tuple[str, str, int]]:
    """Every ``os.open``, ``os.close`` and ``syncfs`` of ``save()``, in order."""
    events: list[tuple[str, str, int]] = []
    real_open, real_close, real_syncfs = os.open, os.close, local._syncfs

    def opening(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        events.append(("open", os.fsdecode(path), fd))
        return fd

    def closing(fd: int) -> None:
        events.append(("close", "", fd))
        real_close(fd)

    def syncing(fd: int) -> int:
        events.append(("syncfs", os.readlink(f"/proc/self/fd/{fd}"), fd))
        return real_syncfs(fd)

    os.open, os.close, local._syncfs = opening, closing, syncing
    try:
        save()
    finally:
        os.open, os.close, local._syncfs = real_open, real_close, real_syncfs
    return events


def _check_order(events: list[tuple[str, str, int]]) -> int:
    """The descriptor each ``syncfs`` ran on was opened on the staging directory before the first chunk file
    was, stayed open until then, and was closed after; returns how many chunk files were written."""
    syncs = [i for i, e in enumerate(events) if e[0] == "syncfs"]
    chunks = [i for i, e in enumerate(events) if e[0] == "open" and "/model/" in e[1] and "/c." in e[1]]
    assert syncs and chunks and chunks[0] < syncs[0], events
    for i in syncs:
        fd = events[i][2]
        opened = max(j for j in range(i) if events[j][0] == "open" and events[j][2] == fd)
        assert opened < chunks[0], (
            f"the flush's descriptor was opened after the first write: {events[opened]}"
        )
        assert ".acp-staging-" in events[opened][1], events[opened]
        assert not any(e[0] == "close" and e[2] == fd for e in events[opened:i]), "closed before its syncfs"
        assert any(e[0] == "close" and e[2] == fd for e in events[i:]), "the flush's descriptor leaked"
    return len(chunks)


OWN_FILES = acp.PlanOptions(pack_array_bytes=0)


def test_the_flush_syncs_on_a_descriptor_opened_before_the_first_write(tmp_path: Path) -> None:
    state = {"model": {"w": np.arange(1 << 19, dtype=np.float32), "v": np.ones(7, np.float32)}}
    assert _check_order(_recorded_save(str(tmp_path / "step"), state, OWN_FILES)) == 2


def test_the_dcp_writer_syncs_on_a_descriptor_opened_before_the_first_write(tmp_path: Path) -> None:
    """``dcp.save`` through ``acp.dcp.Writer``: its ranks' flush and the coordinator's (after the metadata) sync
    on descriptors opened before what they cover was written."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "step")
    state = {"model": {"w": torch.arange(1 << 16, dtype=torch.float32)}}
    events = _recorded(lambda: dcp.save(state, storage_writer=acp.dcp.Writer(path), no_dist=True))
    syncs = [i for i, e in enumerate(events) if e[0] == "syncfs"]
    assert len(syncs) == 2, events  # the rank's data, then the commit (the metadata and the marker)
    previous = -1
    for i in syncs:
        fd = events[i][2]
        opened = max(j for j in range(i) if events[j][0] == "open" and events[j][2] == fd)
        staging = events[opened][1]
        assert ".acp-staging-" in staging, events[opened]
        written = [
            j
            for j in range(previous + 1, i)
            if events[j][0] == "open" and events[j][1].startswith(staging + "/")
        ]
        assert written and opened < written[0], (
            f"the flush's descriptor was opened after a write it covers: {events}"
        )
        assert any(e[0] == "close" and e[2] == fd for e in events[i:]), "the flush's descriptor leaked"
        previous = i
    back = {"model": {"w": torch.zeros(1 << 16)}}
    dcp.load(back, storage_reader=acp.dcp.Reader(path), no_dist=True)
    assert torch.equal(back["model"]["w"], state["model"]["w"])


def _replicated() -> dict:
    import torch

    return {"a": torch.arange(1 << 18, dtype=torch.float32), "b": torch.ones(1 << 18)}


def _two_rank_body(rank: int, world: int, path: str) -> int:
    return _check_order(_recorded_save(path, {"model": _replicated()}, OWN_FILES))


def test_every_rank_that_writes_syncs_on_its_early_descriptor(tmp_path: Path) -> None:
    """2 real gloo ranks, each writing one of two replicated arrays: each rank's own flush ran on a
    descriptor it opened before its first write."""
    from dist import run_distributed

    path = str(tmp_path / "step")
    assert run_distributed(_two_rank_body, world=2, args=(path,)) == [1, 1]
    back = {"model": {k: v * 0 for k, v in _replicated().items()}}
    acp.load(path, back)
    import torch

    assert all(torch.equal(back["model"][k], v) for k, v in _replicated().items())


def test_an_errno_from_syncfs_fails_the_save_naming_the_path(tmp_path: Path, monkeypatch) -> None:
    """The injected variant of the first test (any machine): the save fails naming the path, commits
    nothing, and leaves no descriptor open."""
    import ctypes
    import errno

    acp.save(str(tmp_path / "warm"), {"model": {"w": np.ones(4, np.float32)}})

    def failing(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(local, "_syncfs", failing)
    before = _fds()
    with pytest.raises(ArrayCheckpointError) as info:
        acp.save(str(tmp_path / "step"), {"model": {"w": np.ones(4, np.float32)}})
    assert "Input/output error" in str(info.value) and str(tmp_path / "step") in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["warm"]
    assert _fds() == before
