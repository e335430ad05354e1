"""Save locks on a file system without flock (some NFS mounts, FUSE): simulated in this process by an
``flock`` that fails with ``ENOLCK`` (what such a file system answers) and in the processes it starts by
``ARRAYCHECKPOINT_LOCK_NO_FLOCK=1`` (the lock code then never takes or trusts an flock), with real processes
holding the locks. A crashed holder on this host is taken over as soon as its process is gone; a live one never
is; a holder on another host (its owner document says so) keeps its lock while it refreshes it, and loses it
once its lease ran out, after which its own commit is refused; of several takers exactly one wins; the lock file
is read as untrusted input."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.storage import locks
from arraycheckpoint.storage.local import LocalStorage
from arraycheckpoint.storage.localnames import lock_path

BEAT = 0.2  # seconds between a holder's refreshes, in these tests

HOLD = """
import os, sys
from arraycheckpoint.storage import storage_for
backend, final = storage_for(sys.argv[1])
backend.acquire(final, "inflight")
staging = backend.staging_root(final, "inflight")
backend.write(staging, "x", b"1")  # a save in flight writes here
print("held", flush=True)
sys.stdin.readline()  # then tries to commit
try:
    backend.commit(staging, final, False)
    print("committed", flush=True)
except Exception as e:
    print("refused:", e, flush=True)
"""


@pytest.fixture(autouse=True)
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees a file system without flock as the kernel reports it (``ENOLCK``); the holders
    and racers it starts are told so by the environment."""

    def flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setenv(locks.HEARTBEAT_ENV, str(BEAT))


def _env(lease_intervals: float) -> dict[str, str]:
    return {
        **os.environ,
        locks.NO_FLOCK_ENV: "1",
        locks.LEASE_ENV: str(lease_intervals),
        "PYTHONPATH": os.getcwd(),
    }


def _holder(target: Path, lease_intervals: float) -> subprocess.Popen:
    env = _env(lease_intervals)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)


def _save(target: Path, value: int = 3) -> None:
    acp.save(str(target), {"w": np.arange(value)})


def _loads(target: Path, value: int = 3) -> bool:
    back = {"w": np.zeros(value, dtype=np.int64)}
    acp.load(str(target), back)
    return bool(np.array_equal(back["w"], np.arange(value)))


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path: Path, monkeypatch, caplog) -> None:
    """The lease is long (200 s): only the holder's process being gone can let the next save in."""
    monkeypatch.setenv(locks.LEASE_ENV, "1000")
    target = tmp_path / "step_1"
    proc = _holder(target, 1000)
    try:
        with pytest.raises(acp.CheckpointExistsError, match=r"in progress .*save inflight pid"):
            _save(target)
        assert acp.CheckpointManager(str(tmp_path)).removed == []  # a live save's lock and staging stay
        left = sorted(os.listdir(tmp_path))
        assert left == sorted([".acp-staging-inflight", lock_path(tmp_path / "step_1").name])
        pid = proc.pid
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
            _save(target)
        assert f"taking over {lock_path(tmp_path / 'step_1')}" in caplog.text
        assert f"save inflight pid {pid}" in caplog.text and f"its process {pid} is gone" in caplog.text
        assert _loads(target)
        acp.CheckpointManager(str(tmp_path))  # the crashed save's staging goes now
        assert sorted(os.listdir(tmp_path)) == ["step_1"]
    finally:
        _end(proc)


def test_a_live_holder_keeps_its_lock_past_its_lease(tmp_path: Path, monkeypatch) -> None:
    """Lease 3 x 0.2 s; after 1.5 s the holder (same host, alive) still holds it, against saves and the
    manager's cleanup alike; it then commits."""
    monkeypatch.setenv(locks.LEASE_ENV, "3")
    target = tmp_path / "step_1"
    proc = _holder(target, 3)
    try:
        time.sleep(1.5)
        with pytest.raises(acp.CheckpointExistsError, match="in progress"):
            _save(target)
        assert LocalStorage().cleanup_leftovers(str(tmp_path)) == []
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("commit\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "committed"
    finally:
        _end(proc)


def _as_another_host(lock: Path) -> None:
    """Rewrite the owner document in place (same file, so the holder's refreshes still reach it) as a
    holder on another machine would have written it."""
    doc = json.loads(lock.read_text())
    doc.update(host="elsewhere.example", boot_id="00000000-0000-0000-0000-000000000000")
    with open(lock, "r+b") as f:
        f.truncate(0)
        f.write(json.dumps(doc).encode())


def test_another_hosts_lock_is_a_lease(tmp_path: Path, monkeypatch, caplog) -> None:
    """A holder on another host: kept while it refreshes its lock (well past the lease), taken over with a
    warning once it stopped refreshing for the lease (stopped with SIGSTOP: alive, but silent), and that
    holder's own commit is then refused."""
    monkeypatch.setenv(locks.LEASE_ENV, "4")  # 0.8 s
    target = tmp_path / "step_1"
    lock = lock_path(tmp_path / "step_1")
    proc = _holder(target, 4)
    try:
        _as_another_host(lock)
        time.sleep(2.0)  # 2.5 leases: refreshed all along
        with pytest.raises(acp.CheckpointExistsError, match="elsewhere.example"):
            _save(target)
        assert LocalStorage().cleanup_leftovers(str(tmp_path)) == []
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.0)
        with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
            _save(target)
        assert "taking over" in caplog.text and "on elsewhere.example: not refreshed for" in caplog.text
        assert _loads(target)
        proc.send_signal(signal.SIGCONT)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("commit\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        assert answer.startswith("refused:") and "was taken over" in answer, answer
        assert _loads(target)  # the taker's checkpoint, untouched
    finally:
        proc.send_signal(signal.SIGCONT)
        _end(proc)


RACE = """
import os, sys, time
from arraycheckpoint.storage import storage_for
backend, final = storage_for(sys.argv[1])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
try:
    backend.acquire(final, sys.argv[3])
    print("won", flush=True)
    time.sleep(2)  # still holding while the others try
except Exception as e:
    print("lost", type(e).__name__, flush=True)
"""


def test_of_several_takers_exactly_one_wins(tmp_path: Path) -> None:
    """A crashed holder's lock (its process gone), four processes taking it over at once: one wins."""
    target = tmp_path / "step_1"
    proc = _holder(target, 1000)
    proc.kill()
    proc.wait(timeout=60)
    go = tmp_path / "go"
    env = _env(1000)
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(target), str(go), f"racer{i}"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(4)
    ]
    time.sleep(1.5)  # all started and waiting
    go.touch()
    answers = [r.communicate(timeout=120)[0].split()[0] for r in racers]
    assert sorted(answers) == ["lost", "lost", "lost", "won"], answers
    lock = lock_path(tmp_path / "step_1")
    assert not lock.with_name(lock.name + ".takeover").exists()


def test_the_lock_file_is_untrusted_input(tmp_path: Path) -> None:
    """A lock that is a link is never followed, opened or removed (the save is refused, the file it points
    at is untouched); an oversized or malformed owner document names nobody and is judged by its age only."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    lock_path(tmp_path / "step_1").symlink_to(victim)
    with pytest.raises(acp.CheckpointExistsError):
        _save(tmp_path / "step_1")
    assert victim.read_text() == "keep me" and lock_path(tmp_path / "step_1").is_symlink()

    doc = json.loads(locks.owner_document(locks.this_owner("t")))
    assert locks.parse_owner(json.dumps(doc).encode()) == locks.this_owner("t")
    hostile = [
        b"x" * (locks.MAX_LOCK_BYTES + 1),
        b"[" * 100_000,
        b"\xff\xfe",
        json.dumps({**doc, "pid": "1"}).encode(),
        json.dumps({**doc, "pid": -1}).encode(),
        json.dumps({**doc, "host": "h" * 1000}).encode(),
        json.dumps({**doc, "heartbeat": float("inf")}).encode(),
        json.dumps({**doc, "arraycheckpoint_lock": 2}).encode(),
    ]
    for raw in hostile:
        assert locks.parse_owner(raw) is None, raw[:80]
    # a fresh lock whose document is not written yet (empty) is live: too young to be a crashed save's
    lock_path(tmp_path / "step_2").write_bytes(b"")
    with pytest.raises(acp.CheckpointExistsError):
        _save(tmp_path / "step_2")
