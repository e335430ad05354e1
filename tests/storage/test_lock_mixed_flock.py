"""Save locks on a POSIX file system where holders disagree about flock, and takeover markers or locks that
no save of ours left as they are.

A holder running without flock (``ARRAYCHECKPOINT_LOCK_NO_FLOCK=1``, or a mount without it) holds no flock on
its lock: a save that has flock finds it free, yet the owner document (alive on this host) keeps the lock
live. A taker holding the flock rewrites the lock in place, so the former holder's ``still_held`` compares
the token too. A lock or takeover marker with a modification time far in the future (a clock or a hand set
it) would never age: it counts as stale; a marker that is a directory is removed, not left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import locks
from arraycheckpoint.storage.local import LocalStorage
from arraycheckpoint.storage.localnames import lock_path

HOLD = """
import sys
from arraycheckpoint.storage.local import LocalStorage
LocalStorage().acquire(sys.argv[1], "nf-holder")
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_live_holder_without_flock_keeps_its_lock_against_a_saver_with_flock(tmp_path: Path) -> None:
    final = str(tmp_path / "step_1")
    env = {**os.environ, locks.NO_FLOCK_ENV: "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, final], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointExistsError, match="held by save nf-holder"):
            LocalStorage().acquire(final, "B")
        proc.send_signal(signal.SIGKILL)  # its process gone: the lock is a crashed save's, taken over at once
        proc.wait(timeout=60)
        storage = LocalStorage()
        storage.acquire(final, "B")
        assert locks.still_held(storage._lock(final), "B")
        storage.release(final, "B")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def test_a_lock_rewritten_in_place_by_another_save_is_not_still_held(tmp_path: Path) -> None:
    final = str(tmp_path / "step_1")
    storage = LocalStorage()
    storage.acquire(final, "A")
    lock = storage._lock(final)
    assert locks.still_held(lock, "A")
    fd = os.open(lock, os.O_WRONLY)  # a taker holding the flock rewrites the very file (same inode)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, locks.owner_document(locks.this_owner("B")), 0)
    finally:
        os.close(fd)
    assert not locks.still_held(lock, "A")
    storage.release(final, "A")  # names B: kept
    assert lock.exists()


def _stale_lock(tmp_path: Path, lock_age: float) -> tuple[str, Path]:
    final = tmp_path / "step_1"
    lock = lock_path(tmp_path / "step_1")
    doc = {"arraycheckpoint_lock": 1, "token": "old", "host": "otherhost", "boot_id": "x", "pidns": "y"}
    lock.write_text(json.dumps({**doc, "pid": 1, "start": 1, "heartbeat": 10.0}))
    os.utime(lock, (time.time() - lock_age,) * 2)
    return str(final), lock


@pytest.mark.parametrize(
    ("lock_age", "marker"),
    [(-86400.0, None), (3600.0, "dir"), (3600.0, "future-file")],
    ids=["lock-in-the-future", "marker-a-directory", "marker-in-the-future"],
)
def test_odd_locks_and_markers_are_taken_over_and_leave_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    lock_age: float,
    marker: str,
) -> None:
    monkeypatch.setenv(locks.NO_FLOCK_ENV, "1")
    final, lock = _stale_lock(tmp_path, lock_age)
    path = Path(str(lock) + ".takeover")
    if marker == "dir":
        path.mkdir()
        (path / "inside").write_text("x")
    elif marker == "future-file":
        path.write_text("")
        os.utime(path, (time.time() + 86400,) * 2)
    storage = LocalStorage()
    storage.acquire(final, "new")  # at the first attempt
    assert "taking over" in caplog.text
    if lock_age < 0 or marker == "future-file":
        assert "in the future" in caplog.text
    storage.release(final, "new")
    assert sorted(os.listdir(tmp_path)) == []
