"""Helpers of the lease tests (``test_lease_guards.py``, ``test_cleanup_lease.py``): short leases, a store
whose lock refreshes stop, deletes that stall, a save taking a lock over once it may."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import locks, storage_for


@pytest.fixture
def short_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(locks.HEARTBEAT_ENV, "0.2")
    monkeypatch.setenv(locks.LEASE_ENV, "5")  # 1 s leases, safe part 0.8 s


def fresh_url() -> str:
    return f"memory://guards-{uuid.uuid4().hex[:8]}/step_1"


def frozen(storage: Any) -> None:
    """``storage``'s refreshes stop reaching the store (a host frozen or cut off): its lease runs out."""

    def refused(final: str, body: bytes, generation: bytes) -> bytes:
        raise OSError("the store is unreachable")

    storage._refresh_lock = refused


def take_over_and_commit(url: str, n: int) -> Any:
    """Wait for the lock of ``url`` to be a crashed save's, take it, write ``n`` chunks and commit."""
    taker, final = storage_for(url)
    deadline = time.monotonic() + 30
    while True:
        try:
            taker.check_target(final, False)
            taker.acquire(final, "taker")
            break
        except CheckpointExistsError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for i in range(n):
        taker.write(final, f"a/c.{i}", b"taker")
    taker.commit(final, final, False)
    taker.release(final, "taker")
    return taker


def stalling_deletes(storage: Any, after: int, resume: threading.Event) -> list[str]:
    """Make ``storage``'s deletes land, and after the ``after``-th wait for ``resume`` (the host stopped
    there); the keys deleted."""
    real, done = storage.delete_key, []

    def delete_key(root: str, key: str, guard: Any = None) -> None:
        real(root, key, guard)
        done.append(key)
        if len(done) == after:
            resume.wait(30)

    storage.delete_key = delete_key
    return done


_HOLD = """
import sys, time
from arraycheckpoint.storage import storage_for
backend, final = storage_for(sys.argv[1])
backend.acquire(final, sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def lock_held(path: str, token: str) -> Iterator[None]:
    """Another process holds the save lock of ``path`` as the save ``token`` (a live save) while inside."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path, token], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield
    finally:
        proc.kill()
        proc.wait()
