"""Local POSIX backend: the conformance suite plus what only the rename strategy has."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError, StorageError
from arraycheckpoint.storage import LocalStorage, storage_for
from arraycheckpoint.storage.localnames import lock_path
from arraycheckpoint.testing.storage import StorageTests


class TestLocal(StorageTests):
    @pytest.fixture
    def base_url(self, tmp_path: Path) -> str:
        return str(tmp_path / "ckpts")

    @pytest.fixture
    def zarr_store(self):
        import zarr

        return lambda root: zarr.storage.LocalStore(root, read_only=True)


class TestLocalFileUrl(StorageTests):
    @pytest.fixture
    def base_url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/ckpts"

    @pytest.fixture
    def zarr_store(self):
        import zarr

        return lambda root: zarr.storage.LocalStore(root, read_only=True)


def test_staging_is_a_hidden_sibling_and_rename_is_atomic(tmp_path: Path) -> None:
    backend, final = storage_for(tmp_path / "step_1")
    assert isinstance(backend, LocalStorage) and backend.commit_strategy == "rename"
    staging = backend.staging_root(final, "tok")
    # beside the target, and not named after it (a framework scanning the folder for "step_1" skips it)
    assert os.path.dirname(staging) == str(tmp_path) and os.path.basename(staging) == ".acp-staging-tok"
    backend.acquire(final, "tok")
    owner = json.loads(lock_path(tmp_path / "step_1").read_text())  # who holds it, for a no-flock judge
    assert (owner["token"], owner["pid"], owner["host"]) == ("tok", os.getpid(), socket.gethostname())
    backend.write(staging, "x", b"1")
    inode = os.stat(staging).st_ino
    backend.commit(staging, final, overwrite=False)
    backend.release(final, "tok")
    assert os.stat(final).st_ino == inode  # the very directory was renamed, not copied
    assert sorted(os.listdir(tmp_path)) == ["step_1"]


def test_commit_refuses_a_checkpoint_committed_meanwhile(tmp_path: Path) -> None:
    backend, final = storage_for(tmp_path / "c")
    s1 = backend.staging_root(final, "a")
    s2 = backend.staging_root(final, "b")
    backend.write(s1, "x", b"1")
    backend.write(s2, "x", b"2")
    backend.commit(s1, final, overwrite=False)
    with pytest.raises(CheckpointExistsError, match="committed by someone else"):
        backend.commit(s2, final, overwrite=False)
    assert backend.read(final, "x") == b"1"


def test_cleanup_leftovers_keeps_checkpoints(tmp_path: Path) -> None:
    backend = LocalStorage()
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / ".committed").write_text("committed\n")
    (tmp_path / ".step_2.acp-staging-abc").mkdir()
    (tmp_path / ".step_2.acp-staging-abc" / "data").write_bytes(b"x")
    (tmp_path / ".step_2.acp-lock").write_text("abc")
    (tmp_path / "step_1.acp-old-.step_1.acp-staging-x").mkdir()
    (tmp_path / ".step_3.acp-trash-1234").mkdir()
    (tmp_path / "notes.txt").write_text("user file")
    removed = backend.cleanup_leftovers(str(tmp_path))
    assert len(removed) == 4
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step_1"]


HOLD = """
import os, sys, time
from arraycheckpoint.storage import storage_for
backend, final = storage_for(sys.argv[1])
backend.acquire(final, "inflight")
backend.write(backend.staging_root(final, "inflight"), "x", b"1")  # a save in flight writes here
print("held", flush=True)
time.sleep(120)
"""


def _holder(tmp_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "step_2")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_save_keeps_its_lock_and_a_crashed_ones_is_taken_over(tmp_path: Path, caplog) -> None:
    """Another process's save in flight: a second save is refused and a CheckpointManager starting on the
    root (an evaluation job) leaves its lock and staging alone (it deleted both: the save then failed). Once
    that process is killed (SIGKILL: no cleanup ran), its lock is a crashed save's: the next save takes it
    over with a warning (it was refused until someone removed the lock by hand)."""
    proc = _holder(tmp_path)
    try:
        with pytest.raises(acp.CheckpointExistsError, match="in progress"):
            acp.save(str(tmp_path / "step_2"), {"w": np.arange(3)})
        mgr = acp.CheckpointManager(str(tmp_path))
        assert mgr.removed == []
        left = sorted(os.listdir(tmp_path))
        assert left == sorted([lock_path(tmp_path / "step_2").name, ".acp-staging-inflight"]), left
    finally:
        proc.kill()
        proc.wait()
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
        acp.save(str(tmp_path / "step_2"), {"w": np.arange(3)})
    assert "taking over" in caplog.text and "inflight pid" in caplog.text
    back = {"w": np.zeros(3, dtype=np.int64)}
    acp.load(str(tmp_path / "step_2"), back)
    assert np.array_equal(back["w"], np.arange(3))
    mgr = acp.CheckpointManager(str(tmp_path))  # the crashed save's staging goes now
    assert sorted(os.listdir(tmp_path)) == ["step_2"], mgr.removed


def test_cleanup_puts_back_the_newest_of_two_replaced_copies(tmp_path: Path) -> None:
    """Two overwrites of one step that each crashed between their renames left two committed copies aside
    and no step: cleanup restores the newer (it restored whichever name sorted first, then deleted the
    other: the newer one, half the time)."""
    for value in (1, 2):
        acp.save(str(tmp_path / "s"), {"w": np.full(3, value)}, overwrite=True)
        os.rename(tmp_path / "s", tmp_path / f"s.acp-old-.s.acp-staging-{'ab'[value - 1]}{value}")
        time.sleep(0.01)  # distinct commit times
    LocalStorage().cleanup_leftovers(str(tmp_path))
    back = {"w": np.zeros(3, dtype=np.int64)}
    acp.load(str(tmp_path / "s"), back)
    assert np.array_equal(back["w"], np.full(3, 2))
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_a_write_error_reported_by_the_flush_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """syncfs(2) reporting EIO (a write the disk never took) fails the flush naming the path; it was dropped
    (the flush fell back to sync(2), which reports nothing)."""
    from arraycheckpoint.storage import local

    def failing(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(local, "_syncfs", failing)
    with pytest.raises(StorageError, match="Input/output error"):
        LocalStorage().flush(str(tmp_path))
