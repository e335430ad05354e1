"""Save locks on local file systems against races and hostile paths (session 20 review): a save in
flight keeps its staging when another job's manager cleans up (tokens hold a dash: matched by the last
part, they never matched, and the save then committed a checkpoint of nothing); two savers never both hold
one lock; cleanup never removes a lock a save took over after its probe; on NFS (flock emulated with POSIX
write locks) the probe does not crash; a lock path that is a directory is a clear error."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import arraycheckpoint as acp
from arraycheckpoint.storage import local, locks
from arraycheckpoint.storage.local import LocalStorage
from arraycheckpoint.storage.localnames import lock_path


def test_cleanup_keeps_staging_of_live_save_with_real_token(tmp_path: Path) -> None:
    """engine/save.py:82 makes tokens '<session>-<n>'; cleanup matches staging names by rsplit('-')[-1]."""
    saver, manager = LocalStorage(), LocalStorage()
    final = str(tmp_path / "step_00000001")
    token = "3f9a1c2b-0"  # the shape engine/save.py:82 gives: f"{comm.session_id}-{counter}"
    saver.acquire(final, token)
    staging = saver.staging_root(final, token)
    saver.write(staging, "w/c/0", b"chunk")  # rank writes of the save in flight
    try:
        removed = manager.cleanup_leftovers(str(tmp_path))
        assert staging not in removed
        assert os.path.exists(os.path.join(staging, "w/c/0")), "live save's staging deleted"
    finally:
        saver.release(final, token)


def test_acquire_refuses_when_its_own_flock_is_taken(tmp_path: Path, monkeypatch) -> None:
    """Race: B finds A's just-created (not yet flocked) lock file, takes it over as stale; A's flock then fails
    but acquire ignores _flock's False and both hold the lock."""
    a, b = LocalStorage(), LocalStorage()
    final = str(tmp_path / "step")
    real = locks.flock_state
    calls = {"n": 0}

    def flock_after_b(fd: int) -> str:
        calls["n"] += 1
        if calls["n"] == 1:  # A, between its O_EXCL open and its flock: B arrives
            monkeypatch.setattr(locks, "flock_state", real)
            b.acquire(final, "bbbb-0")
        return real(fd)

    monkeypatch.setattr(locks, "flock_state", flock_after_b)
    try:
        a.acquire(final, "aaaa-0")
        raise AssertionError("both A and B hold the lock of one target")
    except AssertionError:
        raise
    except Exception:
        pass


def test_cleanup_never_deletes_a_lock_taken_over_after_its_probe(tmp_path: Path, monkeypatch) -> None:
    """A crashed save's lock: cleanup probes it (not live), a new save takes it over, cleanup removes it."""
    final = str(tmp_path / "step")
    lock_path(tmp_path / "step").write_text("dead-0 pid 1 on x")  # crashed save, nobody holds it
    saver, manager = LocalStorage(), LocalStorage()
    real = local._live_tokens

    def probe_then_save(parent, names):
        live = real(parent, names)
        saver.acquire(final, "new-0")  # a new save starts after the probe, takes the stale lock over
        return live

    monkeypatch.setattr(local, "_live_tokens", probe_then_save)
    manager.cleanup_leftovers(str(tmp_path))
    try:
        assert lock_path(tmp_path / "step").exists(), "cleanup deleted the lock of a save in flight"
    finally:
        saver.release(final, "new-0")


def test_cleanup_probe_on_nfs_style_flock(tmp_path: Path, monkeypatch) -> None:
    """NFS emulates flock with POSIX locks: LOCK_EX on an O_RDONLY descriptor fails with EBADF (flock(2)).
    _live_tokens opens O_RDONLY and _flock re-raises EBADF: the manager's cleanup crashes."""
    import errno
    import fcntl

    lock_path(tmp_path / "step").write_text("dead-0 pid 1 on x")
    real = fcntl.flock

    def nfs_flock(fd, op):
        if op & fcntl.LOCK_EX and (os.fstat(fd) and (local.os.O_ACCMODE & _acc(fd)) == os.O_RDONLY):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)

    def _acc(fd):
        import fcntl as f

        return f.fcntl(fd, f.F_GETFL)

    monkeypatch.setattr(locks.fcntl, "flock", nfs_flock)
    LocalStorage().cleanup_leftovers(str(tmp_path))  # raises OSError EBADF


def test_acquire_on_a_lock_path_that_is_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    """_take_stale runs inside acquire's `except FileExistsError:` handler, so its OSError escapes raw."""
    import pytest

    from arraycheckpoint.errors import ArrayCheckpointError

    lock_path(tmp_path / "step").mkdir()
    with pytest.raises(ArrayCheckpointError):
        LocalStorage().acquire(str(tmp_path / "step"), "t-0")


def test_cleanup_during_save_keeps_the_save(tmp_path, monkeypatch) -> None:
    state = {"extra_state": {"w": np.arange(1 << 12, dtype=np.float32)}}
    real = LocalStorage.commit
    removed: list[str] = []

    def commit(self, staging, final, overwrite):
        removed.extend(LocalStorage().cleanup_leftovers(str(tmp_path)))  # another job's manager starts now
        return real(self, staging, final, overwrite)

    monkeypatch.setattr(LocalStorage, "commit", commit)
    url = str(tmp_path / "step_1")
    acp.save(url, state)  # returns: "committed"
    assert not removed, removed  # FAILS: the live save's staging was removed
    assert sorted(os.listdir(os.path.join(url, ".acp"))) != ["committed", "metrics.json"]
    back = acp.load(url, {"extra_state": {"w": np.zeros(1 << 12, np.float32)}})["extra_state"]["w"]
    assert np.array_equal(back, state["extra_state"]["w"])
