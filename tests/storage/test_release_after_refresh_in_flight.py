"""A save's release of its lease-lock is not undone by the lock's own refresh landing during it.

Before (review23c D2): the refresh thread's conditional write, on its way when the save released its lock,
landed between the release's read of the lock and its conditional delete of the generation read: the delete
matched nothing (its answer, False, was ignored) and the lock stayed, naming the finished save and refreshed
just now; the next save to the target was refused as "in progress" for up to the lease (60 s by default).
Now the release waits for a refresh in flight before it reads, and a refused delete of a lock that still
names the save reads it again and deletes what is stored.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from arraycheckpoint.storage import lease, storage_for


def _gate_refreshes(storage: Any) -> tuple[threading.Event, threading.Event]:
    """``storage``'s lock refreshes wait for ``go`` before they write; ``landed`` is set once one did."""
    go, landed = threading.Event(), threading.Event()
    real = storage._refresh_lock

    def refresh_lock(final: str, body: bytes, generation: bytes) -> bytes:
        go.wait(30)
        try:
            return real(final, body, generation)
        finally:
            landed.set()

    storage._refresh_lock = refresh_lock
    return go, landed


def _next_save_claims(url: str) -> None:
    other, final = storage_for(url)
    other.check_target(final, overwrite=False)
    other.acquire(final, "next")  # before: CheckpointExistsError, "another save ... is in progress"
    other.release(final, "next")


def test_a_refresh_in_flight_during_release_leaves_no_lock() -> None:
    url = f"memory://release-{uuid.uuid4().hex[:8]}/step_1"
    storage, final = storage_for(url)
    storage.acquire(final, "mine")
    go, landed = _gate_refreshes(storage)
    key = (id(storage), final, "mine")
    with lease._guard:  # the heartbeat's round started this lease's refresh: it is on its way
        lease._refreshing.add(key)
        entry = lease._held[key]
    refresher = threading.Thread(target=lease._refresh_one, args=(key, entry))
    refresher.start()
    real_state = storage._lock_state

    def lock_state(f: str, retry: bool = True) -> tuple[bytes | None, bytes]:
        out = real_state(f, retry)
        if threading.current_thread() is not refresher:  # the release read the lock: the refresh lands now
            go.set()
            landed.wait(30)
        return out

    storage._lock_state = lock_state
    threading.Timer(0.3, go.set).start()  # the refresh's answer comes, whether or not the release waits
    storage.release(final, "mine")
    refresher.join(30)
    assert storage.read(final, ".acp-lock") is None
    _next_save_claims(url)


def test_a_refresh_landing_between_the_release_read_and_delete_leaves_no_lock() -> None:
    url = f"memory://release-{uuid.uuid4().hex[:8]}/step_1"
    storage, final = storage_for(url)
    storage.acquire(final, "mine")
    key = (id(storage), final, "mine")
    entry = lease._held[key]
    real_state, reads = storage._lock_state, []

    def lock_state(f: str, retry: bool = True) -> tuple[bytes | None, bytes]:
        out = real_state(f, retry)
        reads.append(out)
        if len(reads) == 1:  # a refresh whose write was already sent lands right after the release's read
            lease._refresh(key, entry)
        return out

    storage._lock_state = lock_state
    storage.release(final, "mine")
    assert storage.read(final, ".acp-lock") is None
    _next_save_claims(url)
